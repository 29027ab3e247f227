"""What an RL framework needs to drive a running cluster (``pdctl endpoints``): each engine's
address, role, TP, bootstrap port and rank offset in a weight group the router's facade makes,
and the settings to paste into AReaL, slime and skyrl-train (docs/frameworks.md).

The rank offsets are the facade's (pdctl.router.transaction.groups): a framework that treats the
router as one engine of ``tp`` = all ranks sends ``rank_offset`` 1, and engine j joins at 1 + the
ranks of the engines before it, prefills first, then decodes, then regular engines, each in the
plan's order. Pure: it reads the cluster's state, touches no node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from pdctl.cluster.state import ClusterState
from pdctl.errors import LifecycleError
from pdctl.roles import Role

_ORDER = {Role.PREFILL.value: 0, Role.DECODE.value: 1, Role.REGULAR.value: 2}


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine as a framework sees it: id, role, URL, TP, bootstrap port (``None`` when it has none)
    and its first rank in the facade's weight group."""

    id: str
    role: str
    url: str
    tp: int
    bootstrap_port: int | None
    rank_offset: int

    @property
    def address(self) -> str:
        """``host:port``, as AReaL and slime take engine addresses (no scheme)."""
        return self.url.split("://", 1)[-1]


@dataclass(frozen=True)
class Endpoints:
    """A running cluster's router and engines, in the facade's weight-group order (``endpoints``)."""

    cluster: str
    router_url: str
    engines: tuple[EngineEndpoint, ...]

    @property
    def ranks(self) -> int:
        """Every engine's ranks: the TP of the one engine the router stands for."""
        return sum(e.tp for e in self.engines)

    @property
    def router_address(self) -> str:
        """The router's ``host:port`` (no scheme)."""
        return self.router_url.split("://", 1)[-1]

    def settings(self) -> dict[str, dict[str, str]]:
        """Per framework, what to set (as its own config spells it)."""
        router = urlsplit(self.router_url)
        n = self.ranks
        return {
            "areal": {
                "AREAL_LLM_SERVER_ADDRS": self.router_address,
                "rollout.backend": f"sglang:d1t{n}",
                "note": f"the router is AReaL's one server, of tp {n}: it fans every control call out to the "
                "engines with their own rank offsets (world size {0})".format(n + 1),
            },
            "slime": {
                "--rollout-external-engine-addrs": " ".join(e.address for e in self.engines),
                "--sglang-router-ip": router.hostname or "",
                "--sglang-router-port": str(router.port or 80),
                "note": "slime sends its control calls to each engine itself (cumulative rank offsets: mixed TP "
                "works), registers them with the router (already registered: answered as a success) and sends "
                "no key (see docs/frameworks.md)",
            },
            "skyrl-train": {
                "generator.remote_inference_engine_urls": f'["{self.router_address}"]',
                "generator.num_inference_engines": "1",
                "generator.inference_engine_tensor_parallel_size": str(n),
                "generator.backend": "sglang",
                "note": f"one remote engine of tp {n}: the router; its one-parameter updates are one fleet transaction",
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything ``pdctl endpoints`` prints: router, ranks, world size (ranks + the trainer's rank
        0), engines and per-framework settings, as JSON-ready data."""
        return {
            "cluster": self.cluster,
            "router": self.router_url,
            "ranks": self.ranks,
            "world_size": self.ranks + 1,
            "engines": [asdict(e) for e in self.engines],
            "settings": self.settings(),
        }


def endpoints(state: ClusterState) -> Endpoints:
    """The cluster's engines in the facade's weight-group order, with their rank offsets."""
    if not state.router_url:
        raise LifecycleError(f"cluster {state.name} has no router")
    served = [e for e in state.plan.engines if e.url]
    ordered = sorted(enumerate(served), key=lambda ie: (_ORDER.get(ie[1].role.value, 3), ie[0]))
    engines = []
    offset = 1
    for _, e in ordered:
        tp = e.tp or e.gpus or 1
        engines.append(EngineEndpoint(e.id, e.role.value, e.url, tp, e.bootstrap_port, offset))
        offset += tp
    return Endpoints(state.name, state.router_url, tuple(engines))
