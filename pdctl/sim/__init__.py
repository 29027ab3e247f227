"""pdctl's CPU stand-in for an SGLang server (``python -m pdctl.sim``): SGLang's flags and
HTTP API, a real tiny transformer, real PD KV hand-off, real weight-update groups."""

from pdctl.sim.config import SimConfig
from pdctl.sim.model import SimModelConfig, TinyLM, decode, encode, resolve_model, save_checkpoint
from pdctl.sim.server import SimServer
from pdctl.sim.weights_http import weights_checksum

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
