"""pdctl's CPU stand-in for an SGLang server (``python -m pdctl.sim``): SGLang's flags and
HTTP API, a real tiny transformer, real PD KV hand-off, real weight-update groups.

The names below are loaded on first use: ``python -m pdctl.sim.null`` (the null engine the
router benchmarks use) runs where torch is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports

if TYPE_CHECKING:
    from pdctl.sim.config import SimConfig
    from pdctl.sim.model import SimModelConfig, TinyLM, decode, encode, resolve_model, save_checkpoint
    from pdctl.sim.server import SimServer
    from pdctl.sim.weights_http import weights_checksum

_HOMES = {
    "SimConfig": "pdctl.sim.config",
    "SimModelConfig": "pdctl.sim.model",
    "TinyLM": "pdctl.sim.model",
    "decode": "pdctl.sim.model",
    "encode": "pdctl.sim.model",
    "resolve_model": "pdctl.sim.model",
    "save_checkpoint": "pdctl.sim.model",
    "SimServer": "pdctl.sim.server",
    "weights_checksum": "pdctl.sim.weights_http",
}


__getattr__ = lazy_exports(__name__, _HOMES)


__all__ = [
    "SimConfig",
    "SimModelConfig",
    "SimServer",
    "TinyLM",
    "decode",
    "encode",
    "resolve_model",
    "save_checkpoint",
    "weights_checksum",
]
