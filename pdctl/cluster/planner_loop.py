"""``pdctl planner``: the P:D planner's loop over a running cluster.

Each interval: ``SAMPLES`` samples of every engine's and the router's metrics (pdctl.cluster.sampling,
spread over ``interval_secs``) make an ``Observation`` (rates from the first and last, running
requests as their mean); ``RolePlanner.decide`` answers; in ``act`` mode a ``switch`` decision runs
``pdctl switch``'s own code (pdctl.cluster.switch: the router drains the engines of a move side by
side, the journal covers a Ctrl-C, a refusal leaves it serving as it was). Every decision, with its
reason and figures, is logged and appended to ``planner.jsonl`` beside the cluster's state (0600),
which ``pdctl status --json`` shows. A switch the engine refused (busy) is tried again at the next
interval: the bottleneck streak stands until a switch is made.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp

from pdctl.cluster.keys import ClusterKeys, load_keys
from pdctl.cluster.nodes import Events, quiet
from pdctl.cluster.planner_record import KEEP_DECISIONS, append_decision, recent_decisions
from pdctl.cluster.sampling import EngineSample, RouterSample, Sample, Sampler
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.cluster.switch import left_behind, settle_half_done, switch_all
from pdctl.cluster.watch import quantile
from pdctl.errors import LifecycleError
from pdctl.role_planner.config import PlannerConfig, PlannerMode
from pdctl.role_planner.decide import Action, ClockedStep, Decision, EngineLoad, Observation, RolePlanner
from pdctl.roles import Role
from pdctl.signals import interrupt_where_it_lands
from pdctl.step_hint import PLANNER_PATH

log = logging.getLogger("pdctl.planner")

SAMPLES = 5
"""Samples per interval: a mean of running requests needs more than two instants."""


def observe(state: ClusterState, samples: list[Sample], decoded: set[tuple[str, int]] | None = None) -> Observation:
    """The interval that ``samples`` (two or more, in time order) span, as the planner reads it.
    ``decoded``: the (URL, recorded pid) of engines seen running as decodes (their graphs are
    captured; a restarted engine is another pid); the decodes of this interval are added to it.
    None: every engine is taken as captured."""
    before, after = samples[0], samples[-1]
    dt = max(after.at - before.at, 1e-6)
    engines = state.plan.engine_map()
    loads = []
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    for pid, now in after.engines.items():
        rec = state.processes.get(pid)
        engine = engines.get(rec.engine_id or pid) if rec is not None else None
        if rec is None or engine is None or rec.role not in (Role.PREFILL, Role.DECODE):
            continue
        was = before.engines.get(pid, EngineSample("unknown"))
        if rec.role is Role.PREFILL:
            rate = _rate(computed(was), computed(now), dt)
        else:
            rate = _rate(was.generation_tokens, now.generation_tokens, dt)
        running = [s.engines[pid].running for s in samples if pid in s.engines]
        said = [r for r in running if r is not None]  # (an SGLang without /v1/loads says it in /metrics only)
        loads.append(
            EngineLoad(
                engine.id,
                rec.role,
                bool(engine.role_switch and engine.switch_group),
                now.reach == "up",
                waiting_at(rec.role, now),
                sum(said) / len(said) if said else 0.0,
                rate,
                now.slots,
                decoded is None or (rec.url, rec.pid) in decoded or rec.role is Role.DECODE,
            )
        )
        if decoded is not None and rec.role is Role.DECODE and rec.url:
            decoded.add((rec.url, rec.pid))
        if rec.role is Role.DECODE:
            _add_delta(ttft, was.ttft, now.ttft)
            _add_delta(itl, was.itl, now.itl)
    router = after.router
    hold = router.hold if router is not None else None
    if router is not None and router.waiting_for_room:
        loads = with_router_queue(loads, router.waiting_for_room, router.room_short)
    return Observation(
        after.at,
        tuple(loads),
        hold,
        _ms(quantile(0.5, ttft)),
        _ms(quantile(0.5, itl)),
        steps=router.steps if router is not None else 0.0,
        step_prompt_tokens=router.step_prompt_tokens if router is not None else 0.0,
        step_requests=router.step_requests if router is not None else 0.0,
        step_arrivals=router.step_arrivals if router is not None else 0.0,
        last_step_clock=_clocked(router),
    )


def _clocked(router: RouterSample | None) -> ClockedStep | None:
    """The step before the latest announced one as the router timed it, once all of it was answered."""
    if router is None or router.previous_step_in_flight or router.previous_step_secs <= 0:
        return None
    return ClockedStep(router.previous_step_secs, router.previous_step_requests, router.previous_step_age_secs)


def with_router_queue(loads: list[EngineLoad], waiting: float, short: tuple[str, ...]) -> list[EngineLoad]:
    """``loads`` with the PD requests waiting in the router for room (late pairing) counted as
    waiting at the engines of the roles that have none: they wait for those engines' work as a
    queue at them would, spread evenly (the router pairs each with whichever has room first)."""
    roles = {role for role in (Role.PREFILL, Role.DECODE) if str(role) in short}
    counts = {role: sum(1 for load in loads if load.role is role) for role in roles}
    return [
        replace(load, waiting=load.waiting + waiting / counts[load.role]) if load.role in roles else load
        for load in loads
    ]


def generated_since(state: ClusterState, samples: list[Sample], seen: dict[tuple[str, int], float]) -> float | None:
    """Output tokens the engines made since ``seen`` (their generation-token counters by process,
    URL and pid, which a switch keeps), up to the last of ``samples``; ``seen`` is updated. An
    engine not seen before counts from its first sample here. None the first time (nothing seen)."""
    first = not seen
    made = 0.0
    for pid, now in samples[-1].engines.items():
        rec = state.processes.get(pid)
        if rec is None or not rec.url or now.generation_tokens is None:
            continue
        key = (rec.url, rec.pid)
        start = seen.get(key)
        if start is None:
            start = samples[0].engines.get(pid, EngineSample("unknown")).generation_tokens
        if start is not None and now.generation_tokens >= start:
            made += now.generation_tokens - start
        seen[key] = now.generation_tokens
    return None if first else made


def computed(sample: EngineSample) -> float | None:
    """The prompt tokens an engine computed so far: its prompt tokens less those it found in its
    prefix cache (SGLang's ``cached_tokens_total``, when it says). What a prefill's time goes to:
    a GRPO step's samples share their prompt, and counting the cached copies made a prefill's
    learned capacity 48,824 tokens/s where it computes about 27,500 (the 8B profile, 8,000-token
    prompts; benchmarks/results/planner_8_steps_late2.md), which then sized an agentic step's
    prefill at 4.0 s that took 7."""
    if sample.prompt_tokens is None:
        return None
    return sample.prompt_tokens - (sample.cached_tokens or 0.0)


def waiting_at(role: Role, sample: EngineSample) -> float:
    """Requests that wait for this engine's own work. A prefill: its queue. A decode: its queue,
    plus its prealloc queue (requests waiting for KV room) in the share of its room held by
    requests that decode: room held by requests whose prefill has not sent their KV yet (the
    transfer queue) is the prefills' shortage, not the decode's."""
    queued = sample.queued or 0.0
    if role is not Role.DECODE:
        return queued
    prealloc, running, transfer = sample.prealloc or 0.0, sample.running or 0.0, sample.transfer or 0.0
    decoding = running / (running + transfer) if running + transfer > 0 else 1.0
    return queued - prealloc + prealloc * decoding


def _rate(before: float | None, now: float | None, dt: float) -> float:
    if before is None or now is None or now < before:
        return 0.0
    return (now - before) / dt


def _add_delta(into: dict[float, float], before: dict[float, float], now: dict[float, float]) -> None:
    for bound, count in now.items():
        into[bound] = into.get(bound, 0.0) + max(0.0, count - before.get(bound, 0.0))


def _ms(secs: float | None) -> float | None:
    return None if secs is None else round(secs * 1000, 1)


async def _interval(sampler: Sampler, secs: float, stop: threading.Event) -> list[Sample]:
    """``SAMPLES`` samples spread over ``secs`` (fewer when ``stop`` is set meanwhile): a whole
    one first and last, light ones (running requests only) between."""
    samples = [await sampler.sample()]
    start = time.monotonic()
    for k in range(1, SAMPLES):
        due = start + secs * k / (SAMPLES - 1)
        while time.monotonic() < due and not stop.is_set():  # the interval, cut short by a stop
            await asyncio.sleep(min(0.2, max(0.0, due - time.monotonic())))
        if stop.is_set():
            break
        samples.append(await (sampler.sample() if k == SAMPLES - 1 else sampler.running()))
    return samples


class PlannerLoop:
    """The planner of one cluster (``run`` until ``stop`` is set)."""

    def __init__(self, name: str, config: PlannerConfig, store: StateStore, events: Events = quiet):
        self.name = name
        self.config = config
        self.store = store
        self.events = events
        self.planner = RolePlanner(config)
        self.stop = threading.Event()
        self.generated: dict[tuple[str, int], float] = {}
        """The generation-token counter last seen of each engine process (URL, pid): what the
        fleet made between two observations, a switch's drain included (``generated_since``)."""
        self.left_said = ""
        """Why a switch left half done could not be settled, as last logged."""
        self.decoded: set[tuple[str, int]] = set()
        """(URL, pid) of the engines this planner saw running as decodes (``observe``), or whose
        ``/server_info`` says they captured decode graphs (``up`` captures prefills': pdctl.cluster.
        graph_capture); a planner restarted starts it again from what it sees and asks."""
        self.asked_graphs: set[tuple[str, int]] = set()
        """(URL, pid) of the prefills asked once whether they captured decode graphs."""

    def run(self, intervals: int | None = None, told: Callable[[Decision], None] | None = None) -> None:
        """Decide every interval (``intervals`` of them, or until ``stop``); act in ``act`` mode.

        A Ctrl-C raises KeyboardInterrupt where it lands, as in every pdctl command: in the middle of
        a switch, the switch's own handling undoes it (while it drains) or finishes it (once the
        engine was asked). Under asyncio.run's own SIGINT handler it would only cancel the loop's
        task at its next await, after a switch that may drain for minutes (seen: a Ctrl-C during
        the drain, and the planner switched the engine, then stopped)."""
        with interrupt_where_it_lands(self.stop):
            asyncio.run(self._run(intervals, told))

    async def _run(self, intervals: int | None, told: Callable[[Decision], None] | None) -> None:
        done = 0
        recalled = False
        async with aiohttp.ClientSession() as session:
            while not self.stop.is_set() and (intervals is None or done < intervals):
                state = self.store.load(self.name)
                if state is None or state.status in (Phase.DOWN, Phase.STOPPING, Phase.FAILED):
                    log.info("cluster %s is %s: the planner stops", self.name, state.status if state else "gone")
                    return
                if state.status != Phase.UP:  # (starting, or a day-2 command's status): decide when it is up
                    await asyncio.to_thread(self.stop.wait, self.config.interval_secs)
                    continue
                if self.config.mode is PlannerMode.ACT and left_behind(state):  # a move (its own, killed) or a
                    # switch left half done: settled first (advise changes nothing; status names it meanwhile)
                    try:
                        await asyncio.to_thread(settle_half_done, self.name, store=self.store, events=self.events)
                    except LifecycleError as exc:  # (another command holds the cluster, say: the next interval tries)
                        if str(exc) != self.left_said:  # (said once, not every interval)
                            log.warning("a switch left half done stays so for now: %s", exc)
                            self.left_said = str(exc)
                    await asyncio.to_thread(self.stop.wait, self.config.interval_secs)
                    continue
                if not recalled:  # what a planner of this run learned before a crash or a restart
                    mine = [
                        e
                        for e in recent_decisions(self.store, self.name, KEEP_DECISIONS)
                        if e.get("run") == state.run_id
                    ]
                    self.planner.recall(mine, time.time(), time.monotonic())
                    recalled = True
                keys = load_keys(self.store, state.name)
                sampler = Sampler(state, keys, session, versions_and_workers=False)
                await self._ask_captured(sampler, state)
                samples = await _interval(sampler, self.config.interval_secs, self.stop)
                if self.stop.is_set() or len(samples) < 2:
                    return
                made_since = generated_since(state, samples, self.generated)
                obs = replace(observe(state, samples, self.decoded), output_tokens=made_since)
                decision = self.planner.decide(obs)
                decided = time.time()
                made: list[str] = []
                try:
                    outcome, said = (
                        await self._act(decision, made) if decision.action is Action.SWITCH else ("none", None)
                    )
                except BaseException:  # stopped between two switches of one move: what it switched is recorded
                    if made:
                        said = f"switched: {', '.join(made)}; then interrupted"
                        self._record(decision, said, self._entry(state, decision, said, decided))
                    raise
                entry = self._entry(state, decision, said, decided)
                self._record(decision, said, entry)
                await _report(session, state, keys, {**entry, "outcome": outcome})
                if told is not None:
                    told(decision)
                done += 1

    async def _ask_captured(self, sampler: Sampler, state: ClusterState) -> None:
        """Ask each prefill process not asked yet whether it captured decode graphs; those that
        did count as ``decoded`` (a switch of theirs to decode is cheap: ``_cheapest``)."""
        ask = [
            rec
            for rec in state.processes.values()
            if rec.role is Role.PREFILL and rec.url and (rec.url, rec.pid) not in self.decoded | self.asked_graphs
        ]
        said = await asyncio.gather(*(sampler.captured_decode_graphs(rec) for rec in ask))
        for rec, captured in zip(ask, said, strict=True):
            self.asked_graphs.add((rec.url or "", rec.pid))
            if captured:
                self.decoded.add((rec.url or "", rec.pid))

    async def _act(self, decision: Decision, done: list[str]) -> tuple[str, str]:
        """(outcome: switched, refused or advised; what happened, in words). A decision that moves
        several engines switches them in one move (``switch_all``: drained side by side, switched
        one after the other, with no cooldown between); one refused ends the move there, and the
        ones switched stay switched. ``done`` gets each switch made as it is made ("prefill-0 is
        decode-2"), for a move interrupted half way to be recorded."""
        assert decision.engine is not None and decision.to_role is not None
        if self.config.mode is not PlannerMode.ACT:
            return "advised", "advised (mode advise: nothing changed)"
        try:
            # (in this thread, blocking the loop: nothing else runs meanwhile; a Ctrl-C reaches switch's handling)
            switch_all(
                self.name,
                list(decision.engines),
                decision.to_role,
                store=self.store,
                events=self.events,
                command="planner",
                on_switched=lambda old, new: done.append(f"{old} is {new}"),
            )
        except LifecycleError as exc:  # busy, gone, or refused: it serves on; the next interval tries again
            if not done:
                return "refused", f"not switched: {exc}"
            return "switched", f"switched: {', '.join(done)}; then not: {exc}"
        finally:
            if done:  # (a Ctrl-C between two switches too: those made are the fleet's now, and the cooldown stands)
                self.planner.switched(time.monotonic(), decision.to_role if decision.reversible else None)
        return "switched", f"switched: {', '.join(done)}"

    def _entry(self, state: ClusterState, decision: Decision, outcome: str | None, decided: float) -> dict[str, Any]:
        """The record of ``decision``: ``at`` when it was done (a switch's drain and switch included:
        the cooldown runs from there), ``decided_at`` when it was made (the wall clock both)."""
        entry = {"at": time.time(), "decided_at": round(decided, 3), "run": state.run_id}
        return {**entry, "mode": self.config.mode.value, **decision.to_dict(), "outcome": outcome}

    def _record(self, decision: Decision, outcome: str | None, entry: dict[str, Any]) -> None:
        level = logging.INFO if decision.action is Action.SWITCH else logging.DEBUG
        log.log(level, "%s%s", decision.reason, f" -> {outcome}" if outcome else "")
        self.events("planner", f"{decision.action.value}: {decision.reason}" + (f" -> {outcome}" if outcome else ""))
        append_decision(self.store, self.name, entry)


async def _report(
    session: aiohttp.ClientSession, state: ClusterState, keys: ClusterKeys | None, entry: dict[str, Any]
) -> None:
    """Tell the router (``POST /pdctl/planner``: counted in ``pdctl_planner_decisions_total``).
    A router that does not answer costs the metric one count, nothing else."""
    if not state.router_url:
        return
    headers = {"Authorization": f"Bearer {keys.control}"} if keys is not None else {}
    try:
        async with session.post(
            state.router_url + PLANNER_PATH, json=entry, headers=headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            if resp.status != 200:
                log.warning("the router refused the planner's decision: HTTP %s", resp.status)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.warning("the router did not take the planner's decision: %s", exc or type(exc).__name__)


def planner_config(state: ClusterState, overrides: dict[str, Any]) -> PlannerConfig:
    """The cluster's ``planner:`` section (from its plan), with ``overrides`` (the command's flags) on top."""
    raw = dict(state.plan.planner or {})
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return PlannerConfig.from_dict(raw)
