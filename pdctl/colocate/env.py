"""The data plane's contract between the plan and both of its ends; no torch here (the planner
imports it on the control machine).

``pdctl up`` gives the trainer and every engine of a plan with ``placement.data_plane`` the
variable ``PDCTL_DATA_PLANE``: the union world as JSON (``DataPlaneSpec.to_json``). Trainer rank
``i`` (0..N-1) is union rank ``i``; the engine GPU it shares, TP rank ``j`` of engine ``e``, is
union rank ``N + i``. Rank 0 (trainer rank 0) hosts the rendezvous store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pdctl.choices import Choice

DATA_PLANE_ENV = "PDCTL_DATA_PLANE"
HOOK_FACTORY = "pdctl.colocate.engine:hook_factory"
"""What an engine's ``--forward-hooks`` specs name (SGLang imports it by this path)."""
DEFAULT_GROUP_NAME = "pdctl_data_plane"


class Tap(Choice):
    """What one forward hook of the data plane reads from its module."""

    INPUT_IDS = "input_ids"
    """The token ids: the first input of the embedding (``model.embed_tokens``)."""
    POSITIONS = "positions"
    """Each row's position: where a sequence starts (position 0) in a prefill batch."""
    AUX = "aux"
    """An auxiliary layer's output (the residual stream after ``model.layers.K``), as Eagle3 reads."""
    FINAL = "final"
    """The final hidden states (``model.norm``'s output); the step is cut after this one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRanks:
    """One engine in the union world: its TP ranks are union ranks ``first_rank .. + tp - 1``."""

    id: str
    tp: int
    first_rank: int

    @property
    def ranks(self) -> range:
        """Its union ranks."""
        return range(self.first_rank, self.first_rank + self.tp)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPlaneSpec:
    """The union world of one colocated cluster.

    ``batch_size`` sequences make one step of one engine; TP rank ``j`` of an engine of TP
    ``t`` sends sequences ``j*B/t .. (j+1)*B/t`` of it to its trainer rank. ``dtype`` None sends
    the hidden states as the engine computed them."""

    master_address: str
    master_port: int
    trainer_ranks: int
    engines: tuple[EngineRanks, ...]
    backend: str = "gloo"
    batch_size: int = 8
    aux_layers: tuple[int, ...] = ()
    dtype: str | None = None
    timeout_secs: float = 300.0
    join_timeout_secs: float = 900.0
    group_name: str = DEFAULT_GROUP_NAME

    @property
    def world_size(self) -> int:
        """The union world's size: every trainer rank plus every engine's TP ranks."""
        return self.trainer_ranks + sum(e.tp for e in self.engines)

    def engine(self, engine_id: str) -> EngineRanks:
        """The engine called ``engine_id``; KeyError naming the known ones."""
        for engine in self.engines:
            if engine.id == engine_id:
                return engine
        raise KeyError(f"engine {engine_id!r} is not in the data plane ({', '.join(e.id for e in self.engines)})")

    def pair_of_trainer(self, trainer_rank: int) -> tuple[EngineRanks, int]:
        """The engine and TP rank that send to ``trainer_rank`` (union rank ``N + trainer_rank``)."""
        union_rank = self.trainer_ranks + trainer_rank
        for engine in self.engines:
            if union_rank in engine.ranks:
                return engine, union_rank - engine.first_rank
        raise KeyError(f"trainer rank {trainer_rank} has no engine rank (world {self.world_size})")

    def trainer_of(self, engine: EngineRanks, tp_rank: int) -> int:
        """The trainer rank that TP rank ``tp_rank`` of ``engine`` sends to (``pair_of_trainer``'s inverse)."""
        return engine.first_rank + tp_rank - self.trainer_ranks

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``world_size`` added."""
        out = asdict(self)
        out["engines"] = [asdict(e) for e in self.engines]
        out["aux_layers"] = list(self.aux_layers)
        out["world_size"] = self.world_size
        return out

    def to_json(self) -> str:
        """Compact JSON with sorted keys, as ``$PDCTL_DATA_PLANE`` carries it; ``from_json`` reads it."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPlaneSpec:
        """The spec ``to_dict`` wrote; raises ``KeyError``, ``TypeError`` or ``ValueError`` on data
        that does not hold one."""
        return cls(
            master_address=str(data["master_address"]),
            master_port=int(data["master_port"]),
            trainer_ranks=int(data["trainer_ranks"]),
            engines=tuple(
                EngineRanks(id=str(e["id"]), tp=int(e["tp"]), first_rank=int(e["first_rank"])) for e in data["engines"]
            ),
            backend=_backend(data.get("backend", "gloo")),
            batch_size=int(data.get("batch_size", 8)),
            aux_layers=tuple(int(k) for k in data.get("aux_layers", ())),
            dtype=data.get("dtype"),
            timeout_secs=_secs(data.get("timeout_secs", 300.0)),
            join_timeout_secs=_secs(data.get("join_timeout_secs", 900.0)),
            group_name=str(data.get("group_name", DEFAULT_GROUP_NAME)),
        )

    @classmethod
    def from_json(cls, raw: str) -> DataPlaneSpec:
        """Raises ValueError naming what is wrong."""
        try:
            return cls.from_dict(json.loads(raw))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{DATA_PLANE_ENV} is not a data plane spec: {type(exc).__name__}: {exc}") from None

    @classmethod
    def from_env(cls) -> DataPlaneSpec:
        """Raises ValueError when the variable is missing or malformed."""
        raw = os.environ.get(DATA_PLANE_ENV)
        if not raw:
            raise ValueError(f"{DATA_PLANE_ENV} is not set: this process was not started by a plan with a data plane")
        return cls.from_json(raw)


BACKENDS = ("cuda_ipc", "gloo")


def _secs(value: object) -> float:
    """A number of seconds as written (an int stays an int, so a spec read back writes the same
    bytes); anything else through ``float`` (ValueError or TypeError when it is no number)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return float(value)  # type: ignore[arg-type]


def _backend(value: object) -> str:
    if value not in BACKENDS:
        raise ValueError(f"backend {value!r}: the data plane moves hidden states by {' or '.join(BACKENDS)}")
    return str(value)


def hook_specs(engine_id: str, *, positions_module: str, aux_layers: tuple[int, ...]) -> list[dict[str, Any]]:
    """The ``--forward-hooks`` list for one engine: one spec per tap, in forward order."""

    def spec(tap: Tap, modules: list[str]) -> dict[str, Any]:
        return {
            "name": f"pdctl-data-plane-{tap.value}",
            "target_modules": modules,
            "hook_factory": HOOK_FACTORY,
            "config": {"tap": tap.value, "engine": engine_id},
        }

    specs = [spec(Tap.INPUT_IDS, ["model.embed_tokens"]), spec(Tap.POSITIONS, [positions_module])]
    if aux_layers:
        specs.append(spec(Tap.AUX, [f"model.layers.{k}" for k in aux_layers]))
    specs.append(spec(Tap.FINAL, ["model.norm"]))
    return specs
