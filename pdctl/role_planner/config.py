"""The ``planner:`` section of a topology, as frozen settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.choices import Choice
from pdctl.roles import Role


class PlannerMode(Choice):
    """Words for ``planner.mode``: off, advise only, or act."""

    OFF = "off"
    ADVISE = "advise"
    """Decide and log what it would do and why; change nothing."""
    ACT = "act"
    """Decide and switch engines (the same code as ``pdctl switch``)."""


class Objective(Choice):
    """Words for ``planner.objective``: what the planner moves engines for."""

    THROUGHPUT = "throughput"
    """Move engines to the role whose queue holds the fleet back."""
    LATENCY = "latency"
    """Move engines to the role that misses its target (TTFT: prefill; ITL: decode) while the other meets its own."""


@dataclass(frozen=True)
class PlannerConfig:
    """The ``planner:`` section (pdctl.role_planner): mode, objective and latency targets, each
    role's minimum engine count, and the pace of decisions."""

    mode: PlannerMode = PlannerMode.ADVISE
    objective: Objective = Objective.THROUGHPUT
    ttft_ms: float | None = None
    """The latency objective's TTFT target (p50 over an interval, as the decodes measure it)."""
    itl_ms: float | None = None
    """The latency objective's ITL target (p50 over an interval)."""
    min_prefill: int | None = None
    """The fewest prefills it leaves; None: ``reserve(fleet)``."""
    min_decode: int | None = None
    """The fewest decodes it leaves; None: ``reserve(fleet)``."""
    interval_secs: float = 10.0
    """How often it samples and decides."""
    cooldown_secs: float = 30.0
    """After a switch, how long before the next (the fleet's queues settle first)."""
    sustain: int = 2
    """Intervals in a row a role must be the bottleneck before an engine moves to it."""
    backlog: float = 1.0
    """Waiting requests per engine from which a role counts as holding the fleet back."""
    capture_graphs_at_up: bool | None = None
    """Whether ``up`` captures the decode CUDA graphs of every prefill of a role_switch group before
    it returns (pdctl.cluster.graph_capture); None: in ``act`` mode only (``captures_at_up``)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> PlannerConfig:
        """Build from the ``planner:`` section; None or a missing key takes the default."""
        raw = raw or {}
        return cls(
            mode=PlannerMode(raw.get("mode", PlannerMode.ADVISE.value)),
            objective=Objective(raw.get("objective", Objective.THROUGHPUT.value)),
            ttft_ms=raw.get("ttft_ms"),
            itl_ms=raw.get("itl_ms"),
            min_prefill=_count(raw.get("min_prefill")),
            min_decode=_count(raw.get("min_decode")),
            interval_secs=float(raw.get("interval_secs", 10.0)),
            cooldown_secs=float(raw.get("cooldown_secs", 30.0)),
            sustain=int(raw.get("sustain", 2)),
            backlog=float(raw.get("backlog", 1.0)),
            capture_graphs_at_up=raw.get("capture_graphs_at_up"),
        )

    def minimum(self, role: Role, fleet: int) -> int:
        """The fewest engines ``role`` keeps in a fleet of ``fleet`` PD engines: its ``min_*`` when
        set, else ``reserve(fleet)``; one at least."""
        set_to = self.min_prefill if role is Role.PREFILL else self.min_decode
        return max(1, set_to if set_to is not None else reserve(fleet))

    def captures_at_up(self) -> bool:
        """Whether ``up`` captures the prefills' decode graphs: as set, else when the planner acts
        (a planner that switches should not pay a first flip's capture inside a shift of load)."""
        if self.capture_graphs_at_up is not None:
            return self.capture_graphs_at_up
        return self.mode is PlannerMode.ACT

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values, which ``from_dict`` reads back."""
        return {
            "mode": self.mode.value,
            "objective": self.objective.value,
            "ttft_ms": self.ttft_ms,
            "itl_ms": self.itl_ms,
            "min_prefill": self.min_prefill,
            "min_decode": self.min_decode,
            "interval_secs": self.interval_secs,
            "cooldown_secs": self.cooldown_secs,
            "sustain": self.sustain,
            "backlog": self.backlog,
            "capture_graphs_at_up": self.capture_graphs_at_up,
        }


PLANNED_FLEET_ROUTER_POLICY = "power_of_two"
"""The router's policy in a fleet whose planner acts when the topology names none (round_robin
otherwise). After a move to prefill, round_robin still sent two in three new prompts to the old
prefills' queues (20 deep) and none waited less at the new ones; the less loaded of two picks
sends them where the queue is short. 8 engines, 30 s shifting trace, one run each: the planner
made 1.07x the best static split with round_robin and 1.22x with power_of_two, whose static rows
made the same as round_robin's (benchmarks/results/planner_8_overrun_interval1*.md)."""


def reserve(fleet: int) -> int:
    """The fewest engines per role when the topology sets none: a quarter of the fleet's PD
    engines, one at least (4 engines: 1; 8: 2; 16: 4). Why not one: at 8 engines a planner allowed
    down to one decode went 6:2 -> 7:1 in a long-prompt phase, and when the answers turned long
    its lone decode held the 76 requests the turn left, as it did at 1:7 the other way; kept to two
    per role it made 1.29x the best static split on the 90 s shifting trace instead of 1.14x, and
    0.80x instead of 0.57x on the 30 s one (benchmarks/results/planner_8_full*.md). The queue a
    turn leaves grows with the clients, which grow with the fleet, so the reserve does too."""
    return max(1, fleet // 4)


def _count(value: Any) -> int | None:
    return None if value is None else int(value)
