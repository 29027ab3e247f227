"""How the P:D planner decides: one ``Observation`` of the fleet per interval in, one ``Decision``
out. Pure (no I/O, no clock but the observation's): tests/role_planner/test_decide.py drives it.

The throughput rule: a PD fleet's requests wait where its bottleneck is. Prompts queue at the
prefills when prefill is short; requests wait for a KV slot or their transfer at the decodes
(``num_queue_reqs`` plus the prealloc queue) when decode is short. A role whose engines hold
``backlog`` or more waiting requests each, while the other's hold less than half that, is the
bottleneck, but decodes only while they run half their slots or more: requests queued at
half-empty decodes wait for their KV from the prefills (a benchmark run showed 17 queued per
decode with none running, right after a switch), so they neither make decode the bottleneck nor
count as the decodes' queue when prefill's is weighed, and such intervals teach no decode
capacity. Decodes are also the bottleneck without a
queue when they run full: their running requests fill ``FULL`` or more of their slots
(``max_running_requests``) over the interval while each prefill holds less than one request on
average (a closed loop's clients all sit in decode batches that grow each step's time, and the
prefills idle). Once a role has been the bottleneck
for ``sustain`` intervals in a row, engines of the other role move to it (one, or as many as the
split that balances both roles at their learned capacities asks for: ``balanced_prefills``),
unless:

- a weight update or a framework's transaction holds the fleet (it waits: engines are paused);
- an engine is unhealthy, or a switch was made less than ``cooldown_secs`` ago;
- the other role is at its minimum (``min_prefill``/``min_decode``);
- the other role would be overloaded by it: its measured tokens/s per engine, spread over one
  engine fewer, would pass 90% of the most an engine of that role was seen to do while
  backlogged (its capacity, learned from the fleet itself);
- the split it would move to was measured under the same workload mix (prompt to output tokens
  within 25%) and gave no more output tokens/s than the split now (within 5%): the planner
  does not go back to a split it has tried, which is what stops it flapping between two splits
  that each leave one role the bottleneck.

Two cases wait for neither ``sustain`` nor the cooldown, both within a move's *window* (its
cooldown and the streak after it: ``cooldown_secs + sustain x interval_secs``, the time in which
the usual rules would still hold the next move back), both after a move the queues made:

- **the workload turned against the last move**: the role it took engines from is the bottleneck
  and overrun: its engines each queue a whole batch (``max_running_requests``) or more while the
  other role queues nothing (requests waiting for their KV aside). A turn is not itself turned,
  nor is a move ahead of a step (its burst comes next by design): the cooldown holds after them,
  so two turns never follow each other. A short phase ends that way (the 8-engine 30 s trace
  moved a decode to prefill 2.4 s before its prompts turned short and its answers long, and then
  waited two intervals and the cooldown with 48 requests queued at its one decode); no noise
  queues a whole batch per engine on one side only. With no balance learned yet a turn moves up
  to ``MOVE_SHARE`` of the fleet, not one engine.
- **the last move goes on**: the role it moved engines to is still the bottleneck, the role it
  took them from idles (decodes under half their slots, their queue waiting for KV; prefills
  holding under one request each), and the split that balances both roles at their learned
  capacities lies further that way (throughput objective only). A move is bounded
  (``MOVE_SHARE``) so that one interval's reading moves no more than a quarter of the fleet; once
  the reading after it agrees, the rest follows at once instead of a cooldown later (the 8-engine
  30 s trace went 2:6 -> 4:4 -> 6:2 in its long-prompt phase with the 4:4 decodes at 3-5% of
  their slots and 13.5 prompts queued per prefill through the 6 s cooldown: 6:2 came 21 s into a
  24 s phase). It never goes past the balance, nor against the last move.

Outside a move's window, a **whole batch queued on one side** waits for no ``sustain`` (the
cooldown still holds): the bottleneck's engines each queue a batch (``max_running_requests``) or
more while the other role queues nothing, the turn's reading, which no noise makes; on the
8-engine 30 s shifting trace each phase opened so, an interval before the streak was long
enough. Not in a fleet that announces its steps: its bursts queue a batch by design, and the step
balance sizes them.

A step boundary (a trainer or framework says a new batch is coming: ``POST /pdctl/step`` on the
router, with the prompt tokens it will prefill and the requests it will send) lets it set the split
for the burst before it comes, without waiting ``sustain`` intervals. It counts the output tokens
the decodes make from one boundary to the next: the step that ended made so many per request (per
prompt token, when no requests were said). For the new step it takes as many, and finds the split
whose prefills (the step's prompt tokens at their learned capacity) and decodes (its output tokens
at theirs) finish it soonest (``step_balance``; each capacity as learned on this workload's steps,
``workload_capacity``, since a decode's tokens/s fall with its contexts); engines move toward that
split, either way, when it finishes the step sooner than now by an interval and by ``STEP_GAIN`` of
the last step's measured time (the balance knows no long tail) and the donors are done with the last
step (decodes under half their slots with no queue; prefills idle).
That move waits for no cooldown (a step boundary is an announced event, not a noisy reading); a step
sized in other units than the last gets none. A step whose prompt tokens per request differ from the
last whole step's by a factor of ``OTHER_WORKLOAD`` (2) or more is of another workload (a trainer
that turns from reasoning to agentic prompts): the last step's answers say nothing of its answers,
so it is treated as a first step, and the capacities learned on the last workload are not its own.
Before it has seen a whole step of the workload, or while no decode was ever short (no decode
capacity learned), it moves decodes to prefill when the burst's prefill would take ``STEP_WORTH``
intervals or more, as many as make it fit in that (this one within the cooldown); once it has seen
one, only when that step took no longer than its prefill would at the split now and ``STEP_GAIN``
more (else its prefill did not bound it). Either way a move is bounded as any other (``MOVE_SHARE``,
the minimums); the usual rules take over once the burst is in.

Measured steps outrank the balance, which is a model: the planner keeps, per workload, the time
of the last step begun at each split with no switch within it (with pairing on arrival a step's
requests are bound to their engines when it is sent, so the split it began at sets its time:
benchmarks/step_schedules.py). Once a step was measured at the split the balance names (without a
balance: once two splits were), of steps of the announced one's size, the next step begins at the
fastest measured split (the split now, if within ``BETTER_BY`` of it); a balance naming a split
never measured is tried first, unless a measured split beat the split now, or one measured slower
than the fastest by ``BETTER_BY`` lies between the fastest and the balance's (a step's time over
the split has one lowest point: the balance's lies past a rise); and where the steps measured lie
on one side of the fastest only, the split one engine past it on the other is tried once (the
lowest point may lie there). A step that said its requests and sent that many is timed by the
router's clock, as its clients saw it (its first request's arrival to its last answer:
pdctl.router.planner_api.StepClock); any other (requests not said, or some unanswered at the
next boundary) by the planner's busy intervals from the one in which its prefills have computed
``STEP_BEGUN`` of its announced prompt tokens or the router saw its first request; the two clocks
are not compared. A step whose burst
was under way as the boundary's own switch ended measures nothing, nor one with a switch within
it. A step announced with its size keeps the
split its boundary set (whatever it decided, unless the donors were still busy), once the fleet is
there, the first of a workload too: the queues move no engine within it until an idle interval says
its work is done (or it has run ``OWNED_SPAN`` times the last step), since its burst queues by
design and a move within it gives its bound requests nothing (the 8-engine agentic steps drained a
decode for 10 s in each burst); what the queues read in it moves one engine at the next boundary
when no balance sizes it.

The latency rule is the same with the bottleneck read from targets: prefill when the TTFT misses
``ttft_ms`` while the ITL meets ``itl_ms`` (or misses it by less), decode the other way round; the
donor must meet its own target with 20% to spare.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdctl.choices import Choice
from pdctl.role_planner.config import Objective, PlannerConfig
from pdctl.roles import Role

DONOR_HEADROOM = 0.9
"""A donor role's projected tokens/s per engine may reach this share of its learned capacity."""
MOVE_SHARE = 0.25
"""One decision moves at most this share of the fleet (and never fewer than two engines): one
interval's mix swings between a burst's prompts and its tail's answers, and at 8 engines the
balance of one interval moved six engines to 7:1 and the next six back to 1:7, each a drain of
six (benchmarks/results/planner_8.md); a wrong reading now costs two drains, the next decision
goes on if the balance still says so. A move ahead of a step is bounded the same way."""
SAME_MIX = 0.25
"""Two workloads are the same mix when their prompt:output token ratios differ by less than this."""
OTHER_WORKLOAD = 2.0
"""A step is of another workload than the last whole one when their prompt tokens per request
differ by this factor or more. A batch's mean prompt varies with the sample: the benchmark's
reasoning steps (16 distinct prompts at 8 engines) said 160-217 tokens per request, and ``SAME_MIX``
took them for two workloads, forgetting their measured steps; the workloads a trainer turns
between differ by far more (the reasoning steps' 216 against the agentic steps' 9,000)."""
BETTER_BY = 0.05
"""A split measured before is tried again only if it gave this much more output than now."""
LATENCY_SPARE = 0.8
"""Under the latency objective a donor must meet its target at this share of it."""
STEP_WORTH = 2
"""A step's prefill worth a switch ahead lasts this many intervals at the current split (a
shorter one ends before the usual rules would have moved an engine)."""
STEP_GAIN = 0.1
"""A move ahead of a step by its balance must finish the step this share of the last step's
measured time sooner (and an interval): the balance knows the step's tokens, not its long tail
nor its KV transfers, so only a clear imbalance is worth a drain. (At 8 engines it foresaw 2.6 s
for an agentic step's 6:2 -> 5:3, which a fifth of the last step's 19 s refused; the step then
took 18.7 s at 6:2 where those around it took 15-16 s at 5:3: benchmarks/results/
planner_8_steps_nocool_decisions.jsonl. It foresaw 0.4 s for the reasoning RL step's 3:5 -> 1:7.)"""
STEP_BEGUN = 0.01
"""A step announced begins with the interval by which its prefills have computed this share of its
announced prompt tokens: the router's health check (a one-token generation) seen at a prefill in
the wait for a burst is not its start (it was taken for one, and the idle intervals after it for
the step's end, which gave its burst back to the queues: benchmarks/results/
planner_8_steps_six_held_back_decisions.jsonl, the first agentic step)."""
OWNED_SPAN = 2.0
"""A step whose boundary chose its split keeps it for at most this many times the last step's busy
seconds (a trainer that stops announcing steps leaves the queues their rules); before a whole step
was seen, until its work is done."""
WINDING_DOWN = 0.5
"""Decodes under this share of their slots are done with most of the last step; requests queued
at such decodes wait for something else than decoding (their KV, a prefill)."""
FULL = 0.85
"""Decodes whose running requests fill this share of their slots run full."""
IDLE = 1.0
"""Prefills holding fewer requests than this each (running and queued, over the interval) idle part of the time."""


PD = (Role.PREFILL, Role.DECODE)


OUTCOMES = ("switched", "refused", "advised", "none")
"""What became of a decision: a switch made, refused by its engine, advised only; none for stay and wait."""


class Action(Choice):
    """Words for what a decision says: switch an engine, wait, or stay."""

    SWITCH = "switch"
    WAIT = "wait"
    """Something keeps it from deciding (a hold, an unhealthy engine): it decides again later."""
    STAY = "stay"
    """It decided that the split is right for now."""


@dataclass(frozen=True)
class EngineLoad:
    """One engine in one interval."""

    id: str
    role: Role
    switchable: bool
    healthy: bool
    waiting: float
    """Requests queued at it (a decode: its queue plus its KV prealloc queue)."""
    running: float
    """Requests it runs, the mean over the interval's samples."""
    tokens_per_s: float
    """Prompt tokens/s for a prefill, generated tokens/s for a decode, over the interval."""
    slots: float | None = None
    """The most requests it runs at once (SGLang's ``max_running_requests``), if it says."""
    captured: bool = True
    """Whether the planner saw this process run as a decode (it captured the decode's CUDA graphs,
    so a switch to decode does not pay the capture again: 12 s for an 8B model on an H100). A
    planner knows only what it saw: restarted, it takes every prefill as not captured."""


ROUTER_CLOCK, BUSY_CLOCK = "router", "busy"
"""What timed a measured step: the router's clock (its clients' view), or the planner's busy intervals."""


@dataclass(frozen=True)
class ClockedStep:
    """A step as the router's clock timed it (pdctl.router.planner_api.StepClock)."""

    secs: float
    """From its first request's arrival to its last answer."""
    requests: float
    """The requests it timed (at most what its boundary said)."""
    age_secs: float
    """Seconds from its first request's arrival to the sample that read it."""


@dataclass(frozen=True)
class Observation:
    """The fleet over one interval, as the planner reads it: each engine's load, any hold, the
    latencies and the step boundaries announced so far."""

    at: float
    """Seconds on a monotonic clock."""
    engines: tuple[EngineLoad, ...]
    held: str | None = None
    """Why the fleet is held (a weight update, a framework's pause), or None."""
    ttft_ms: float | None = None
    itl_ms: float | None = None
    steps: float = 0.0
    """Step boundaries announced to the router so far."""
    step_prompt_tokens: float = 0.0
    """The prompt tokens the latest announced step will prefill (0: not said)."""
    step_requests: float = 0.0
    """The requests the latest announced step will send (0: not said)."""
    step_arrivals: float = 0.0
    """Requests of the latest announced step the router has seen arrive (0: none yet, or a router
    without its clock)."""
    last_step_clock: ClockedStep | None = None
    """The step before the latest announced one as the router's clock timed it; None: not known,
    none of its requests answered, or some not yet."""
    output_tokens: float | None = None
    """Output tokens the engines made since the last observation, by their counters (a switch's
    drain included, which no interval samples); None: not known (then the interval's rate times
    the seconds since the last observation)."""


@dataclass(frozen=True)
class RoleLoad:
    """One role's load over one interval: its engine count and per-engine means."""

    role: Role
    engines: int
    waiting: float
    """Waiting requests per engine."""
    tokens_per_s: float
    """Tokens/s per engine."""
    running: float = 0.0
    """Running requests per engine (the interval's mean)."""
    slot_use: float | None = None
    """Running requests over slots, across the role's engines that say their slots."""
    slots: float | None = None
    """Slots per engine (``max_running_requests``), the mean over the role's engines that say them."""

    @property
    def own_waiting(self) -> float:
        """Waiting requests per engine that wait for this role: none at decodes that wait for their
        KV (``waits_for_kv``), whose queue is the prefills' shortage."""
        return 0.0 if self.waits_for_kv else self.waiting

    @property
    def waits_for_kv(self) -> bool:
        """Decodes that run under half their slots: their queue waits for KV from the prefills,
        not for decoding (False for prefills, and for engines that do not say their slots)."""
        return self.role is Role.DECODE and self.slot_use is not None and self.slot_use < WINDING_DOWN

    @classmethod
    def from_dict(cls, role: Role, raw: Mapping[str, Any]) -> RoleLoad:
        """The inverse of ``to_dict`` (a recorded decision's figures)."""
        slot_use = raw.get("slot_use")
        return cls(
            role,
            int(raw["engines"]),
            float(raw["waiting_per_engine"]),
            float(raw["tokens_per_s_per_engine"]),
            float(raw.get("running_per_engine", 0.0)),
            None if slot_use is None else float(slot_use),
        )

    def to_dict(self) -> dict[str, Any]:
        """The figures as a decision records them (rounded); ``from_dict`` reads them back."""
        out = {
            "engines": self.engines,
            "waiting_per_engine": round(self.waiting, 2),
            "running_per_engine": round(self.running, 2),
            "tokens_per_s_per_engine": round(self.tokens_per_s, 1),
        }
        if self.slot_use is not None:
            out["slot_use"] = round(self.slot_use, 3)
        return out


@dataclass(frozen=True)
class Decision:
    """One interval's outcome: the action and why; for a switch, the engine and the role it moves to.
    ``figures`` are the loads it was decided on."""

    action: Action
    reason: str
    engine: str | None = None
    to_role: Role | None = None
    figures: Mapping[str, Any] = field(default_factory=dict)
    more: tuple[str, ...] = ()
    """Engines that move with ``engine``, in the order they switch (a move of several at once)."""
    reversible: bool = True
    """Whether a turn may reverse this move within its cooldown (not a turn itself, nor a move
    ahead of a step): the loop tells ``RolePlanner.switched`` the role only of such a move."""

    @property
    def engines(self) -> tuple[str, ...]:
        """Every engine the decision moves, in order (``engine`` first); none for stay and wait."""
        return (self.engine, *self.more) if self.engine else ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``action``, ``engine`` (the first to move), ``engines`` (all, in order),
        ``to_role``, ``reason``, ``figures`` and ``reversible``."""
        return {
            "action": self.action.value,
            "engine": self.engine,
            "engines": list(self.engines),
            "to_role": self.to_role.value if self.to_role else None,
            "reason": self.reason,
            "figures": dict(self.figures),
            "reversible": self.reversible,
        }


@dataclass
class SplitRecord:
    """The output tokens/s one prefill:decode split was measured to give, and under which workload mix."""

    output_tokens_per_s: float
    mix: float
    """Prompt tokens per output token."""


@dataclass
class StepUnderWay:
    """The step announced last, as the fleet works on it: counted interval by interval
    (``RolePlanner._count_output``), learned from and replaced at the next boundary."""

    size: tuple[float, str] = (0.0, "")
    """As it was announced: its requests, else its prompt tokens (0: none announced yet)."""
    prompt_tokens: float = 0.0
    """The prompt tokens it was announced with."""
    output_tokens: float = 0.0
    """Output tokens the decodes made since it was announced."""
    busy_secs: float = 0.0
    """Seconds since it was announced in which the fleet prefilled or decoded."""
    start_split: tuple[int, int] | None = None
    """The split it had in its first busy interval with prefill work or, by the router's clock,
    one of its requests arrived (None: not begun)."""
    busy_before_start: float = 0.0
    """``busy_secs`` before that interval (a last step's tail after the boundary is not this step's)."""
    moved: bool = False
    """Whether it is no measure: an engine switched within it, or its burst began while the
    boundary's own switch was under way (its requests bound at the split before)."""
    target: tuple[int, int] | None = None
    """The split its boundary set, which it keeps once the fleet is there (None: the queues keep
    their rules in it): until its work is done (an idle interval) or it has run ``OWNED_SPAN``
    times the last step's busy seconds."""
    boundary_switch_at: float | None = None
    """When the boundary's own switch ended (None: it made none)."""
    computed_tokens: float = 0.0
    """Prompt tokens its prefills computed since it was announced (what tells its start)."""
    held_back: dict[Role, int] = field(default_factory=dict)
    """The intervals of it, at the split its boundary set, in which each role held the fleet back
    (the queues' reading, which that split kept from moving an engine within it)."""

    def measured(self) -> tuple[tuple[int, int], float] | None:
        """The split it began at and its busy seconds from then, when it measures that split: begun,
        busy since, and nothing switched within it (the loop that switched saw none of its time)."""
        if self.start_split is None or self.moved or self.busy_secs <= self.busy_before_start:
            return None
        return self.start_split, self.busy_secs - self.busy_before_start


def other(role: Role) -> Role:
    return Role.DECODE if role is Role.PREFILL else Role.PREFILL


class RolePlanner:
    """The decision state across intervals: the bottleneck streak, the last switch, each role's
    learned capacity and each split's measured output."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.capacity: dict[Role, float] = {}
        self.workload_capacity: dict[Role, float] = {}
        """Each role's capacity learned since the steps of the workload under way began (a step of
        another workload, by ``_other_workload``, starts it anew). A decode's output tokens/s fall
        with its requests' context and a prefill's tokens/s with its prompts' length: on the
        benchmark's profile a decode batch of 16 makes about 2,000 tokens/s at a reasoning step's
        2,000-token contexts and 1,000 at an agentic step's 9,000, and the all-time most made the
        agentic step's balance say 6:2 where 5:3 was best. A step's balance takes these; the
        queues' moves, which read any interval, the all-time ``capacity``."""
        self.streak: tuple[Role | None, int] = (None, 0)
        self.last_switch_at: float | None = None
        self.last_switch_to: Role | None = None
        """The role the last switch moved engines to (None: none seen)."""
        self.splits: dict[tuple[int, int], SplitRecord] = {}
        self.steps_seen: float | None = None
        self.step = StepUnderWay()
        """The step announced last, as the fleet works on it."""
        self.last_step_secs: float | None = None
        """The last whole step's busy seconds."""
        self.output_per: tuple[float, str] | None = None
        """The last whole step's output tokens per announced request (or per prompt token, when it
        said no requests)."""
        self.learned_prompt_per: float | None = None
        """The last whole step's prompt tokens per announced request (None: it said no requests, or a
        record from before this was kept): a step whose own differ by ``OTHER_WORKLOAD`` or more is of
        another workload (a reasoning step's 216 against an agentic step's 9,000 at 8 engines), whose
        answers the last step's say nothing of."""
        self.last_at: float | None = None
        self.step_times: dict[tuple[int, int], tuple[float, tuple[float, str], str]] = {}
        """This workload's whole steps: the seconds, size (``StepUnderWay.size``) and clock
        (``ROUTER_CLOCK`` or ``BUSY_CLOCK``) of the last one begun at each split. With pairing on
        arrival a step's requests are bound to their engines when it is sent, so the split it began
        at sets its time (benchmarks/step_schedules.py: no move within it changes it)."""
        self.last_step_size: tuple[float, str] = (0.0, "")
        """The last whole step's size as announced (``StepUnderWay.size``)."""
        self.last_step_held_back: tuple[Role, int, int] | None = None
        """The role that held the last whole step back at the split its boundary set, in how many of
        its intervals, of how many the queues read (``StepUnderWay.held_back``); None: neither
        held it back in most of them (not recalled after a restart)."""

    @property
    def step_owned(self) -> bool:
        """Whether the step under way has a split its boundary set (``StepUnderWay.target``)."""
        return self.step.target is not None

    def minimum(self, role: Role, fleet: int) -> int:
        """The fewest engines ``role`` may keep in a fleet of ``fleet`` PD engines
        (``PlannerConfig.minimum``: ``min_prefill``/``min_decode``, or the reserve)."""
        return self.config.minimum(role, fleet)

    def recall(self, entries: Sequence[Mapping[str, Any]], now_wall: float, now: float) -> None:
        """Take back what an earlier run of this cluster's planner learned (its recorded decisions,
        oldest first: pdctl.cluster.planner_record): each role's capacity and each split's
        output, from the figures of its stay and switch decisions, and its last switch's time
        (``now_wall`` and ``now``: the wall and monotonic clocks now), so that a planner restarted
        after a crash keeps its cooldown and does not go back to a split it measured as no better;
        and what the last whole step made (``step_learned`` of a step decision), to balance the next,
        and this workload's measured steps (``step_times``); and how many step boundaries it had
        seen (``steps_seen``), so that one announced while it was down is a boundary to it (a
        planner with nothing to recall takes the router's count as seen: it cannot tell when the
        last was announced)."""
        for entry in entries:
            figures = entry.get("figures") or {}
            if entry.get("action") == Action.WAIT.value or not all(r.value in figures for r in PD):
                continue
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._learn({r: RoleLoad.from_dict(r, figures[r.value]) for r in PD})
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self.steps_seen = float(figures["steps_seen"])
            if isinstance(figures.get("workload_capacity"), Mapping):  # (a boundary's: this workload's so far)
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    said = figures["workload_capacity"]
                    self.workload_capacity = {r: float(said[r.value]) for r in PD if r.value in said}
            if isinstance(figures.get("step_times"), Mapping):  # (a boundary's: this workload's steps so far)
                with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
                    self.step_times = {
                        _parse_split(split): (
                            float(t["secs"]),
                            (float(t["size"]), str(t["unit"])),
                            str(t.get("clock", BUSY_CLOCK)),  # (a record from before it said: busy intervals)
                        )
                        for split, t in figures["step_times"].items()
                    }
            learned = figures.get("step_learned") or {}
            with contextlib.suppress(KeyError, TypeError, ValueError):
                unit = str(learned["unit"])
                if unit in ("request", "prompt token"):
                    self.output_per, self.last_step_secs = (float(learned["output_per"]), unit), float(learned["secs"])
                    said = learned.get("prompt_per_request")
                    self.learned_prompt_per = float(said) if said is not None else None
            if str(entry.get("outcome") or "").startswith("switched"):
                self.last_switch_to = None
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    self.last_switch_at = now - max(0.0, now_wall - float(entry["at"]))
                    if entry.get("reversible", True):  # (a record from before it said: reversible)
                        self.last_switch_to = Role(entry["to_role"])

    def switched(self, at: float, to_role: Role | None = None) -> None:
        """A switch was made at ``at`` (the loop tells it once the switch is done); ``to_role``: the
        role it moved engines to, for a move a turn may reverse (None: one it may not)."""
        self.last_switch_at = at
        self.last_switch_to = to_role
        self.streak = (None, 0)
        if self.step.start_split is not None:
            self.step.moved = True
            # The fleet worked on the step while the switch drained (the loop saw none of it): its
            # busy seconds count it, or an agentic step's 16.7 s was taken for 2.1 s and the next
            # step's ownership (OWNED_SPAN of it) ran out 4 s into its burst.
            if self.last_at is not None and at > self.last_at:
                self.step.busy_secs += at - self.last_at
        elif self.step.size[0]:
            self.step.boundary_switch_at = at  # (the boundary's own move: the step has not begun)
        self.last_at = at  # (the next interval counts from here: a switch's drain is no interval's)

    def decide(self, obs: Observation) -> Decision:
        """Decide for one interval: SWITCH (an engine and its new role), STAY or WAIT, each with its
        reason and figures. Updates the state kept across intervals but switches nothing: the caller
        makes the switch and reports it with ``switched``."""
        loads = {role: _role_load(obs, role) for role in PD}
        figures: dict[str, Any] = {r.value: loads[r].to_dict() for r in loads}
        if obs.ttft_ms is not None or obs.itl_ms is not None:
            figures["ttft_ms"], figures["itl_ms"] = obs.ttft_ms, obs.itl_ms
        self._count_output(obs, loads)
        if obs.held:
            return Decision(Action.WAIT, f"{obs.held}: no switch until it ends", figures=figures)
        sick = [e.id for e in obs.engines if not e.healthy]
        if sick:
            return Decision(Action.WAIT, f"not every engine is healthy ({', '.join(sick)})", figures=figures)
        self._learn(loads)
        split = (loads[Role.PREFILL].engines, loads[Role.DECODE].engines)
        figures["split"] = f"{split[0]}:{split[1]}"
        boundaries = obs.steps - self.steps_seen if self.steps_seen is not None else 0.0
        self.steps_seen = obs.steps
        figures["steps_seen"] = obs.steps  # (what a restarted planner recalls: a boundary since is one)
        if boundaries > 0:
            self._step_began(obs, boundaries)
            figures["step_prompt_tokens"] = obs.step_prompt_tokens
            return self._ahead_of_step(loads, obs, figures)
        short, why = self._bottleneck(loads, obs)
        if short is None:
            self.streak = (None, 0)
            return Decision(Action.STAY, why, figures=figures)
        count = self.streak[1] + 1 if self.streak[0] is short else 1
        self.streak = (short, count)
        if split == self.step.target and self.step.busy_secs <= OWNED_SPAN * (self.last_step_secs or math.inf):
            self.step.held_back[short] = self.step.held_back.get(short, 0) + 1
            why = f"{why}; this step keeps the split its boundary chose, {split[0]}:{split[1]}, until its work is done"
            return Decision(Action.STAY, why, figures=figures)
        turned = self._turned(short, loads, obs)
        goes_on = None if turned else self._goes_on(short, loads, obs)
        overrun = None if turned or goes_on else self._overrun(short, loads)
        if turned or goes_on:
            why = f"{why}; {turned or goes_on}"
        else:
            if overrun:
                why = f"{why}; {overrun}"
            elif count < self.config.sustain:
                return Decision(Action.STAY, f"{why} ({count} of {self.config.sustain} intervals)", figures=figures)
            if self.last_switch_at is not None and obs.at - self.last_switch_at < self.config.cooldown_secs:
                left = self.config.cooldown_secs - (obs.at - self.last_switch_at)
                why = f"{why}; cooling down after the last switch ({left:.0f} s left)"
                return Decision(Action.STAY, why, figures=figures)
        donor = other(short)
        load = loads[donor]
        floor = self.minimum(donor, sum(split))
        if load.engines - 1 < floor:
            return Decision(Action.STAY, f"{why}; the {donor}s are at their minimum ({floor})", figures=figures)
        refusal = self._donor_refuses(donor, load, obs)
        if refusal:
            return Decision(Action.STAY, f"{why}; {refusal}", figures=figures)
        tried = self._tried(_moved(split, short, 1), obs)
        if tried:
            return Decision(Action.STAY, f"{why}; {tried}", figures=figures)
        movable = [e for e in obs.engines if e.role is donor and e.switchable]
        if not movable:
            return Decision(Action.STAY, f"{why}; no {donor} may switch (role_switch groups only)", figures=figures)
        # (to decode on a turn, prefills seen as decodes before need no graph capture: see _how_many)
        captured = sum(1 for e in movable if e.captured) if short is Role.DECODE and turned else 0
        count, sized = self._how_many(short, loads, split, len(movable), captured, whole_batch=bool(turned or overrun))
        while count > 1 and self._tried(_moved(split, short, count), obs):
            count -= 1  # (a split it measured as no better is not a target either)
        picks = _cheapest(movable, short)[:count]
        if count > 1:
            figures["balanced_prefills"] = sized
            names = ", ".join(e.id for e in picks)
            moved = _moved(split, short, count)
            reading = "a turn" if turned else "a whole batch on one side"
            how = (
                "balances the two roles at their capacities"
                if sized is not None
                else f"is as far as {reading} moves at once without a balance"
            )
            why = f"{why}: {names} move to {short} ({moved[0]}:{moved[1]} {how})"
            more = tuple(e.id for e in picks[1:])
            return Decision(Action.SWITCH, why, picks[0].id, short, figures, more, reversible=not turned)
        why = f"{why}: {picks[0].id} moves to {short}"
        return Decision(Action.SWITCH, why, picks[0].id, short, figures, reversible=not turned)

    # -- the parts ------------------------------------------------------------------------------------
    def _ahead_of_step(self, loads: Mapping[Role, RoleLoad], obs: Observation, figures: dict[str, Any]) -> Decision:
        """A step boundary was announced: set the split for its burst before it comes, or say why not.

        Once a whole step has been seen (its output tokens per announced request, its busy time),
        the target is the step's balance (``step_balance``): the split whose prefills and decodes,
        each at their learned capacity, finish the step's prompt and output tokens soonest; engines
        move toward it (either way) when it saves an interval and ``STEP_GAIN`` of the last step's
        time; a step sized in another unit than the last (requests said, then not) gets no move.
        Before that, or while no decode was ever short (no decode capacity learned), decodes move
        to prefill when the burst's prefill would take ``STEP_WORTH`` intervals or more, as many as
        make it fit.
        Either way at most ``move_bound`` engines, none while the donors still work on the last
        step; the cooldown holds the prefill-only move, not the balanced one."""
        prefill, decode = loads[Role.PREFILL], loads[Role.DECODE]
        tokens, capacity = obs.step_prompt_tokens, self._step_capacity(Role.PREFILL)
        split = (prefill.engines, decode.engines)
        # Every step announced with its size (one of none has no start to tell its end by) keeps the
        # split its boundary sets, whatever it decides (a move, a stay, a move the cooldown or a
        # minimum holds back), the first of a workload too: a move within a step gives
        # its bound requests nothing (benchmarks/step_schedules.py) and leaves it unmeasured; the
        # agentic steps' queue moves from decode to prefill drained for 10 s in each burst, and the
        # first agentic step of an 8-engine run took 18.8 s from 4:4 with one (static 4:4: 17.1 s).
        self.step.target = split if self.step.size[0] > 0 else None
        figures["workload_capacity"] = {r.value: round(v, 1) for r, v in self.workload_capacity.items()}
        figures["step_times"] = {  # (what a restarted planner recalls; the split each step began at)
            f"{k}:{d}": {"secs": round(t, 2), "size": size, "unit": unit, "clock": clock}
            for (k, d), (t, (size, unit), clock) in sorted(self.step_times.items())
        }
        why = f"a step boundary ({tokens:.0f} prompt tokens)"
        if tokens <= 0 or not capacity or not prefill.engines:
            said = "no prompt tokens said" if tokens <= 0 else "no prefill capacity measured yet"
            then = "it keeps the split now" if self.step.target else "the usual rules follow its burst"
            return Decision(Action.STAY, f"{why}: {said}; {then}", figures=figures)
        secs = tokens / (prefill.engines * capacity)
        figures["step_prefill_secs"] = round(secs, 2)
        why = f"{why} takes {secs:.1f} s on {prefill.engines} prefill(s) at {capacity:.0f} tokens/s each"
        if self.output_per is not None:  # (what a restarted planner recalls)
            figures["step_learned"] = {"output_per": round(self.output_per[0], 3), "unit": self.output_per[1]}
            figures["step_learned"]["secs"] = round(self.last_step_secs or 0.0, 1)
            if self.learned_prompt_per is not None:
                figures["step_learned"]["prompt_per_request"] = round(self.learned_prompt_per, 1)
        other_workload = self._other_workload(obs)
        if other_workload:
            why = f"{why}; {other_workload}"
        balance = None if other_workload else self.step_balance(obs, split)
        if balance is not None and self.output_per is not None:
            figures.update(step_output_tokens=round(balance[1]), step_balanced_prefills=balance[0])
        measured = None if other_workload else self._measured(obs, split, balance[0] if balance else None)
        if measured is not None:
            fastest, how = measured
            why = f"{why}; {how}"
            if fastest == split[0]:
                return Decision(Action.STAY, f"{why}: staying", figures=figures)
            to, count = (Role.PREFILL, fastest - split[0]) if fastest > split[0] else (Role.DECODE, split[0] - fastest)
        elif balance is not None and self.output_per is not None:
            best, output, saved = balance
            n = sum(split)
            why = (
                f"{why}; the last step made {self.output_per[0]:.2f} output tokens per {self.output_per[1]}, "
                f"so about {output:.0f} this one: {best}:{n - best} finishes it soonest"
            )
            worth = max(self.config.interval_secs, STEP_GAIN * (self.last_step_secs or 0.0))
            if best == split[0] or saved < worth:
                why = f"{why}, {saved:.1f} s sooner than now (the last step took {self.last_step_secs or 0:.0f} s)"
                return Decision(Action.STAY, f"{why}: staying", figures=figures)
            to, count = (Role.PREFILL, best - split[0]) if best > split[0] else (Role.DECODE, split[0] - best)
        elif self.output_per is not None and self._step_capacity(Role.DECODE) and not other_workload:
            said = f"the last step was sized in {self.output_per[1]}s and this one is not"
            return Decision(Action.STAY, f"{why}; no balance for it ({said}): staying", figures=figures)
        else:  # no whole step of this workload yet, or decodes never short (no capacity learned): the prefill alone
            if secs < STEP_WORTH * self.config.interval_secs:
                return Decision(Action.STAY, f"{why}: too short to switch ahead", figures=figures)
            size, unit = _size_of(obs)
            alike = self.last_step_size[1] == unit and _same_mix(self.last_step_size[0], size)
            last = self.last_step_secs if self.output_per is not None and not other_workload and alike else None
            held = self._held_back_by(split, obs) if last else None
            if last and secs * (1 + STEP_GAIN) < last and held is None:
                # (a whole step of this workload took longer than its prefill would here: something
                # else bounds it, its decodes or its tail, and more prefills would not shorten it)
                why = f"{why}, where the last step took {last:.1f} s: its prefill does not bound it, staying"
                return Decision(Action.STAY, why, figures=figures)
            if held is not None:
                # (the queues' reading of the last step, which its split kept from moving an engine
                # within it, moves one at the boundary: its prefill alone would not)
                to, count = held[0], 1
                why = (
                    f"{why}, where the last step took {last:.1f} s at {split[0]}:{split[1]} with its {held[0]}s "
                    f"holding the fleet back in {held[1]} of its {held[2]} readings"
                )
            else:  # As many as the burst needs to fit in STEP_WORTH intervals.
                to = Role.PREFILL
                count = math.ceil(tokens / (capacity * STEP_WORTH * self.config.interval_secs)) - prefill.engines
        donor = other(to)
        # (A balanced move waits for no cooldown: a step boundary is an event a trainer announced, not
        # a reading that may be noise; a benchmark's agentic step ran at 6:2 for want of 5:3, the
        # queues' last move of the step before having started the cooldown.)
        cooling = self.last_switch_at is not None and obs.at - self.last_switch_at < self.config.cooldown_secs
        if cooling and balance is None and measured is None:
            return Decision(Action.STAY, f"{why}; cooling down after the last switch", figures=figures)
        if loads[donor].engines - 1 < self.minimum(donor, sum(split)):
            return Decision(Action.STAY, f"{why}; the {donor}s are at their minimum", figures=figures)
        if donor is Role.DECODE:
            busy = decode.waiting >= self.config.backlog / 2 or (decode.slot_use or 0.0) >= WINDING_DOWN
        else:
            busy = prefill.waiting >= self.config.backlog / 2 or prefill.running + prefill.waiting >= IDLE
        if busy:  # (the fleet is still at work: the queues keep their rules in this step)
            self.step.target = None
            return Decision(Action.STAY, f"{why}; the {donor}s are still busy with the last step", figures=figures)
        movable = [e for e in obs.engines if e.role is donor and e.switchable]
        if not movable:
            return Decision(Action.STAY, f"{why}; no {donor} may switch (role_switch groups only)", figures=figures)
        most = min(len(movable), loads[donor].engines - self.minimum(donor, sum(split)), move_bound(sum(split)))
        picks = _cheapest(movable, to)[: max(1, min(count, most))]
        names = ", ".join(e.id for e in picks)
        moves = "moves" if len(picks) == 1 else "move"
        if self.step.target is not None:
            self.step.target = _moved(split, to, len(picks))
        return Decision(
            Action.SWITCH,
            f"{why}: {names} {moves} to {to} ahead of the burst",
            picks[0].id,
            to,
            figures,
            tuple(e.id for e in picks[1:]),
            reversible=False,
        )

    def _measured(self, obs: Observation, split: tuple[int, int], balanced: int | None) -> tuple[int, str] | None:
        """The prefill count this workload's measured steps say the step ``obs`` announces should
        begin at, and why; None to leave it to the balance. Only steps of its size (within
        ``SAME_MIX``, in the same unit) count. They decide once one was measured at the balance's
        split (with no balance: once two splits were), or when a measured split beat the split now
        by ``BETTER_BY``: the step then begins at the fastest measured split within the minimums,
        unless the split now was measured within ``BETTER_BY`` of it, or one engine past that split
        on its side no step measured, once (``_past_the_fastest``). Otherwise a balance whose
        split was never measured is tried (the balance is a model; a step is a measurement), unless
        a split measured slower than the fastest by ``BETTER_BY`` lies between it and the fastest:
        one lowest point, past a rise."""
        n = sum(split)
        times = self._times_like(obs, n)
        if not times:
            return None
        fastest = min(times, key=lambda k: (times[k], abs(k - split[0])))
        now = times.get(split[0])
        rise = times[fastest] * (1 + BETTER_BY)
        beaten = now is not None and now > rise
        untried = balanced is not None and balanced not in times
        if balanced is not None and untried:
            # (a step's time over its prefill count is the longer of a falling prefill time and a
            # rising decode time: it has one lowest point. A split measured slower than the fastest,
            # beyond the noise, on the way to the balance's says the balance's lies past it; an
            # 8-engine agentic step tried the balance's 3:5 at 20.2 s after 5:3 and 4:4 were
            # measured: 16.1 and 17.1 s)
            low, high = sorted((fastest, balanced))
            untried = not any(low < k < high and t > rise for k, t in times.items())
        if not beaten and (untried if balanced is not None else len(times) < 2):
            return None  # (the balance's split untried, which it may try; or, with none, nothing to compare)
        if now is not None and not beaten:
            fastest = split[0]
        said = ", ".join(f"{k}:{n - k} {times[k]:.1f} s" for k in sorted(times))
        how = f"this workload's last steps by the split they began at: {said}, so {fastest}:{n - fastest}"
        probe = self._past_the_fastest(times, fastest, n)
        if probe is not None:
            return probe, f"{how}, and {probe}:{n - probe} past it, never measured, is tried once"
        return fastest, how

    def _past_the_fastest(self, times: Mapping[int, float], fastest: int, n: int) -> int | None:
        """The split one engine past ``fastest`` on its side that no step measured, when the other
        side has a measured split (slower: ``fastest`` is the fastest) and it is within the
        minimums; else None. A step's time over the split has one lowest point, and a rise seen on
        one side of the fastest says nothing of the other: the lowest may lie there. (An 8-engine
        run's agentic steps went 4:4, 18.1 s, then the balance's 3:5, 20.7 s, and stayed at 4:4,
        never trying 5:3, 15.8 s static: 0.87x.) Once it is measured, the measured steps decide."""
        below = any(k < fastest for k in times)
        above = any(k > fastest for k in times)
        if below == above:
            return None  # (both sides measured: the fastest is the lowest seen; neither: nothing says which way)
        probe = fastest + 1 if below else fastest - 1
        return probe if self._within(n, probe) else None

    def _times_like(self, obs: Observation, n: int) -> dict[int, float]:
        """The measured busy seconds of this workload's steps of the announced one's size (within
        ``SAME_MIX``, in the same unit) on ``n`` engines, by the prefill count they began at, within
        the minimums; timed by the router's clock only, if any of them was (the two clocks are not
        compared: the busy intervals read up to a second or two over a step's client time)."""
        size, unit = _size_of(obs)
        like = {
            k: (t, clock)
            for (k, d), (t, (was, was_unit), clock) in self.step_times.items()
            if k + d == n and self._within(n, k) and was_unit == unit and _same_mix(was, size)
        }
        router = any(clock == ROUTER_CLOCK for _, clock in like.values())
        return {k: t for k, (t, clock) in like.items() if clock == ROUTER_CLOCK or not router}

    def _held_back_by(self, split: tuple[int, int], obs: Observation) -> tuple[Role, int, int] | None:
        """The role that held the last whole step back at ``split`` (``last_step_held_back``), when
        that step was measured at ``split`` and the split one engine toward that role was not
        measured slower on a step of this one's size; else None."""
        held = self.last_step_held_back
        n = sum(split)
        times = self._times_like(obs, n)
        if held is None or split[0] not in times:
            return None
        toward = _moved(split, held[0], 1)
        if not self._within(n, toward[0]) or times.get(toward[0], -math.inf) >= times[split[0]]:
            return None  # (beyond a minimum, or measured no faster: the measured steps decide then)
        return held

    def _step_capacity(self, role: Role) -> float | None:
        """``role``'s capacity for sizing a step: the one learned on this workload's steps, else
        (none backlogged on them yet) the all-time one."""
        return self.workload_capacity.get(role) or self.capacity.get(role)

    def _other_workload(self, obs: Observation) -> str:
        """Why the step ``obs`` announces is of another workload than the last whole step (its prompt
        tokens per request differ by a factor of ``OTHER_WORKLOAD`` or more), or "" when it is not or
        cannot be told."""
        learned, requests = self.learned_prompt_per, obs.step_requests
        if learned is None or requests <= 0:
            return ""
        now = obs.step_prompt_tokens / requests
        if max(learned, now) < OTHER_WORKLOAD * min(learned, now):
            return ""
        return (
            f"the last step had {learned:.0f} prompt tokens per request and this one {now:.0f}: "
            "another workload, whose answers the last step's say nothing of"
        )

    def step_balance(self, obs: Observation, split: tuple[int, int]) -> tuple[int, float, float] | None:
        """For the step ``obs`` announces: the prefill count that finishes it soonest, its output
        tokens (the last whole step's ``output_per``, times this one's size in the same unit), and
        the seconds that split saves against ``split``; None until a step and both capacities were
        measured, or when this step is not sized in the unit the last one was.

        A step's time at k prefills is the longer of its prefill (prompt tokens over k prefills'
        capacity) and its decode (output tokens over the decodes' capacity): the two overlap, each
        request decoding once it is prefilled. Within the minimums; the split nearest to ``split``
        among equals."""
        prefill_capacity, decode_capacity = self._step_capacity(Role.PREFILL), self._step_capacity(Role.DECODE)
        size, unit = _size_of(obs)
        if self.output_per is None or unit != self.output_per[1] or not prefill_capacity or not decode_capacity:
            return None
        prompt_tokens, output = obs.step_prompt_tokens, self.output_per[0] * size
        served = _served(sum(split), prefill_capacity, decode_capacity, prompt_tokens / output)
        best = self._best_prefills(sum(split), served, split[0])
        if best is None:
            return None
        # (the step takes its output tokens over the output tokens/s the split serves at the step's mix)
        now = output / served(split[0]) if self._within(sum(split), split[0]) else math.inf
        return best, output, now - output / served(best)

    def _count_output(self, obs: Observation, loads: Mapping[Role, RoleLoad]) -> None:
        """Add the interval's output tokens, and its seconds if the fleet worked in it, to the step
        under way (held and sick intervals too). The fleet worked if it made tokens while holding
        requests: the router's health checks (a one-token generation per worker every 10 s) make
        tokens between steps, and a one-second sample seldom sees one running."""
        step = self.step
        if self.last_at is not None and obs.at > self.last_at:
            secs, output = obs.at - self.last_at, loads[Role.DECODE].tokens_per_s * loads[Role.DECODE].engines
            step.output_tokens += output * secs if obs.output_tokens is None else obs.output_tokens
            held = sum((load.running + load.waiting) * load.engines for load in loads.values())
            if (output > 0 or loads[Role.PREFILL].tokens_per_s > 0) and held > 0:
                prefill = loads[Role.PREFILL]
                step.computed_tokens += prefill.tokens_per_s * prefill.engines * secs
                prefilled = (
                    prefill.running > 0
                    and prefill.tokens_per_s > 0
                    and step.computed_tokens >= STEP_BEGUN * step.prompt_tokens
                )
                arrived = obs.step_arrivals > 0 and obs.steps == self.steps_seen  # (this step's, not the next's)
                if step.size[0] and step.start_split is None and (prefilled or arrived):
                    # (a step begins with its prefills at work, or with its first request at the
                    # router: a last step's decode tail is not it. A step of short prompts sharing
                    # a prefix, 2.3 s long, showed no prefill work to any 1 s sample)
                    step.start_split = (prefill.engines, loads[Role.DECODE].engines)
                    step.busy_before_start = step.busy_secs
                    if step.boundary_switch_at is not None and self.last_at == step.boundary_switch_at:
                        step.moved = True  # (its burst was under way as the boundary's switch ended)
                step.busy_secs += secs
            elif step.start_split is not None:
                step.target = None  # (the step's work is done: the queues' rules are back)
        self.last_at = obs.at

    def _step_began(self, obs: Observation, boundaries: float) -> None:
        """``boundaries`` new step boundaries: learn the step that ended (its output tokens per
        announced request, or per prompt token, and its prompt tokens per request; a step announced
        with neither, or that made no output, teaches nothing; nor do two or more boundaries seen at
        once, whose steps' output is mixed) and start the next."""
        ended = self.step
        size, unit = ended.size
        if size > 0 and ended.output_tokens > 0 and boundaries == 1:
            self.output_per, self.last_step_secs = (ended.output_tokens / size, unit), ended.busy_secs
            per_request = unit == "request" and ended.prompt_tokens > 0
            self.learned_prompt_per = ended.prompt_tokens / size if per_request else None
            measured = ended.measured()
            clock = obs.last_step_clock
            if measured is not None and clock is not None and unit == "request" and clock.requests == size:
                # (the router's clock times the step as its clients saw it: the busy intervals
                # counted here miss or add up to a second at each end of it, and an 8-engine agentic
                # step at 5:3 counted 17.5 s where its client saw 16.1 s, enough to rank it behind
                # 4:4's 17.1 s: benchmarks/results/planner_8_steps_six_at_1af7ace)
                switch_at = ended.boundary_switch_at
                if switch_at is not None and clock.age_secs > obs.at - switch_at:
                    measured = None  # (its first request came before the boundary's own switch ended)
                else:
                    measured = (measured[0], clock.secs)
                    self.step_times[measured[0]] = (clock.secs, ended.size, ROUTER_CLOCK)
            elif measured is not None:
                self.step_times[measured[0]] = (measured[1], ended.size, BUSY_CLOCK)
            self.last_step_size = ended.size
            self.last_step_held_back = _mostly(ended.held_back) if measured is not None else None
        if self._other_workload(obs):
            self.workload_capacity, self.step_times = {}, {}
        self.step = StepUnderWay(size=_size_of(obs), prompt_tokens=obs.step_prompt_tokens)

    def _how_many(
        self,
        short: Role,
        loads: Mapping[Role, RoleLoad],
        split: tuple[int, int],
        movable: int,
        captured: int = 0,
        *,
        whole_batch: bool = False,
    ) -> tuple[int, int | None]:
        """How many engines move to ``short`` at once, and the balanced split's prefill count:
        toward the split that serves the interval's workload best with both roles at their learned
        capacities (``balanced_prefills``), as far as the donor's minimum and headroom allow (its
        tokens/s spread over the engines it keeps stay within ``DONOR_HEADROOM`` of its capacity)
        and ``MOVE_SHARE`` of the fleet, or as many as the ``captured`` prefills when more of them may
        go to decode on a turn (``decide`` counts them only then): engines this planner saw as
        decodes, moved to prefill over several decisions each bounded, go back in one, with no
        graph capture to pay (at 8 engines the 30 s trace's turn took two decisions, the second
        through a capture, while three such prefills could have gone at once). Only on a turn: in
        an agentic step's tail a short decode queue moved four captured prefills at once (6:2 ->
        2:6), and the next step's burst took two decisions to move them back (0.88x, from 0.99x).
        One while a capacity or the interval's mix is not known (or under the latency objective),
        except on a turn or a whole batch queued on one side (``whole_batch``: its reading, outside
        a move's window), which then moves up to ``MOVE_SHARE`` of the fleet (not the captured
        prefills past it: with no balance, nothing says how far): a whole batch queued per engine on
        one side and none on the other is no reading to go one engine at a time on (at 8 engines a
        turn with no balance learned yet moved one decode back of the three the phase before had
        taken, and the next came a cooldown later: 8 s of a 25 s phase at 7:1 and 6:2; a planner
        new to the 30 s trace moved one decode to prefill at its first interval, 20 prompts queued
        per prefill, and the second a cooldown later, 9 s into a phase of about 19 s: 1.13x, where
        one that recalled its capacities moved both at once: 1.22x).
        One, too, when the balance says the fleet is there already but the queues say otherwise
        (the queues win)."""
        donor = other(short)
        load = loads[donor]
        fleet = sum(role_load.engines for role_load in loads.values())
        most = min(movable, load.engines - self.minimum(donor, fleet), max(move_bound(fleet), captured))
        capacity = self.capacity.get(donor)
        while (
            capacity
            and most > 1
            and load.tokens_per_s * load.engines / (load.engines - most) > (DONOR_HEADROOM * capacity)
        ):
            most -= 1
        if most <= 1:
            return 1, None
        blind = min(most, move_bound(fleet)) if whole_batch else 1  # (no balance to say how far: the bound)
        if self.config.objective is Objective.LATENCY:
            return blind, None
        best = self.balanced_prefills(loads)
        if best is None:
            return blind, None
        want = best - split[0] if short is Role.PREFILL else split[0] - best
        return max(1, min(most, want)), best

    def balanced_prefills(self, loads: Mapping[Role, RoleLoad]) -> int | None:
        """The prefill count of the split that serves the interval's mix (prompt tokens per output
        token) best, each role at its learned capacity: the most output tokens/s that both the
        prefills (at ``prefills x capacity / mix``) and the decodes (``decodes x capacity``) can
        give, within the minimums; the split nearest to the current one among equals. None until
        both capacities are learned and the interval shows prompt and output tokens. (A step's
        balance, ``step_balance``, is the same split at the step's own mix.)"""
        prefill_capacity, decode_capacity = self.capacity.get(Role.PREFILL), self.capacity.get(Role.DECODE)
        prefill, decode = loads[Role.PREFILL], loads[Role.DECODE]
        prompt, output = prefill.tokens_per_s * prefill.engines, decode.tokens_per_s * decode.engines
        if not prefill_capacity or not decode_capacity or prompt <= 0 or output <= 0:
            return None
        n = prefill.engines + decode.engines
        return self._best_prefills(n, _served(n, prefill_capacity, decode_capacity, prompt / output), prefill.engines)

    def _within(self, n: int, prefills: int) -> bool:
        """Whether ``prefills`` of ``n`` engines keeps both roles at their minimums (one at least)."""
        return self.minimum(Role.PREFILL, n) <= prefills <= n - self.minimum(Role.DECODE, n)

    def _best_prefills(self, n: int, served: Callable[[int], float], near: int) -> int | None:
        """The prefill count, within the minimums, whose split ``served`` best; the nearest to
        ``near`` among equals. None when no split of ``n`` keeps both minimums."""
        counts = [k for k in range(n + 1) if self._within(n, k)]
        return max(counts, key=lambda k: (served(k), -abs(k - near))) if counts else None

    def _learn(self, loads: Mapping[Role, RoleLoad]) -> None:
        for role, load in loads.items():
            # (decodes that run half empty are not at their capacity: their queue waits for KV)
            if load.engines and load.waiting >= self.config.backlog and load.tokens_per_s > 0 and not load.waits_for_kv:
                self.capacity[role] = max(self.capacity.get(role, 0.0), load.tokens_per_s)
                self.workload_capacity[role] = max(self.workload_capacity.get(role, 0.0), load.tokens_per_s)
        prefill, decode = loads[Role.PREFILL], loads[Role.DECODE]
        output = decode.tokens_per_s * decode.engines
        # Only a loaded interval says what its split can give: an idle one (between two RL steps, a
        # workload's tail) gave "1 output tokens/s" for 1:3 in a benchmark, and the planner then
        # refused 1:3 for the rest of the workload as "measured no better".
        loaded = any(load.waiting >= self.config.backlog for load in loads.values()) or (
            decode.slot_use is not None and decode.slot_use >= FULL
        )
        if output > 0 and loaded:
            mix = prefill.tokens_per_s * prefill.engines / output
            key = (prefill.engines, decode.engines)
            had = self.splits.get(key)
            # The best a split gave on this workload, not its last interval: a loaded interval can
            # still give less than the split can (a closed-loop load's last requests, an interval
            # that drained what a move left), and a record of that refused a move to the split
            # later (pdctl planner restarted mid-load, recalling 3:1 "at 20 output tokens/s").
            if had is None or not _same_mix(had.mix, mix) or output > had.output_tokens_per_s:
                self.splits[key] = SplitRecord(output, mix)

    def _bottleneck(self, loads: Mapping[Role, RoleLoad], obs: Observation) -> tuple[Role | None, str]:
        if self.config.objective is Objective.LATENCY:
            return self._latency_bottleneck(obs)
        prefill, decode = loads[Role.PREFILL], loads[Role.DECODE]
        need = self.config.backlog
        # Requests queued at decodes that run half empty wait for their KV, not for decoding: a
        # shortage of prefills, not of decodes, nor a sign that the decodes have no room to spare.
        for short, spare in ((prefill, decode), (decode, prefill)):
            if short.waits_for_kv:
                continue
            spare_waiting = spare.own_waiting
            if short.engines and short.waiting >= need and spare_waiting < need / 2:
                for_its_kv = " (waiting for their KV)" if spare_waiting != spare.waiting else ""
                return short.role, (
                    f"the {short.role}s hold the fleet back: {short.waiting:.1f} requests waiting per {short.role}, "
                    f"{spare.waiting:.1f} per {spare.role}{for_its_kv}"
                )
        full = decode.slot_use is not None and decode.slot_use >= FULL
        if decode.engines and full and prefill.waiting < need / 2 and prefill.running + prefill.waiting < IDLE:
            return Role.DECODE, (
                f"the decodes run full ({decode.slot_use:.0%} of their slots) while the prefills idle "
                f"({prefill.running + prefill.waiting:.2f} requests in each)"
            )
        return None, (
            f"no role holds the fleet back ({prefill.waiting:.1f} waiting per prefill, {decode.waiting:.1f} per decode)"
        )

    def _latency_bottleneck(self, obs: Observation) -> tuple[Role | None, str]:
        ttft, itl = obs.ttft_ms, obs.itl_ms
        c = self.config
        if ttft is None or itl is None or not c.ttft_ms or not c.itl_ms:
            return None, "no latency figures yet"
        over_ttft, over_itl = ttft / c.ttft_ms, itl / c.itl_ms
        if over_ttft > 1 and over_ttft > over_itl:
            return Role.PREFILL, f"TTFT {ttft:.0f} ms misses its {c.ttft_ms:.0f} ms target (ITL {itl:.0f} ms)"
        if over_itl > 1 and over_itl > over_ttft:
            return Role.DECODE, f"ITL {itl:.0f} ms misses its {c.itl_ms:.0f} ms target (TTFT {ttft:.0f} ms)"
        return None, f"TTFT {ttft:.0f} ms and ITL {itl:.0f} ms meet their targets"

    def _within_window(self, obs: Observation) -> bool:
        """Whether ``obs`` comes within the last switch's window: its cooldown and the streak after
        it (``cooldown_secs + sustain x interval_secs``), in which the usual rules would still hold
        the next move back. (Past it the usual streak decides, as soon; the turn at 8 engines that
        a cooldown-only window missed came 0.1 s after the cooldown and waited a second interval.)"""
        c = self.config
        window = c.cooldown_secs + c.sustain * c.interval_secs
        return self.last_switch_at is not None and obs.at - self.last_switch_at < window

    def _turned(self, short: Role, loads: Mapping[Role, RoleLoad], obs: Observation) -> str | None:
        """Why the workload turned against the last move, or None: within its window
        (``_within_window``), ``short`` (the bottleneck) is the role that move took engines from
        (``last_switch_to`` is the other: None after a turn or a move ahead of a step), its engines
        each queue a whole batch or more (their slots), and the other role's queue is empty
        (requests waiting for their KV aside)."""
        load = loads[short]
        if self.last_switch_to is None or self.last_switch_to is short or not load.slots:
            return None
        if not self._within_window(obs):
            return None
        if not self._whole_batch_on_one_side(short, loads):
            return None
        return (
            f"the workload turned against the last move (to {self.last_switch_to}): {load.waiting:.0f} waiting "
            f"per {short}, a whole batch of {load.slots:.0f} or more, so no sustain and no cooldown"
        )

    def _overrun(self, short: Role, loads: Mapping[Role, RoleLoad]) -> str | None:
        """Why ``short`` moves without waiting ``sustain`` intervals, or None: its engines each
        queue a whole batch or more (their slots) while the other role's queue is empty (requests
        waiting for their KV aside), in a fleet that announces no steps. No noise queues a whole
        batch per engine on one side only (the turn's reading, outside a move's window), and on
        the 8-engine 30 s shifting trace each phase opened with one (20 prompts waiting per
        prefill, then 31.5 requests per decode) an interval before the streak was long enough.
        A fleet that announces its steps gets its bursts sized by the step balance instead: a
        burst queues a whole batch by design."""
        load = loads[short]
        if self.step.size[0] or not load.slots or not self._whole_batch_on_one_side(short, loads):
            return None
        return f"{load.waiting:.0f} waiting per {short}, a whole batch of {load.slots:.0f} or more, so no sustain"

    def _whole_batch_on_one_side(self, short: Role, loads: Mapping[Role, RoleLoad]) -> bool:
        """Whether ``short``'s engines each queue a whole batch (their slots) or more while the other
        role's queue is empty (requests waiting for their KV aside): what no noise makes."""
        load, spare = loads[short], loads[other(short)]
        return bool(load.slots) and load.waiting >= (load.slots or 0) and spare.own_waiting < self.config.backlog / 2

    def _goes_on(self, short: Role, loads: Mapping[Role, RoleLoad], obs: Observation) -> str | None:
        """Why the last move goes on at once, or None: within its window (``_within_window``), it
        moved engines to ``short`` (the bottleneck still: ``last_switch_to``, None after a turn or
        a move ahead of a step), the other role idles (decodes under half their slots, whose queue
        waits for KV: ``waits_for_kv``; prefills holding under ``IDLE`` requests each, running and
        queued) and the split that balances both roles at their learned capacities
        (``balanced_prefills``) lies further toward ``short``. Throughput objective only: the
        balance is a throughput figure."""
        if self.config.objective is not Objective.THROUGHPUT or self.last_switch_to is not short:
            return None
        if not self._within_window(obs):
            return None
        donor = loads[other(short)]
        idles = donor.waits_for_kv if donor.role is Role.DECODE else donor.running + donor.waiting < IDLE
        best = self.balanced_prefills(loads)
        prefills = loads[Role.PREFILL].engines
        if not idles or best is None or (best <= prefills if short is Role.PREFILL else best >= prefills):
            return None
        n = prefills + loads[Role.DECODE].engines
        return (
            f"the last move (to {short}) goes on: the {donor.role}s idle and {best}:{n - best} balances the two "
            f"roles at their capacities, so no sustain and no cooldown"
        )

    def _donor_refuses(self, donor: Role, load: RoleLoad, obs: Observation) -> str | None:
        if self.config.objective is Objective.LATENCY:
            c = self.config
            mine, target = (obs.ttft_ms, c.ttft_ms) if donor is Role.PREFILL else (obs.itl_ms, c.itl_ms)
            if mine is not None and target and mine > LATENCY_SPARE * target:
                return f"the {donor}s have too little to spare ({mine:.0f} ms of a {target:.0f} ms target)"
        capacity = self.capacity.get(donor)
        if capacity is None or load.engines < 2:
            return None
        projected = load.tokens_per_s * load.engines / (load.engines - 1)
        if projected > DONOR_HEADROOM * capacity:
            return (
                f"one {donor} fewer would overload the rest: {projected:.0f} tokens/s each, against the "
                f"{capacity:.0f} an engine was seen to do"
            )
        return None

    def _tried(self, target: tuple[int, int], obs: Observation) -> str | None:
        before, now = self.splits.get(target), self.splits.get(_split_of(obs))
        if before is None or now is None or now.mix <= 0:
            return None
        if not _same_mix(before.mix, now.mix):
            return None  # another workload: what was measured then says nothing now
        if before.output_tokens_per_s <= now.output_tokens_per_s * (1 + BETTER_BY):
            return (
                f"{target[0]}:{target[1]} was measured on this workload at {before.output_tokens_per_s:.0f} output "
                f"tokens/s, no better than {now.output_tokens_per_s:.0f} now: staying"
            )
        return None


def _served(n: int, prefill_capacity: float, decode_capacity: float, mix: float) -> Callable[[int], float]:
    """The output tokens/s a split of ``n`` engines with k prefills serves at ``mix`` (prompt tokens
    per output token), each role at its capacity: the less of what its prefills and its decodes give."""
    return lambda k: min(k * prefill_capacity / mix, (n - k) * decode_capacity)


def _mostly(held_back: Mapping[Role, int]) -> tuple[Role, int, int] | None:
    """The role that held a step back in more than half of the readings ``held_back`` counts, two at
    least, with the count and the readings; None when neither did."""
    readings = sum(held_back.values())
    role = max(held_back, key=lambda r: held_back[r]) if held_back else None
    if role is None or held_back[role] < 2 or 2 * held_back[role] <= readings:
        return None
    return role, held_back[role], readings


def _same_mix(before: float, now: float) -> bool:
    """Whether a ratio measured ``before`` and one ``now`` are of one workload: they differ by less
    than ``SAME_MIX`` of ``now``. A ratio of 0 now (an interval whose prefills took no prompt: a
    decode tail) is the same only as another 0."""
    return abs(before - now) < SAME_MIX * now if now > 0 else before == now


def _size_of(obs: Observation) -> tuple[float, str]:
    """A step's size as its announcement says it: its requests, else its prompt tokens."""
    return (obs.step_requests, "request") if obs.step_requests > 0 else (obs.step_prompt_tokens, "prompt token")


def move_bound(fleet: int) -> int:
    """The most engines one decision moves in a fleet of ``fleet`` (``MOVE_SHARE``, at least two)."""
    return max(2, round(fleet * MOVE_SHARE))


def _cheapest(movable: Sequence[EngineLoad], to: Role) -> list[EngineLoad]:
    """``movable`` in the order they switch cheapest to ``to``: to decode, the engines that captured
    their graphs before first; then the idlest."""
    return sorted(movable, key=lambda e: (to is Role.DECODE and not e.captured, e.running + e.waiting, e.id))


def _moved(split: tuple[int, int], to: Role, count: int) -> tuple[int, int]:
    """``split`` (prefills, decodes) with ``count`` engines moved to role ``to``."""
    return (split[0] + count, split[1] - count) if to is Role.PREFILL else (split[0] - count, split[1] + count)


def _role_load(obs: Observation, role: Role) -> RoleLoad:
    mine = [e for e in obs.engines if e.role is role]
    n = len(mine)
    if not n:
        return RoleLoad(role, 0, 0.0, 0.0)
    sized = [e for e in mine if e.slots]
    slots = sum(e.slots or 0 for e in sized)
    return RoleLoad(
        role,
        n,
        sum(e.waiting for e in mine) / n,
        sum(e.tokens_per_s for e in mine) / n,
        sum(e.running for e in mine) / n,
        sum(e.running for e in sized) / slots if sized else None,
        slots / len(sized) if sized else None,
    )


def _parse_split(said: str) -> tuple[int, int]:
    """``"5:3"`` as (5, 3)."""
    prefills, decodes = said.split(":")
    return int(prefills), int(decodes)


def _split_of(obs: Observation) -> tuple[int, int]:
    return (
        sum(1 for e in obs.engines if e.role is Role.PREFILL),
        sum(1 for e in obs.engines if e.role is Role.DECODE),
    )
