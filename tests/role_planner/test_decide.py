"""The P:D planner's decisions (pdctl.role_planner.decide), interval by interval."""

from __future__ import annotations

import copy
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.role_planner.config import Objective, PlannerConfig, PlannerMode, reserve
from pdctl.role_planner.decide import (
    Action,
    ClockedStep,
    Decision,
    EngineLoad,
    Observation,
    RolePlanner,
    SplitRecord,
)
from pdctl.roles import Role

P, D = Role.PREFILL, Role.DECODE


def fleet(
    at: float,
    prefills: list[tuple[float, float]],
    decodes: list[tuple[float, float]],
    slots: float | None = None,
    **kw,
) -> Observation:
    """Engines as (waiting, tokens/s), prefills then decodes, every one switchable and healthy,
    each running 1 (a prefill) or 8 (a decode) of ``slots`` (None: not said)."""
    engines = [EngineLoad(f"prefill-{i}", P, True, True, w, 1, t, slots) for i, (w, t) in enumerate(prefills)]
    engines += [EngineLoad(f"decode-{i}", D, True, True, w, 8, t, slots) for i, (w, t) in enumerate(decodes)]
    return Observation(at, tuple(engines), **kw)


CONFIG = PlannerConfig(interval_secs=10, cooldown_secs=30, sustain=2)
ONE_EACH = {"min_prefill": 1, "min_decode": 1}
"""The minimums a test sets when its point is the balance or a move's size at 8 engines, not the
reserve (by default a quarter of the fleet: 2 at 8 engines)."""


def test_a_decode_backlog_moves_the_idlest_prefill_after_two_intervals() -> None:
    planner = RolePlanner(CONFIG)
    first = planner.decide(fleet(0, [(0, 900), (0, 500)], [(6, 400), (5, 400)]))
    assert first.action is Action.STAY and "1 of 2" in first.reason
    second = planner.decide(fleet(10, [(0, 900), (0, 500)], [(6, 400), (5, 400)]))
    assert second.action is Action.SWITCH and second.to_role is D and second.engine == "prefill-0"
    assert second.figures["decode"]["waiting_per_engine"] == 5.5 and second.figures["split"] == "2:2"


def test_to_decode_it_moves_a_prefill_that_captured_its_graphs_before_an_idler_one_that_did_not() -> None:
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    obs = fleet(0, [(0, 900), (0, 500), (0, 500)], [(6, 400)])
    cold = EngineLoad("prefill-1", P, True, True, 0, 0, 500, captured=False)  # the idlest, never a decode
    engines = (obs.engines[0], cold, *obs.engines[2:])
    decision = planner.decide(Observation(0, engines))
    assert decision.action is Action.SWITCH and decision.engine == "prefill-0", decision
    # Captured, the idlest goes first.
    warm = (obs.engines[0], EngineLoad("prefill-1", P, True, True, 0, 0, 500), *obs.engines[2:])
    assert RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0)).decide(Observation(0, warm)).engine == "prefill-1"


def test_a_hold_or_a_sick_engine_waits_and_the_streak_does_not_count_them() -> None:
    planner = RolePlanner(CONFIG)
    assert planner.decide(fleet(0, [(0, 1)], [(9, 1), (9, 1)], held="weight push p1 holds the router")).action is (
        Action.WAIT
    )
    obs = fleet(10, [(0, 1), (0, 1)], [(9, 1)])
    sick = Observation(obs.at, (*obs.engines[:-1], EngineLoad("decode-0", D, True, False, 9, 0, 0)))
    assert planner.decide(sick).action is Action.WAIT
    assert planner.decide(fleet(20, [(0, 1), (0, 1)], [(9, 1)])).action is Action.STAY  # a streak of 1, not 3


def test_the_minimum_per_role_and_the_cooldown_hold() -> None:
    planner = RolePlanner(PlannerConfig(min_prefill=2, sustain=1, cooldown_secs=30))
    decision = planner.decide(fleet(0, [(0, 1), (0, 1)], [(9, 1), (9, 1)]))
    assert decision.action is Action.STAY and "minimum (2)" in decision.reason
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=30))
    planner.switched(0)
    assert "cooling down" in planner.decide(fleet(20, [(0, 1), (0, 1)], [(9, 1), (9, 1)])).reason
    assert planner.decide(fleet(31, [(0, 1), (0, 1)], [(9, 1), (9, 1)])).action is Action.SWITCH


def test_a_donor_that_would_be_overloaded_keeps_its_engines() -> None:
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    planner.decide(fleet(0, [(4, 1000), (4, 1000)], [(0, 100), (0, 100)]))  # prefills backlogged at 1000/s each
    planner.capacity[P] = 1000.0
    refused = planner.decide(fleet(10, [(0, 600), (0, 600)], [(5, 100), (5, 100)]))  # 1200/s on one: too much
    assert refused.action is Action.STAY and "overload" in refused.reason
    taken = planner.decide(fleet(20, [(0, 400), (0, 400)], [(5, 100), (5, 100)]))  # 800/s on one: fits
    assert taken.action is Action.SWITCH and taken.to_role is D


def test_it_does_not_go_back_to_a_split_it_measured_as_no_better() -> None:
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    assert planner.decide(fleet(0, [(0, 300), (0, 300)], [(5, 100), (5, 100)])).action is Action.SWITCH  # 2:2 -> 1:3
    planner.switched(0)
    planner.capacity.clear()  # (the capacity rule alone would refuse too: this checks the measured splits)
    # At 1:3 the prefill is the bottleneck now, and the fleet makes more than at 2:2: staying.
    back = planner.decide(fleet(10, [(3, 600)], [(0, 80), (0, 80), (0, 80)]))
    assert back.action is Action.STAY and "was measured on this workload" in back.reason
    # Another workload (prompts ten times longer per output token): 2:2's figure says nothing.
    shifted = planner.decide(fleet(20, [(3, 6000)], [(0, 80), (0, 80), (0, 80)]))
    assert shifted.action is Action.SWITCH and shifted.to_role is P


def test_the_latency_objective_moves_toward_the_missed_target() -> None:
    config = PlannerConfig(objective=Objective.LATENCY, ttft_ms=500, itl_ms=50, sustain=1, cooldown_secs=0)
    planner = RolePlanner(config)
    missed = planner.decide(fleet(0, [(0, 1), (0, 1)], [(0, 1), (0, 1)], ttft_ms=900, itl_ms=20))
    assert missed.action is Action.SWITCH and missed.to_role is P
    tight = planner.decide(fleet(10, [(0, 1), (0, 1)], [(0, 1), (0, 1)], ttft_ms=900, itl_ms=45))
    assert tight.action is Action.STAY and "too little to spare" in tight.reason
    met = planner.decide(fleet(20, [(0, 1), (0, 1)], [(0, 1), (0, 1)], ttft_ms=400, itl_ms=40))
    assert met.action is Action.STAY and "meet their targets" in met.reason


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 40),
            st.floats(0, 40),
            st.floats(1, 5000),
            st.floats(1, 5000),
            st.integers(0, 2),
            st.floats(0, 2),
            st.floats(0, 16),
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 3),
    st.integers(1, 3),
    st.booleans(),
)
def test_it_never_goes_below_the_minimum_nor_switches_inside_a_cooldown(
    steps: list[tuple[float, float, float, float, int, float, float]], min_prefill: int, min_decode: int, learned: bool
) -> None:
    """Whatever the loads: a switch never leaves a role under its minimum, never comes within a
    cooldown of the last unless it reverses it with a whole batch (16) queued per engine at the
    role the last took from and none at the other (and the last was no such reversal itself), or
    goes on the same way with the role it takes from idle (and the last was a move the queues
    made), never during a hold, and always moves an engine of the other role."""
    config = PlannerConfig(min_prefill=min_prefill, min_decode=min_decode, sustain=1, cooldown_secs=25)
    planner = RolePlanner(config)
    if learned:
        planner.capacity.update({P: 3_000, D: 3_000})
    split = [3, 3]
    last: tuple[float, Role, bool] | None = None  # (at, to role, reversible)
    for i, (wp, wd, tp, td, held, prefill_running, decode_running) in enumerate(steps):
        at = i * 10.0
        obs = fleet(at, [(wp, tp)] * split[0], [(wd, td)] * split[1], 16, held="a hold" if held == 2 else None)
        obs = running(running(obs, P, prefill_running), D, decode_running)
        decision = planner.decide(obs)
        if decision.action is not Action.SWITCH:
            continue
        assert held != 2
        if last is not None and at - last[0] < 25:
            assert last[2], decision
            if last[1] is not decision.to_role:
                mine, theirs = (wp, wd) if decision.to_role is P else (wd, wp)
                if decision.to_role is P and decode_running / 16 < 0.5:
                    theirs = 0  # (requests at half-empty decodes wait for their KV: the prefills' queue)
                assert mine >= 16 and theirs < 0.5, decision
                assert "turned against the last move" in decision.reason
            else:
                idle = decode_running / 16 < 0.5 if decision.to_role is P else prefill_running + wp < 1
                # (the balance it goes on toward needs both capacities: given, or learned from the
                # readings themselves, as a backlogged role teaches its own)
                knows = learned or (planner.capacity.get(P) and planner.capacity.get(D))
                assert knows and idle and "goes on" in decision.reason, decision
        donor = D if decision.to_role is P else P
        assert decision.engine is not None and decision.engine.startswith(donor.value)
        moved = len(decision.engines) if decision.to_role is P else -len(decision.engines)
        split = [split[0] + moved, split[1] - moved]
        assert split[0] >= min_prefill and split[1] >= min_decode
        assert decision.to_role is not None
        planner.switched(at, decision.to_role if decision.reversible else None)
        last = (at, decision.to_role, decision.reversible)


def test_a_whole_batch_queued_where_the_last_move_took_from_reverses_it_at_once() -> None:
    """The 8-engine 30 s trace: a decode moved to prefill (6:2 -> 7:1) 2.4 s before the prompts
    turned short and the answers long; its one decode then queued 48 (three batches of 16) with
    nothing at the prefills, and the planner waited a second interval and its cooldown. Such a
    turn moves back at the first interval, cooldown or not; a smaller queue, or one at the role the
    last move went to, waits as before."""
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    turned = planner.decide(fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert turned.action is Action.SWITCH and turned.to_role is D, turned
    assert "turned against the last move (to prefill): 48 waiting per decode" in turned.reason
    # with no balance learned yet it moves the bound (a quarter of 8), not one engine: on the sim as
    # SGLang schedules PD, one back of three left 6:2 for a cooldown more, 8 s of a 25 s phase
    assert len(turned.engines) == 2 and "5:3 is as far as a turn moves at once without a balance" in turned.reason
    # ...not the captured prefills past the bound (with no balance nothing says how far)
    warm = fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16)
    warm = Observation(12, tuple(replace(e, captured=True) for e in warm.engines))
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    assert len(planner.decide(warm).engines) == 2
    # a queue under a batch per decode: the streak and the cooldown as before
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    assert "1 of 2" in planner.decide(fleet(12, [(0, 1_000)] * 7, [(12, 1_500)], 16)).reason
    assert "cooling down" in planner.decide(fleet(14, [(0, 1_000)] * 7, [(12, 1_500)], 16)).reason
    # the same queue where the last move went (decode short after a move to decode): no turn, and
    # the cooldown holds (a whole batch skips only the streak: test_a_whole_batch_queued_on_one_side_...)
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, D)
    same = planner.decide(fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert same.action is Action.STAY and "turned" not in same.reason and "cooling down" in same.reason, same
    # nor with a queue at the other role too (no bottleneck), nor with no slots said
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    assert planner.decide(fleet(12, [(3, 1_000)] * 7, [(48, 1_500)], 16)).action is Action.STAY
    assert "1 of 2" in planner.decide(fleet(14, [(0, 1_000)] * 7, [(48, 1_500)])).reason
    # just past the cooldown, before the usual streak could act (the 8-engine run's turn came 0.1 s
    # after its cooldown and waited a second interval): a turn still
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    late = planner.decide(fleet(16.1, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert late.action is Action.SWITCH and "turned against the last move" in late.reason, late
    # past the window (the cooldown and two intervals) it is no turn: a whole batch on one side
    # moves at the first interval as anywhere else (no sustain), and says so
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    past = planner.decide(fleet(20, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert past.action is Action.SWITCH and "turned" not in past.reason and "so no sustain" in past.reason, past
    # a turn is not turned back: after it the cooldown holds, whatever queues at the other role
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    planner.switched(10, P)
    turned = planner.decide(fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert turned.to_role is D and not turned.reversible and turned.to_dict()["reversible"] is False
    planner.switched(12, turned.to_role if turned.reversible else None)
    assert "cooling down" in planner.decide(fleet(14, [(48, 1_000)] * 6, [(0, 1_500)] * 2, 16)).reason
    # under the latency objective too, a queue at both roles is no turn
    latency = RolePlanner(PlannerConfig(objective=Objective.LATENCY, ttft_ms=500, itl_ms=50, cooldown_secs=6))
    latency.switched(10, P)
    both = latency.decide(fleet(12, [(20, 1_000)] * 7, [(48, 1_500)], 16, ttft_ms=400, itl_ms=90))
    assert both.action is Action.STAY and "turned" not in both.reason, both
    # a restarted planner recalls the last move's direction from its record
    recalled = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    figures = {r.value: {"engines": 4, "waiting_per_engine": 0, "tokens_per_s_per_engine": 1} for r in (P, D)}
    entry = {"action": "switch", "to_role": "prefill", "outcome": "switched: decode-3 is prefill-6", "at": 100.0}
    recalled.recall([{**entry, "figures": figures}], now_wall=102.0, now=12.0)
    assert recalled.decide(fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16)).to_role is D
    # and not of a move it may not turn
    recalled = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    recalled.recall([{**entry, "figures": figures, "reversible": False}], now_wall=102.0, now=12.0)
    kept = recalled.decide(fleet(12, [(0, 1_000)] * 7, [(48, 1_500)], 16))
    assert kept.action is Action.STAY and "turned" not in kept.reason and "cooling down" in kept.reason, kept


def running(obs: Observation, role: Role, requests: float) -> Observation:
    """``obs`` with every engine of ``role`` running ``requests`` (the interval's mean)."""
    return replace(obs, engines=tuple(replace(e, running=requests) if e.role is role else e for e in obs.engines))


def test_a_move_the_next_reading_agrees_with_goes_on_at_once() -> None:
    """The 8-engine 30 s trace's long-prompt phase: 2:6 -> 4:4 (two decodes, the move bound), then
    13.5 prompts queued per prefill with the four decodes at 3-5% of their slots, and the next two
    waited for the streak and the 6 s cooldown: 6:2 came 21 s into a 24 s phase. Once the reading
    after a move agrees with it (the role it moved to still short, the one it took from idle, the
    balance further that way), the rest follows at the next interval; otherwise the streak and the
    cooldown hold as before."""

    def learned(**config) -> RolePlanner:
        planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2, **{**ONE_EACH, **config}))
        planner.capacity.update({P: 30_000, D: 2_300})
        return planner

    prompts = running(fleet(12, [(13.5, 29_000)] * 4, [(0, 47)] * 4, 16), D, 0.6)  # decodes at 4%
    planner = learned()
    planner.switched(10, P)
    on = planner.decide(prompts)
    assert on.action is Action.SWITCH and on.to_role is P and len(on.engines) == 2, on
    assert "the last move (to prefill) goes on: the decodes idle and 7:1 balances" in on.reason
    assert on.reversible  # (a move like any other: a turn may reverse it)
    # the decode side: after a move to decode, decodes still queueing, prefills idle, the balance 1:7
    answers = running(fleet(12, [(0, 300)] * 4, [(10, 2_000)] * 4, 16), P, 0.3)
    planner = learned()
    planner.switched(10, D)
    back = planner.decide(running(answers, D, 16))
    assert back.action is Action.SWITCH and back.to_role is D and len(back.engines) == 2, back
    assert "the last move (to decode) goes on: the prefills idle" in back.reason
    # not against the last move, nor after a turn or a move ahead of a step (None), nor after no move
    for last in (D, None):
        planner = learned()
        planner.switched(10, last)
        assert "1 of 2" in planner.decide(prompts).reason
    assert "1 of 2" in learned().decide(prompts).reason
    # not while the donors work: decodes at half their slots, prefills holding a request each
    planner = learned()
    planner.switched(10, P)
    assert "1 of 2" in planner.decide(running(prompts, D, 8)).reason
    planner = learned()
    planner.switched(10, D)
    assert "1 of 2" in planner.decide(running(running(answers, D, 16), P, 1)).reason
    # not past the balance: with decodes learned at 47 tokens/s, 4:4 is it
    planner = learned()
    planner.capacity[D] = 47
    planner.switched(10, P)
    assert "1 of 2" in planner.decide(prompts).reason
    # nor with no capacities learned, nor past the window, nor under the latency objective
    unlearned = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=6, sustain=2))
    unlearned.switched(10, P)
    assert "1 of 2" in unlearned.decide(prompts).reason
    planner = learned()
    planner.switched(10, P)
    assert "1 of 2" in planner.decide(replace(prompts, at=20)).reason
    latency = learned(objective=Objective.LATENCY, ttft_ms=500, itl_ms=50)
    latency.switched(10, P)
    slow = latency.decide(replace(prompts, ttft_ms=900, itl_ms=20))
    assert slow.action is Action.STAY and "goes on" not in slow.reason, slow
    # inside the cooldown, where a second interval of the usual streak would still wait
    planner = learned()
    planner.switched(10, P)
    planner.decide(replace(running(prompts, D, 8), at=12))  # (1 of 2: decodes busy)
    assert "cooling down" in planner.decide(replace(running(prompts, D, 8), at=14)).reason


def test_a_decode_whose_room_waits_for_prefills_is_not_the_bottleneck() -> None:
    """Room held by requests whose KV has not come (the transfer queue) is the prefills'
    shortage: a decode's prealloc queue counts only in the share of its room that decodes."""
    from pdctl.cluster.planner_loop import waiting_at
    from pdctl.cluster.sampling import EngineSample

    starved = EngineSample("up", running=1, queued=8, prealloc=8, transfer=15)
    assert waiting_at(D, starved) == 0.5
    full = EngineSample("up", running=16, queued=9, prealloc=8, transfer=0)
    assert waiting_at(D, full) == 9
    assert waiting_at(P, EngineSample("up", running=2, queued=7)) == 7


def test_decodes_that_run_full_while_the_prefills_idle_take_a_prefill() -> None:
    """No queue anywhere (a closed loop fits every request in the decodes' batches), but the
    decodes run 15 of 16 slots each and the prefills hold a fifth of a request: decode is the
    bottleneck. At 1:3 the same load fills 10 of 16 slots: it stays."""

    def obs(at: float, prefill_running: float, decode_running: float, prefills: int = 2) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, 0, prefill_running, 3000) for i in range(prefills)]
        engines += [
            EngineLoad(f"decode-{i}", D, True, True, 0, decode_running, 500, slots=16) for i in range(4 - prefills)
        ]
        return Observation(at, tuple(engines))

    planner = RolePlanner(PlannerConfig(sustain=2, cooldown_secs=0))
    assert planner.decide(obs(0, 0.2, 15)).action is Action.STAY
    moved = planner.decide(obs(10, 0.2, 15))
    assert moved.action is Action.SWITCH and moved.to_role is D and "run full (94% of their slots)" in moved.reason
    planner.switched(10)
    for at in (20, 30, 40):
        assert planner.decide(obs(at, 0.4, 10, prefills=1)).action is Action.STAY
    busy_prefills = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    assert busy_prefills.decide(obs(0, 1.5, 15)).action is Action.STAY  # the prefills work too: no clear bottleneck
    unsized = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    engines = tuple(EngineLoad(e.id, e.role, True, True, 0, e.running, 500) for e in obs(0, 0.2, 15).engines)
    assert unsized.decide(Observation(0, engines)).action is Action.STAY  # no slots said: the queue rule only


def test_a_step_boundary_moves_a_winding_down_decode_to_prefill_ahead_of_a_long_burst() -> None:
    """A trainer says a step of 200,000 prompt tokens is coming. Once the prefills' capacity is
    known (4,000 tokens/s each, learned while they were backlogged), 200,000 tokens take 25 s on
    2 prefills, over two 10 s intervals: an idle decode moves at once, no streak needed. A burst of
    20,000 (2.5 s), busy decodes, or no measured capacity: it stays and says why."""

    def obs(at: float, steps: float, tokens: float, decode_running: float = 2, prefill_wait: float = 0) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, prefill_wait, 1, 4000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 0, decode_running, 300, slots=16) for i in range(2)]
        return Observation(at, tuple(engines), steps=steps, step_prompt_tokens=tokens)

    unknown = RolePlanner(PlannerConfig(cooldown_secs=0))
    unknown.decide(obs(0, 0, 0))
    assert "no prefill capacity measured yet" in unknown.decide(obs(10, 1, 200_000)).reason

    planner = RolePlanner(PlannerConfig(cooldown_secs=0))
    planner.decide(obs(0, 0, 0, prefill_wait=3))  # backlogged prefills: 4000 tokens/s is their capacity
    short = planner.decide(obs(10, 1, 20_000))
    assert short.action is Action.STAY and "too short to switch ahead" in short.reason
    assert short.figures["step_prefill_secs"] == 2.5
    busy = planner.decide(obs(20, 2, 200_000, decode_running=12))
    assert busy.action is Action.STAY and "still busy" in busy.reason
    assert planner.decide(obs(30, 2, 200_000)).action is Action.STAY  # no new step: the hint was spent
    ahead = planner.decide(obs(40, 3, 200_000))
    assert ahead.action is Action.SWITCH and ahead.to_role is P and "ahead of the burst" in ahead.reason
    assert ahead.figures["step_prefill_secs"] == 25.0 and ahead.engines == ("decode-0",)  # 3 prefills: 16.7 s


def test_a_boundary_announced_while_the_planner_was_down_is_one_to_the_planner_restarted() -> None:
    """A planner killed after it saw 2 boundaries; the trainer announces a third before it is
    back: restarted, it recalls having seen 2 (its record) and takes the third ahead of its burst.
    With nothing recalled it could not tell when the third was announced, and takes it as seen."""

    def obs(at: float, steps: float, tokens: float = 200_000, prefill_wait: float = 0) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, prefill_wait, 1, 4000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 0, 2, 300, slots=16) for i in range(2)]
        return Observation(at, tuple(engines), steps=steps, step_prompt_tokens=tokens)

    killed = RolePlanner(PlannerConfig(cooldown_secs=0))
    told = [killed.decide(obs(0, 2, prefill_wait=3)), killed.decide(obs(10, 2))]
    assert told[-1].figures["steps_seen"] == 2
    restarted = RolePlanner(PlannerConfig(cooldown_secs=0))
    restarted.recall([d.to_dict() for d in told], now_wall=0, now=0)
    ahead = restarted.decide(obs(20, 3))
    assert ahead.action is Action.SWITCH and "ahead of the burst" in ahead.reason, ahead
    fresh = RolePlanner(PlannerConfig(cooldown_secs=0))
    fresh.recall([], now_wall=0, now=0)
    assert "step boundary" not in fresh.decide(obs(20, 3, prefill_wait=3)).reason


def test_after_a_whole_step_the_prefill_alone_moves_nothing_if_it_did_not_bound_that_step() -> None:
    """No decode was ever short (no decode capacity: no balance), prefills at 4,000 tokens/s. A step
    of 200,000 prompt tokens takes 25 s on 2 prefills: ahead of the first, a decode moves. Once a
    whole step of the workload took 60 s at that split, its prefill (25 s) did not bound it (its
    decodes or its tail did): the next boundary stays, and that step keeps its split against its
    prefills' queue. One that took 26 s was prefill-bound: it moves again."""

    def obs(at: float, steps: float) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, 0, 1, 4000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 0, 2, 300, slots=16) for i in range(2)]
        return Observation(at, tuple(engines), steps=steps, step_prompt_tokens=200_000, step_requests=64)

    for took, moves in ((60, False), (26, True)):
        planner = RolePlanner(PlannerConfig(cooldown_secs=0))
        backlogged = obs(0, 0)
        planner.decide(replace(backlogged, engines=tuple(replace(e, waiting=3) for e in backlogged.engines)))
        first = planner.decide(obs(10, 1))
        assert first.action is Action.SWITCH and first.to_role is P, first
        planner.decide(obs(10 + took, 1))
        again = planner.decide(obs(10 + took, 2))
        assert planner.last_step_secs == took and "step_balanced_prefills" not in again.figures, again
        assert (again.action is Action.SWITCH) is moves, again
        if not moves:
            assert f"where the last step took {took:.1f} s: its prefill does not bound it, staying" in again.reason
            # The boundary set this step's split (a whole step of the workload was seen): its burst's
            # queue at the prefills moves nothing within it.
            queued = obs(30 + took, 2)
            queued = replace(queued, engines=tuple(replace(e, waiting=5) if e.role is P else e for e in queued.engines))
            inside = planner.decide(queued)
            assert "this step keeps the split its boundary chose, 2:2" in inside.reason, inside


def test_a_step_boundary_moves_as_many_idle_decodes_as_the_burst_needs_within_the_move_bound() -> None:
    """2 prefills at 4,000 tokens/s and 10 idle decodes; 400,000 prompt tokens take 50 s: to fit in
    two 10 s intervals the burst needs 5 prefills, so 3 decodes move (the idlest first; a quarter
    of 12 engines is 3); with ``min_decode: 8`` two. In a fleet of 6 (2 prefills, 4 decodes) a move
    is two at most."""

    def obs(at: float, steps: float, tokens: float, decodes: int) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, 3 if not steps else 0, 1, 4000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 0, 0.5 * i, 100, slots=16) for i in range(decodes)]
        return Observation(at, tuple(engines), steps=steps, step_prompt_tokens=tokens)

    for decodes, minimum, moved in (
        (10, 1, ("decode-0", "decode-1", "decode-2")),
        (10, 8, ("decode-0", "decode-1")),
        (4, 1, ("decode-0", "decode-1")),
    ):
        planner = RolePlanner(PlannerConfig(cooldown_secs=0, min_decode=minimum))
        planner.decide(obs(0, 0, 0, decodes))  # backlogged prefills: their capacity
        ahead = planner.decide(obs(10, 1, 400_000, decodes))
        assert ahead.action is Action.SWITCH and ahead.engines == moved, (decodes, minimum, ahead)
        assert "decode-0, decode-1" in ahead.reason and "move to prefill ahead of the burst" in ahead.reason


def stepping(
    at: float,
    split: tuple[int, int],
    steps: float,
    tokens: float,
    requests: float,
    *,
    decode_rate: float = 0.0,
    output: float = 0.0,
) -> Observation:
    """A fleet of ``split`` with ``steps`` step boundaries said (the last of ``tokens`` prompt
    tokens and ``requests`` requests). ``decode_rate`` > 0: both roles backlogged, prefills at
    30,000 prompt tokens/s and decodes at ``decode_rate`` output tokens/s each (16 of 16 slots);
    0: idle but for ``output`` output tokens/s over the decodes."""
    backlog = decode_rate > 0
    engines = [
        EngineLoad(f"prefill-{i}", P, True, True, 5 if backlog else 0, 1 if backlog else 0, 30_000 if backlog else 0)
        for i in range(split[0])
    ]
    engines += [
        EngineLoad(
            f"decode-{i}",
            D,
            True,
            True,
            5 if backlog else 0,
            16 if backlog else 0.5,
            decode_rate if backlog else output / split[1],
            slots=16,
        )
        for i in range(split[1])
    ]
    return Observation(at, tuple(engines), steps=steps, step_prompt_tokens=tokens, step_requests=requests)


def working(o: Observation) -> Observation:
    """``o`` with its prefills at work (a step's interval: it begins with its prefills)."""
    return replace(
        o, engines=tuple(replace(e, running=1, tokens_per_s=30_000) if e.role is P else e for e in o.engines)
    )


def test_after_a_whole_step_a_step_boundary_moves_toward_the_split_that_finishes_the_next_soonest() -> None:
    """8 engines: prefills do 30,000 prompt tokens/s and decodes 1,000 output tokens/s each, learned
    while backlogged. A step of 128 requests is announced and makes 24,000 output tokens before the
    next boundary: 187.5 per request. The next step, 128 requests of 1,000,000 prompt tokens (about
    24,000 output tokens again), takes max(33.3 s / k, 24 s / (8 - k)) at k prefills: 5:3 (8 s)
    finishes it soonest. From 2:6 (16.7 s) decodes move ahead, two (the move bound); from 6:2 (12 s)
    an idle prefill moves to decode; 4:4 (8.3 s) is not an interval slower: it stays; nor does 6:2
    after a step that took 60 s (a tenth of it is more than the 4 s the balance would save). A step of
    short prompts and the same answers wants decodes (1:7). Before a whole step was seen, the
    prefill alone sizes the move; a step said in another unit than the last (no requests) is not
    balanced on it."""

    def obs(
        at: float,
        split: tuple[int, int],
        steps: float,
        tokens: float,
        requests: float,
        *,
        backlog: bool = False,
        output: float = 0.0,
    ) -> Observation:
        return stepping(at, split, steps, tokens, requests, decode_rate=1000 if backlog else 0.0, output=output)

    def after_one_step(split: tuple[int, int], secs: float = 12, cooldown: float = 0) -> RolePlanner:
        planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=cooldown, **ONE_EACH))
        planner.decide(obs(0, split, 0, 0, 0, backlog=True))  # both capacities
        first = planner.decide(obs(2, split, 1, 1_000_000, 128))  # sized by the prefill alone
        assert "last step" not in first.reason, first
        planner.decide(obs(2 + secs, split, 1, 1_000_000, 128, output=24_000 / secs))  # 24,000 tokens in 12 s
        return planner

    cases = [((2, 6), ("decode-0", "decode-1"), P), ((6, 2), ("prefill-0",), D), ((4, 4), (), None)]
    for split, moved, to in cases:
        ahead = after_one_step(split).decide(obs(20, split, 2, 1_000_000, 128))
        assert ahead.figures["step_balanced_prefills"] == 5 and ahead.figures["step_output_tokens"] == 24_000, ahead
        assert "187.50 output tokens per request" in ahead.reason, ahead.reason
        assert ahead.engines == moved, (split, ahead)
        assert ahead.action is (Action.SWITCH if moved else Action.STAY) and ahead.to_role is to
        staying = "0.3 s sooner than now (the last step took 12 s): staying"
        assert f"to {to} ahead of the burst" in ahead.reason if to else staying in ahead.reason, ahead.reason
    # A switch a second ago (the queues' last move of the step before): the balanced move does not wait.
    cooled = after_one_step((2, 6), cooldown=30)
    cooled.switched(19)
    assert cooled.decide(obs(20, (2, 6), 2, 1_000_000, 128)).engines == ("decode-0", "decode-1")
    # The balance knows no long tail: a step that took 60 s must be 6 s sooner, and 6:2 -> 5:3 is 4 s.
    tailed = after_one_step((6, 2), secs=60).decide(obs(70, (6, 2), 2, 1_000_000, 128))
    assert tailed.action is Action.STAY and "4.0 s sooner than now (the last step took 60 s)" in tailed.reason
    # Within SAME_MIX of the last step's prompt tokens per request (7,812) a step is of the same
    # workload and balanced; past it, another workload: the last step's answers say nothing of its
    # own, so its prefill alone decides, as before a first step (too short; or long: to prefill).
    near = after_one_step((4, 4)).decide(obs(20, (4, 4), 2, 850_000, 128))
    assert "step_balanced_prefills" in near.figures and "another workload" not in near.reason, near
    # A batch's mean prompt varies with its sample (the benchmark's reasoning steps: 160-217 tokens
    # per request): 5,000 against 7,812 is the same workload, within a factor of OTHER_WORKLOAD.
    varied = after_one_step((4, 4)).decide(obs(20, (4, 4), 2, 640_000, 128))
    assert "step_balanced_prefills" in varied.figures and "another workload" not in varied.reason, varied
    short_prompts = after_one_step((4, 4)).decide(obs(20, (4, 4), 2, 60_000, 128))
    assert short_prompts.action is Action.STAY and "step_balanced_prefills" not in short_prompts.figures
    assert "7812 prompt tokens per request and this one 469: another workload" in short_prompts.reason
    assert short_prompts.reason.endswith("too short to switch ahead"), short_prompts.reason
    long_prompts = after_one_step((4, 4)).decide(obs(20, (4, 4), 2, 8_000_000, 128))
    assert long_prompts.action is Action.SWITCH and long_prompts.to_role is P, long_prompts
    assert "step_balanced_prefills" not in long_prompts.figures and "another workload" in long_prompts.reason
    other_unit = after_one_step((4, 4)).decide(obs(20, (4, 4), 2, 1_000_000, 0))
    assert other_unit.action is Action.STAY and "step_balanced_prefills" not in other_unit.figures
    assert "no balance for it (the last step was sized in requests and this one is not)" in other_unit.reason
    # Two boundaries seen at once mix two steps' output: nothing learned from them.
    jumped = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0))
    jumped.decide(obs(0, (4, 4), 0, 0, 0, backlog=True))
    jumped.decide(obs(2, (4, 4), 1, 1_000_000, 128))
    jumped.decide(obs(14, (4, 4), 1, 1_000_000, 128, output=2000))
    assert "last step" not in jumped.decide(obs(20, (4, 4), 3, 1_000_000, 128)).reason
    # What a step taught survives a restart (the planner's record: pdctl.cluster.planner_record).
    first = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0))
    told = [
        first.decide(o)
        for o in (
            obs(0, (2, 6), 0, 0, 0, backlog=True),
            obs(2, (2, 6), 1, 1_000_000, 128),
            obs(14, (2, 6), 1, 1_000_000, 128, output=2000),
            obs(20, (2, 6), 2, 1_000_000, 128),
        )
    ]
    restarted = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0))
    restarted.recall([d.to_dict() for d in told], now_wall=0, now=0)
    assert restarted.output_per == (187.5, "request") and restarted.last_step_secs == 12
    assert restarted.learned_prompt_per == 7812.5
    restarted.decide(obs(30, (2, 6), 2, 0, 0))
    again = restarted.decide(obs(40, (2, 6), 3, 1_000_000, 128))
    assert again.figures["step_balanced_prefills"] == 5 and again.engines == ("decode-0", "decode-1"), again


def test_measured_steps_choose_the_split_a_step_begins_at_and_the_queues_leave_it_alone() -> None:
    """8 engines, both capacities learned (prefills 30,000 prompt tokens/s, decodes 1,000 output
    tokens/s). A step at 6:2 takes 12 s; the balance says 5:3 for the next and moves a prefill.
    That step's prefills queue (its burst, by design): the queues move nothing within it, and
    once it is done (an idle interval) they may again. It took 21 s at 5:3 (its busy intervals up
    to the next boundary): there the balance still says 5:3, but a step was measured there, so the
    measured steps decide and 6:2 (12 s) comes back. A step of another size is not compared with
    them; a restarted planner recalls them. A boundary that moved nothing because its donors were
    still busy leaves the queues their rules. A step with a switch in it is no measure."""

    def one_step_at_6_2(told: list[Decision] | None = None) -> RolePlanner:
        """A planner that learned both capacities and saw one step at 6:2: 12 s, 24,000 output tokens
        (two decodes at least: 7:1, past 6:2, is no split for it to try)."""
        planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, sustain=2, min_prefill=1, min_decode=2))
        for o in (
            stepping(0, (6, 2), 0, 0, 0, decode_rate=1000),
            stepping(2, (6, 2), 1, 1_000_000, 128),
            working(stepping(14, (6, 2), 1, 1_000_000, 128, output=2000)),
        ):
            decision = planner.decide(o)
            if told is not None:
                told.append(decision)
        return planner

    said = {"steps": 1, "step_prompt_tokens": 1_000_000, "step_requests": 128}
    told: list[Decision] = []
    planner = one_step_at_6_2(told)
    ahead = planner.decide(stepping(20, (6, 2), 2, 1_000_000, 128))
    told.append(ahead)
    assert ahead.action is Action.SWITCH and ahead.to_role is D and ahead.figures["step_balanced_prefills"] == 5
    assert ahead.figures["step_times"] == {"6:2": {"secs": 12.0, "size": 128, "unit": "request", "clock": "busy"}}, (
        ahead.figures
    )
    # The loop switches; until the fleet is at the chosen split (advise mode, a refusal) the step is
    # not the boundary's and the queues keep their rules.
    said["steps"] = 2
    burst = [(6, 30_000)] * 5, [(0, 0)] * 3
    not_there = copy.deepcopy(planner).decide(fleet(21, [(6, 30_000)] * 6, [(0, 0)] * 2, slots=16, **said))
    assert "keeps the split" not in not_there.reason and "1 of 2" in not_there.reason, not_there
    planner.switched(21)
    planner.decide(stepping(22, (5, 3), 2, 1_000_000, 128))  # (the training goes on; the step is sent)
    # The step's burst at 5:3: its prefills queue, the decodes not; the streak would move a decode.
    for at in (24, 26):
        inside = planner.decide(fleet(at, *burst, slots=16, **said))
        assert inside.action is Action.STAY, inside
        assert "this step keeps the split its boundary chose, 5:3, until its work is done" in inside.reason
    told.append(planner.decide(working(stepping(42, (5, 3), 2, 1_000_000, 128, output=1500))))  # 20 s busy so far
    told.append(planner.decide(stepping(43, (5, 3), 2, 1_000_000, 128)))  # idle: the step is done
    after = planner.decide(fleet(44, *burst, slots=16, **said))
    assert "keeps the split" not in after.reason, after
    planner.decide(stepping(46, (5, 3), 2, 1_000_000, 128))
    back = planner.decide(stepping(50, (5, 3), 3, 1_000_000, 128))
    told.append(back)
    assert back.figures["step_balanced_prefills"] == 5, back.figures
    assert "last steps by the split they began at: 5:3 21.0 s, 6:2 12.0 s, so 6:2" in back.reason, back.reason
    assert back.action is Action.SWITCH and back.to_role is P and len(back.engines) == 1, back
    # The same fleet at 6:2 again stays; a step of twice the requests is not compared with them.
    assert "so 6:2: staying" in planner.decide(stepping(60, (6, 2), 4, 1_000_000, 128)).reason
    other_size = planner.decide(stepping(70, (6, 2), 5, 2_000_000, 256))
    assert "last steps by the split" not in other_size.reason, other_size.reason
    restarted = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, sustain=2, **ONE_EACH))
    restarted.recall([d.to_dict() for d in told], now_wall=0, now=0)
    assert restarted.step_times == {(6, 2): (12.0, (128, "request"), "busy"), (5, 3): (21.0, (128, "request"), "busy")}
    # A boundary that could not move (the donors still busy with the last step) chose nothing: the
    # queues keep their rules within that step.
    busy = one_step_at_6_2()
    refused = busy.decide(stepping(20, (6, 2), 2, 1_000_000, 128, decode_rate=1000))
    assert "still busy with the last step" in refused.reason and not busy.step_owned, refused
    # A step with a switch in it measures nothing (the loop that switched saw none of its time),
    # and an interval whose only tokens are the router's health checks (nothing running) is not busy.
    moved = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, sustain=2, **ONE_EACH))
    moved.decide(stepping(0, (6, 2), 0, 0, 0, decode_rate=1000))
    moved.decide(stepping(2, (6, 2), 1, 1_000_000, 128))
    checks = tuple(replace(e, running=0, tokens_per_s=1.0) for e in stepping(3, (6, 2), 1, 1, 1).engines)
    moved.decide(Observation(3, checks, steps=1, step_prompt_tokens=1_000_000, step_requests=128))
    assert moved.step.busy_secs == 0 and moved.step.start_split is None
    moved.decide(working(stepping(8, (6, 2), 1, 1_000_000, 128, output=2000)))
    moved.switched(9)
    moved.decide(working(stepping(14, (6, 2), 1, 1_000_000, 128, output=2000)))
    moved.decide(stepping(20, (6, 2), 2, 1_000_000, 128))
    # (its busy seconds count the switch's drain, 8 -> 9, which the loop sampled nothing of: 5 + 1 + 5)
    assert moved.last_step_secs == 11 and moved.step_times == {}, (moved.last_step_secs, moved.step_times)
    # A burst already under way as the boundary's own switch ended is no measure either (its requests
    # were bound at the split before), and the switch's drain is no busy interval.
    late = one_step_at_6_2()
    switch = late.decide(stepping(20, (6, 2), 2, 1_000_000, 128))
    assert switch.action is Action.SWITCH and switch.to_role is D, switch
    late.switched(30)
    late.decide(working(stepping(31, (5, 3), 2, 1_000_000, 128, output=2000)))
    late.decide(working(stepping(40, (5, 3), 2, 1_000_000, 128, output=2000)))
    late.decide(stepping(50, (5, 3), 3, 1_000_000, 128))
    assert late.last_step_secs == 10 and (5, 3) not in late.step_times, (late.last_step_secs, late.step_times)
    # The balance may try a split never measured, but not while a measured one beat the split now.
    sized = stepping(0, (6, 2), 1, 1_000_000, 128)
    chooser = RolePlanner(PlannerConfig(interval_secs=2, **ONE_EACH))
    chooser.step_times = {(6, 2): (20.0, (128, "request"), "router"), (4, 4): (12.0, (128, "request"), "router")}
    # (at 6:2 it goes toward 4:4, the fastest, and past it to 3:5, on the side no step measured)
    assert chooser._measured(sized, (6, 2), 5)[0] == 3
    assert chooser._measured(sized, (4, 4), 5) is None  # (at the fastest: 5:3 may be tried)


def test_a_step_is_timed_by_the_routers_clock_and_a_balance_past_a_rise_is_not_tried() -> None:
    """A step that said its requests and sent them all is timed by the router's clock (its clients'
    view: first arrival to last answer), else by the planner's busy intervals, and the two are not
    ranked together; the balance's untried split is not tried when a split measured slower than
    the fastest (beyond 5%) lies between them (one lowest point: it lies past a rise), and the
    split past the fastest on the side no step measured is tried once. The 8-engine agentic path:
    4:4 17.1 s, 5:3 16.1 s, the balance saying 3:5."""

    def one_step(clock: ClockedStep | None) -> tuple[RolePlanner, Decision]:
        """A step of 128 requests at 6:2, busy 12 s, and the boundary after it with ``clock``."""
        planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, sustain=2, **ONE_EACH))
        planner.decide(stepping(0, (6, 2), 0, 0, 0, decode_rate=1000))
        planner.decide(stepping(2, (6, 2), 1, 1_000_000, 128))
        planner.decide(working(stepping(14, (6, 2), 1, 1_000_000, 128, output=2000)))
        return planner, planner.decide(replace(stepping(20, (6, 2), 2, 1_000_000, 128), last_step_clock=clock))

    planner, clocked = one_step(ClockedStep(9.5, 128, 17))
    assert planner.step_times == {(6, 2): (9.5, (128, "request"), "router")}, planner.step_times
    assert clocked.figures["step_times"] == {"6:2": {"secs": 9.5, "size": 128, "unit": "request", "clock": "router"}}
    assert planner.last_step_secs == 12  # (the busy intervals still bound a step's ownership)
    # Some of its requests unanswered (no clock), or fewer timed than it said: its busy intervals.
    for clock in (None, ClockedStep(9.5, 100, 17)):
        assert one_step(clock)[0].step_times == {(6, 2): (12.0, (128, "request"), "busy")}, clock
    # A step no sample saw its prefills work in (short prompts sharing a prefix) begins with its
    # first request at the router; without the router's count it is never begun, so never measured.
    for arrivals, measured in ((48.0, True), (0.0, False)):
        short = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, sustain=2, **ONE_EACH))
        short.decide(stepping(0, (6, 2), 0, 0, 0, decode_rate=1000))
        short.decide(stepping(2, (6, 2), 1, 30_000, 48))
        short.decide(replace(stepping(4, (6, 2), 1, 30_000, 48, output=2000), step_arrivals=arrivals))
        short.decide(replace(stepping(8, (6, 2), 2, 30_000, 48), last_step_clock=ClockedStep(2.3, 48, 5)))
        assert short.step_times == ({(6, 2): (2.3, (48, "request"), "router")} if measured else {}), arrivals
    # A router-clocked step is ranked among router-clocked ones only (a record's busy one aside).
    planner.step_times[(5, 3)] = (8.0, (128, "request"), "busy")
    assert planner._times_like(stepping(0, (6, 2), 3, 1_000_000, 128), 8) == {6: 9.5}
    # A step whose first request came before the boundary's own switch ended measures nothing, also
    # when its prefills had not begun in the interval after the switch (which the busy intervals see).
    for age, measured in ((25.0, False), (15.0, True)):
        late, switch = one_step(ClockedStep(9.5, 128, 17))
        assert switch.action is Action.SWITCH, switch
        late.switched(30)  # (the switch ended 20 s before the next boundary)
        late.decide(stepping(31, (5, 3), 2, 1_000_000, 128, output=100))
        late.decide(working(stepping(33, (5, 3), 2, 1_000_000, 128, output=2000)))
        late.decide(working(stepping(40, (5, 3), 2, 1_000_000, 128, output=2000)))
        late.decide(replace(stepping(50, (5, 3), 3, 1_000_000, 128), last_step_clock=ClockedStep(11.0, 128, age)))
        assert ((5, 3) in late.step_times) is measured, (age, late.step_times)

    chooser = RolePlanner(PlannerConfig(interval_secs=2, **ONE_EACH))
    chooser.step_times = {(5, 3): (16.1, (128, "request"), "router"), (4, 4): (17.1, (128, "request"), "router")}
    sized = stepping(0, (5, 3), 1, 1_000_000, 128)
    # 3:5 lies past 4:4, slower than 5:3: not tried; 6:2, past 5:3 on the side no step measured, is
    # (the balance naming it or not), once.
    probe = chooser._measured(sized, (5, 3), 3)
    assert probe is not None and probe[0] == 6 and "6:2 past it, never measured, is tried once" in probe[1], probe
    assert chooser._measured(sized, (5, 3), 6) is None  # (the balance's own untried 6:2: the balance moves)
    assert chooser._measured(stepping(0, (4, 4), 1, 1_000_000, 128), (4, 4), 3)[0] == 6  # (from 4:4 too)
    chooser.step_times[(6, 2)] = (18.8, (128, "request"), "router")
    assert chooser._measured(sized, (5, 3), 3) == (
        5,
        "this workload's last steps by the split they began at: 4:4 17.1 s, 5:3 16.1 s, 6:2 18.8 s, so 5:3",
    )
    # A split between within the noise of the fastest (5%) rules nothing out: the balance's 3:5 is tried.
    noisy = RolePlanner(PlannerConfig(interval_secs=2, **ONE_EACH))
    noisy.step_times = {(5, 3): (16.1, (128, "request"), "router"), (4, 4): (16.5, (128, "request"), "router")}
    assert noisy._measured(sized, (5, 3), 3) is None
    # Past a minimum nothing is tried: the fastest is kept.
    at_least_three = RolePlanner(PlannerConfig(interval_secs=2, min_prefill=1, min_decode=3))
    at_least_three.step_times = dict(chooser.step_times)
    del at_least_three.step_times[(6, 2)]
    assert at_least_three._measured(sized, (5, 3), 3)[0] == 5


def test_a_step_is_balanced_on_the_capacities_its_own_workload_showed() -> None:
    """8 engines at 6:2. Steps of short prompts show decodes making 2,000 output tokens/s each
    (short contexts); then the trainer turns to long prompts (7,812 tokens a request: another
    workload), whose steps show 1,000 (a decode step reads 9,000-token contexts) and prefills
    30,000. The next long-prompt step (1,000,000 prompt tokens, about 24,000 output tokens) takes
    max(33.3 s / k, 24 s / (8 - k)): 5:3 (8 s) where 6:2 takes 12, so a prefill moves to decode.
    At the all-time 2,000 a decode, 6:2 (6 s) would look soonest and nothing would move (the
    benchmark's agentic steps stayed at 6:2 where 5:3 was best). A restarted planner recalls the
    workload's capacities from its record."""

    def obs(at: float, steps: float, tokens: float, requests: float, decode_rate: float, output: float = 0.0):
        return stepping(at, (6, 2), steps, tokens, requests, decode_rate=decode_rate, output=output)

    told = []
    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, **ONE_EACH))
    for o in (
        obs(0, 0, 0, 0, 0),
        obs(2, 1, 60_000, 128, 0),  # a short-prompt step
        obs(4, 1, 60_000, 128, 2000),  # its decodes backlogged at 2,000 tokens/s each
        obs(14, 1, 60_000, 128, 0, output=2000),
        obs(20, 2, 1_000_000, 128, 0),  # long prompts: another workload
        obs(22, 2, 1_000_000, 128, 1000),  # 4,000 output tokens
        obs(32, 2, 1_000_000, 128, 0, output=2000),  # 20,000 more: 187.5 a request
    ):
        told.append(planner.decide(o))
    assert planner.capacity[D] == 2000 and planner.workload_capacity == {P: 30_000, D: 1000}
    assert "another workload" in told[4].reason and told[4].figures["workload_capacity"] == {}
    ahead = planner.decide(obs(40, 3, 1_000_000, 128, 0))
    assert ahead.figures["step_balanced_prefills"] == 5 and ahead.figures["step_output_tokens"] == 24_000, ahead
    assert ahead.action is Action.SWITCH and ahead.to_role is D and ahead.engines == ("prefill-0",), ahead
    assert ahead.figures["workload_capacity"] == {"prefill": 30_000, "decode": 1000}
    # Without the workload's own (the all-time capacities alone), 6:2 would look soonest.
    planner.workload_capacity = {}
    assert planner.step_balance(obs(40, 3, 1_000_000, 128, 0), (6, 2))[0] == 6
    restarted = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0, **ONE_EACH))
    restarted.recall([d.to_dict() for d in [*told, ahead]], now_wall=0, now=0)
    assert restarted.capacity[D] == 2000 and restarted.workload_capacity == {P: 30_000, D: 1000}
    restarted.decide(obs(41, 3, 0, 0, 0))
    again = restarted.decide(obs(60, 4, 1_000_000, 128, 0))
    assert again.figures["step_balanced_prefills"] == 5 and again.engines == ("prefill-0",), again


def test_a_restarted_planner_recalls_its_cooldown_capacity_and_splits_from_its_record() -> None:
    """A planner killed after a switch comes back knowing what it knew: within the cooldown it
    does not switch, the capacity it learned still refuses to overload a donor, and a split it
    measured as no better is not tried again; a held interval's figures teach nothing."""
    first = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=30))
    record = []
    for at, obs in (
        (0, fleet(0, [(4, 1000), (4, 1000)], [(0, 100), (0, 100)])),
        (10, fleet(10, [(0, 300), (0, 300)], [(5, 100), (5, 100)])),
    ):
        decision = first.decide(obs)
        record.append({"at": 1000.0 + at, **decision.to_dict(), "outcome": None})
    record[-1]["outcome"] = "switched: prefill-0 is decode-2"
    record.append({"at": 1011.0, "action": "wait", "figures": {"prefill": {"engines": 9}}, "outcome": None})
    again = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=30))
    again.recall(record, now_wall=1020.0, now=500.0)  # 10 s after the switch, on another monotonic clock
    assert again.capacity == first.capacity and again.capacity[P] == 1000
    assert again.splits.keys() == first.splits.keys()
    assert "cooling down" in again.decide(fleet(505, [(3, 600)], [(0, 80), (0, 80), (0, 80)])).reason
    again.capacity.clear()  # (the capacity rule alone would refuse too: this checks the recalled splits)
    back = again.decide(fleet(530, [(3, 600)], [(0, 80), (0, 80), (0, 80)]))
    assert back.action is Action.STAY and "was measured on this workload" in back.reason


def test_a_switch_the_engine_refused_is_decided_again_at_the_next_interval() -> None:
    """The loop calls ``switched`` only for a switch made; after a refusal (busy) the streak and
    the cooldown stand as they were, so the next interval decides the same switch again."""
    planner = RolePlanner(PlannerConfig(sustain=2, cooldown_secs=30))
    load = [(0, 900), (0, 500)], [(6, 400), (5, 400)]
    planner.decide(fleet(0, *load))
    refused = planner.decide(fleet(10, *load))
    assert refused.action is Action.SWITCH  # ... and the engine said it was busy: no switched()
    again = planner.decide(fleet(20, *load))
    assert again.action is Action.SWITCH and again.engine == refused.engine
    planner.switched(20)
    after = planner.decide(fleet(30, *load))  # a switch made: the streak starts over
    assert after.action is Action.STAY and "1 of 2" in after.reason


def test_requests_queued_at_half_empty_decodes_do_not_make_decode_the_bottleneck() -> None:
    """17 requests queued per decode while they run none of their 16 slots (they wait for KV from
    overloaded prefills, as a benchmark run showed): not a decode shortage. The same queue at
    decodes running 12 of 16 is one."""

    def obs(at: float, running: float) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, 0, 3, 20000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 17, running, 100, slots=16) for i in range(2)]
        return Observation(at, tuple(engines))

    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    idle = planner.decide(obs(0, 0))
    assert idle.action is Action.STAY and "no role holds the fleet back" in idle.reason
    busy = planner.decide(obs(10, 12))
    assert busy.action is Action.SWITCH and busy.to_role is D


def test_a_prefill_queue_with_decodes_waiting_for_their_kv_makes_prefill_the_bottleneck() -> None:
    """7 requests queued per prefill while the decodes hold 8 each at a fifth of their slots: the
    decodes' queue waits for the prefills' KV (seen in the benchmark's long-prompt phase, where it
    kept the planner at "no role holds the fleet back"). The same queues at decodes running 12
    of 16 are both roles short: it stays."""

    def obs(at: float, running: float) -> Observation:
        engines = [EngineLoad(f"prefill-{i}", P, True, True, 7, 2, 20000) for i in range(2)]
        engines += [EngineLoad(f"decode-{i}", D, True, True, 8, running, 100, slots=16) for i in range(2)]
        return Observation(at, tuple(engines))

    moved = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0)).decide(obs(0, 3))
    assert moved.action is Action.SWITCH and moved.to_role is P, moved
    both = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0)).decide(obs(0, 12))
    assert both.action is Action.STAY and "no role holds the fleet back" in both.reason, both


def test_the_loop_knows_a_process_it_saw_decode_as_captured_and_a_restarted_one_as_not() -> None:
    """pdctl.cluster.planner_loop.observe over three intervals: a prefill is not captured; the
    decode's process, switched to prefill (same URL and pid), is; the same URL restarted (another
    pid) is not again."""
    from pdctl.cluster.planner_loop import observe
    from pdctl.cluster.sampling import EngineSample, Sample
    from pdctl.cluster.state import ClusterState, Phase, ProcessRecord
    from pdctl.plan import load_plan
    from tests.conftest import REPO

    plan = load_plan(str(REPO / "topologies" / "planner-sim.yaml")).plan

    def state(procs: dict[str, tuple[str, int]]) -> ClusterState:
        records = {
            pid: ProcessRecord(pid, Role(pid.split("-")[0]), "me", proc, proc, 0.0, "log", url=url)
            for pid, (url, proc) in procs.items()
        }
        return ClusterState("c", "run", Phase.UP, [], processes=records, plan=plan)

    def captured(st: ClusterState, decoded: set) -> dict[str, bool]:
        samples = [
            Sample(at, {pid: EngineSample("up", running=0, queued=0) for pid in st.processes}, None) for at in (0, 1)
        ]
        return {e.id: e.captured for e in observe(st, samples, decoded).engines if e.role is P}

    decoded: set = set()
    first = {"prefill-0": ("http://a", 10), "prefill-1": ("http://b", 11), "decode-0": ("http://c", 12)}
    first["decode-1"] = ("http://d", 13)
    assert captured(state(first), decoded) == {"prefill-0": False, "prefill-1": False}
    switched = {**first, "prefill-1": ("http://c", 12), "decode-0": ("http://b", 11)}  # decode-0 <-> prefill-1
    assert captured(state(switched), decoded) == {"prefill-0": False, "prefill-1": True}
    restarted = {**switched, "prefill-1": ("http://c", 99)}  # the same URL, a new process
    assert captured(state(restarted), decoded) == {"prefill-0": False, "prefill-1": False}


def test_the_loop_rates_a_prefill_by_the_tokens_it_computed_and_counts_the_routers_queue() -> None:
    """pdctl.cluster.planner_loop.observe: a prefill's tokens/s are its prompt tokens less those its
    prefix cache held (``sglang:cached_tokens_total``: a GRPO step's samples share their prompt,
    and counting them made its learned capacity 1.8x what it computes), and the PD requests the
    router holds for room (late pairing) wait at the engines of the role that has none, spread over
    them; the sim's /metrics text says the cached tokens as SGLang does."""
    from pdctl.cluster.planner_loop import observe
    from pdctl.cluster.sampling import EngineSample, RouterSample, Sample, parse_engine_metrics
    from pdctl.cluster.state import ClusterState, Phase, ProcessRecord
    from pdctl.plan import load_plan
    from pdctl.sim.metrics import SimMetrics
    from tests.conftest import REPO

    plan = load_plan(str(REPO / "topologies" / "planner-sim.yaml")).plan
    procs = {"prefill-0": 10, "prefill-1": 11, "decode-0": 12, "decode-1": 13}
    records = {
        pid: ProcessRecord(pid, Role(pid.split("-")[0]), "me", n, n, 0.0, "log", url=f"http://e{n}")
        for pid, n in procs.items()
    }
    st = ClusterState("c", "run", Phase.UP, [], processes=records, plan=plan)
    metrics = SimMetrics("m")
    for cached in (0, 7000, 7000):  # three samples of one 8,000-token prompt on one prefill
        done = SimpleNamespace(input_ids=[0] * 8000, output_ids=[1], created=0.0, first_token_at=None)
        done.cached_tokens = cached
        metrics.observe_finished(done)  # type: ignore[arg-type]  # (what it reads of a finished Request)
    said = EngineSample("up", running=0, queued=0)
    idle = {"num_running_reqs": 0, "num_queue_reqs": 0, "kv_total_tokens": 1, "kv_used_tokens": 0}
    parse_engine_metrics(metrics.render(idle).decode(), said)
    assert (said.prompt_tokens, said.cached_tokens) == (24000, 14000)
    zero = EngineSample("up", running=0, queued=0, prompt_tokens=0, cached_tokens=0)
    before = Sample(0, dict.fromkeys(procs, zero), RouterSample("up"))
    router = RouterSample("up", waiting_for_room=12, room_short=("prefill",))
    after = Sample(2, {**dict.fromkeys(procs, zero), "prefill-0": said}, router)
    loads = {e.id: e for e in observe(st, [before, after]).engines}
    assert loads["prefill-0"].tokens_per_s == 5000  # 10,000 computed in 2 s, not 24,000
    assert loads["prefill-0"].waiting == loads["prefill-1"].waiting == 6  # 12 in the router over 2 prefills
    assert loads["decode-0"].waiting == 0
    short_of_both = RouterSample("up", waiting_for_room=4, room_short=("prefill", "decode"))
    both = Sample(2, dict.fromkeys(procs, zero), short_of_both)
    assert {e.id: e.waiting for e in observe(st, [before, both]).engines} == dict.fromkeys(procs, 2)


def test_the_loop_counts_what_the_engines_made_across_a_switch_by_their_counters() -> None:
    """pdctl.cluster.planner_loop.generated_since: the output between two observations is the
    engines' generation-token counters' growth by process (URL and pid), so what a switch's drain
    made (no interval samples it) is counted, and a decode that became a prefill (another id, the
    same process) goes on from its counter. A benchmark run counted 44 tokens per request where its
    step made about 190, the rate of the interval after a 10 s switch standing for that switch. And
    a step's output, so given, is what the planner learns."""
    from pdctl.cluster.planner_loop import generated_since
    from pdctl.cluster.sampling import EngineSample, Sample
    from pdctl.cluster.state import ClusterState, Phase, ProcessRecord

    def state(procs: dict[str, tuple[str, int]]) -> ClusterState:
        records = {
            pid: ProcessRecord(pid, Role(pid.split("-")[0]), "me", proc, proc, 0.0, "log", url=url)
            for pid, (url, proc) in procs.items()
        }
        return ClusterState("c", "run", Phase.UP, [], processes=records)

    def samples(at: float, counters: dict[str, float]) -> list[Sample]:
        return [
            Sample(
                t, {pid: EngineSample("up", generation_tokens=c - (1 - k) * 10) for pid, c in counters.items()}, None
            )
            for k, t in enumerate((at - 1, at))
        ]

    seen: dict = {}
    before = state({"decode-0": ("http://a", 1), "decode-1": ("http://b", 2)})
    assert generated_since(before, samples(2, {"decode-0": 100, "decode-1": 50}), seen) is None  # nothing seen yet
    # a switch (decode-1 is prefill-2 now; 4,000 tokens made during its drain), then an interval
    after = state({"decode-0": ("http://a", 1), "prefill-2": ("http://b", 2), "decode-3": ("http://c", 3)})
    made = generated_since(after, samples(14, {"decode-0": 3100, "prefill-2": 1050, "decode-3": 40}), seen)
    assert made == 3000 + 1000 + 10  # decode-3, new, counts from its first sample here (30 -> 40)

    planner = RolePlanner(PlannerConfig(interval_secs=2, cooldown_secs=0))
    engines = (EngineLoad("prefill-0", P, True, True, 0, 0, 0), EngineLoad("decode-0", D, True, True, 0, 1, 100))
    planner.decide(Observation(0, engines, steps=0))
    planner.decide(Observation(2, engines, steps=1, step_requests=10, step_prompt_tokens=1000))
    planner.decide(Observation(14, engines, steps=1, output_tokens=4000))  # (the rate alone says 1,200)
    planner.decide(Observation(16, engines, steps=2, step_requests=10, step_prompt_tokens=1000, output_tokens=0))
    assert planner.output_per == (400.0, "request")


def _learned(prefill_capacity: float, decode_capacity: float, **config) -> RolePlanner:
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0, **config))
    planner.capacity.update({P: prefill_capacity, D: decode_capacity})
    return planner


def test_a_long_prompt_phase_moves_every_decode_the_balance_asks_for_at_once() -> None:
    """At 1:3 under 4,000-token prompts for 16 tokens out (the benchmark's first phase: 29,000
    prompt tokens/s on the one prefill, 47 output tokens/s per decode; prefills learned at 30,000,
    decodes at 2,300), the split that serves the mix best is 3:1: both decodes it names move in one
    decision, the idlest first. Unlearned capacities move one, as before."""
    obs = fleet(0, [(28, 29_000)], [(0, 47), (0, 47), (0, 47)])
    idler = EngineLoad("decode-2", D, True, True, 0, 2, 47)  # 2 running where the others run 8
    obs = Observation(0, (*obs.engines[:-1], idler))
    decision = _learned(30_000, 2_300).decide(obs)
    assert decision.action is Action.SWITCH and decision.to_role is P, decision
    assert decision.engines == ("decode-2", "decode-0") and decision.figures["balanced_prefills"] == 3
    assert "3:1 balances" in decision.reason and decision.to_dict()["engines"] == ["decode-2", "decode-0"]
    one = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0)).decide(obs)
    assert one.action is Action.SWITCH and one.engines == ("decode-2",) and "balanced_prefills" not in one.figures


def test_a_long_answer_phase_moves_two_prefills_back_and_a_balanced_fleet_moves_one() -> None:
    """At 3:1 under 100-token prompts for 300 out (the second phase), the decode full and 16
    waiting: the balance is 1:3, two prefills move. Where the balance says 2:2 for a fleet at
    2:2 the queues still say decode is short: one moves (the queues win over the estimate)."""
    long_answers = fleet(0, [(0, 230), (0, 228), (0, 240)], [(16, 2_054)])
    decision = _learned(30_000, 2_300).decide(long_answers)
    assert decision.to_role is D and len(decision.engines) == 2 and decision.figures["balanced_prefills"] == 1
    # mix 100: 2 prefills at 30,000 feed 600 output tokens/s, 2 decodes at 2,300 give 4,600: 2:2 is
    # prefill-bound already, the balance says 3:1 or more; the queues say decode: one moves.
    queued = fleet(0, [(0, 10_000), (0, 10_000)], [(6, 100), (6, 100)])
    assert _learned(30_000, 2_300).decide(queued).engines == ("prefill-0",)


def test_unset_minimums_keep_a_quarter_of_the_fleet_in_each_role() -> None:
    """With no min_prefill/min_decode, each role keeps a quarter of the fleet (one at least): a
    long-prompt burst at 8 engines takes the decodes down to 2, not 1 (at 7:1 a benchmark's lone
    decode held the 76 requests the turn to long answers left); at 4 engines to 1; a minimum that
    is set wins."""
    burst = fleet(0, [(40, 29_000)] * 6, [(0, 47)] * 2)
    assert _learned(30_000, 2_300).decide(burst).action is Action.STAY
    assert "the decodes are at their minimum (2)" in _learned(30_000, 2_300).decide(burst).reason
    assert _learned(30_000, 2_300, min_decode=1).decide(burst).to_role is P
    small = fleet(0, [(40, 29_000)] * 2, [(0, 47)] * 2)
    assert _learned(30_000, 2_300).decide(small).to_role is P
    assert _learned(30_000, 2_300).decide(fleet(0, [(40, 29_000)] * 3, [(0, 47)])).action is Action.STAY
    assert [reserve(n) for n in (2, 4, 7, 8, 12, 16)] == [1, 1, 1, 2, 3, 4]


def test_a_move_of_several_keeps_the_donors_minimum() -> None:
    obs = fleet(0, [(28, 29_000)], [(0, 47), (0, 47), (0, 47)])
    assert len(_learned(30_000, 2_300).decide(obs).engines) == 2
    assert len(_learned(30_000, 2_300, min_decode=2).decide(obs).engines) == 1


def test_a_move_at_8_engines_is_at_most_a_quarter_of_the_fleet() -> None:
    """At 1:7 under the long-prompt phase the balance says 7:1 (six decodes), and the next long-answer
    interval's 1:7 again: at 8 engines such swings drained six engines a move (planner_8.md). Two
    move; the balance is still named, so the next decision goes on toward it."""
    obs = fleet(0, [(28, 29_000)], [(0, 47)] * 7)
    decision = _learned(30_000, 2_300, **ONE_EACH).decide(obs)
    assert decision.to_role is P and len(decision.engines) == 2 and decision.figures["balanced_prefills"] == 7
    # back to decode, prefills never seen as decodes (a capture each): two move
    cold = fleet(0, [(0, 230)] * 7, [(16, 2_054)])
    cold = Observation(0, tuple(replace(e, captured=e.role is D) for e in cold.engines))
    decision = _learned(30_000, 2_300, **ONE_EACH).decide(cold)
    assert decision.to_role is D and len(decision.engines) == 2, decision


def test_prefills_that_were_decodes_go_back_past_the_move_bound_in_one_decision() -> None:
    """The 8-engine 30 s trace turned at 7:1 after three decodes had moved to prefill in two
    decisions; back, the bound let two go, and the next decision had to take a never-captured
    prefill through a 12 s capture. On such a turn (a whole batch queued at the decode within the
    cooldown of the move to prefill) captured prefills may all go at once (as far as the balance,
    here 1:7, and the donor's minimum allow); the cold ones stay within the bound, and so does every
    move that is no turn (an agentic step's short tail queue moved four at once, 6:2 -> 2:6)."""
    obs = fleet(0, [(0, 230)] * 7, [(16, 2_054)], 16)
    warm = {"prefill-4", "prefill-5", "prefill-6"}  # the former decodes
    obs = Observation(0, tuple(replace(e, captured=e.role is D or e.id in warm) for e in obs.engines))

    def planner(moved_at: float) -> RolePlanner:
        made = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=6, **ONE_EACH))
        made.capacity.update({P: 30_000, D: 2_300})
        made.switched(moved_at, P)
        return made

    decision = planner(-2).decide(obs)
    assert decision.to_role is D and set(decision.engines) == warm and "turned" in decision.reason, decision
    assert decision.figures["balanced_prefills"] == 1
    # no turn (the last move long ago): two, captured or not
    assert len(planner(-60).decide(obs).engines) == 2
    # a prefill burst is still bounded: two decodes to prefill, however many captured prefills there are
    burst = _learned(30_000, 2_300, **ONE_EACH).decide(fleet(0, [(28, 29_000)], [(0, 47)] * 7))
    assert burst.to_role is P and len(burst.engines) == 2


def test_a_move_of_several_stops_short_of_a_split_it_measured_as_no_better() -> None:
    planner = _learned(30_000, 2_300)
    planner.splits[(3, 1)] = SplitRecord(46.0, 205.0)  # 3:1 under this mix gave 46 output tokens/s
    decision = planner.decide(fleet(0, [(28, 29_000)], [(0, 47), (0, 47), (0, 47)]))
    assert decision.action is Action.SWITCH and len(decision.engines) == 1  # to 2:2, never measured


def test_a_move_of_several_interrupted_half_way_is_recorded_with_what_it_switched(tmp_path, monkeypatch) -> None:
    """The loop switches a decision's engines one after the other (one move); a Ctrl-C during the second
    leaves the first switched: the loop stops, its record says what it switched, and its cooldown
    has started."""
    import pytest

    from pdctl.cluster import planner_loop
    from pdctl.cluster.planner_record import recent_decisions
    from pdctl.cluster.state import ClusterState, Phase, StateStore

    asked: list[str] = []

    def switch_all(name: str, engines: list[str], role: Role, on_switched, **_kw) -> list:
        for engine in engines:
            asked.append(engine)
            if len(asked) == 2:
                raise KeyboardInterrupt
            on_switched(engine, f"{role}-9")
        return []

    async def interval(*_args) -> list:
        return [None, None]  # (two samples: what observe reads, replaced below)

    obs = fleet(0, [(28, 29_000)], [(0, 47), (0, 47), (0, 47)])
    decision = _learned(30_000, 2_300).decide(obs)
    assert decision.engines == ("decode-0", "decode-1")
    monkeypatch.setattr(planner_loop, "switch_all", switch_all)
    monkeypatch.setattr(planner_loop, "_interval", interval)
    monkeypatch.setattr(planner_loop, "observe", lambda *_args: obs)
    monkeypatch.setattr(planner_loop, "generated_since", lambda *_args: None)
    store = StateStore(tmp_path)
    store.save(ClusterState("c", "run-1", Phase.UP, []))
    loop = planner_loop.PlannerLoop("c", PlannerConfig(mode=PlannerMode.ACT), store)
    monkeypatch.setattr(loop.planner, "decide", lambda _obs: decision)
    with pytest.raises(KeyboardInterrupt):
        loop.run(intervals=1)
    assert asked == ["decode-0", "decode-1"]
    assert loop.planner.last_switch_at is not None
    last = recent_decisions(store, "c", 5)[-1]
    assert last["outcome"] == "switched: decode-0 is prefill-9; then interrupted" and last["engines"] == list(asked)


def test_a_step_announced_without_its_size_leaves_the_queues_their_rules() -> None:
    """``announce_step()`` may say neither prompt tokens nor requests: such a step has no start to
    tell its end by, so its boundary sets no split to keep (it would have held the queues off for
    good)."""
    planner = RolePlanner(PlannerConfig(interval_secs=1, cooldown_secs=0, sustain=1))
    idle = ([(0, 0)] * 2, [(0, 0)] * 2, 16)
    planner.decide(fleet(0, *idle))
    boundary = planner.decide(fleet(1, *idle, steps=1.0))
    assert "the usual rules follow its burst" in boundary.reason, boundary
    burst = planner.decide(fleet(2, [(20, 8_000)] * 2, [(0, 1_500)] * 2, 16, steps=1.0))
    assert burst.action is Action.SWITCH and burst.to_role is P, burst


def test_a_health_check_in_the_wait_for_a_burst_neither_begins_nor_ends_its_step() -> None:
    """The router's health check (a one-token generation) seen at a prefill between a boundary and
    its burst is not the step's start, so the idle intervals after it are not its end: the burst
    keeps the split its boundary set (it was given back to the queues, which moved a decode
    within the first agentic step of an 8-engine run)."""
    planner = RolePlanner(PlannerConfig(interval_secs=1, cooldown_secs=0, sustain=1))
    idle = ([(0, 0)] * 2, [(0, 0)] * 2, 16)
    planner.decide(fleet(0, *idle))
    told = {"steps": 1.0, "step_prompt_tokens": 64_000.0, "step_requests": 64.0}
    planner.decide(fleet(1, *idle, **told))
    planner.decide(fleet(2, [(0, 3)] * 2, [(0, 1)] * 2, 16, **told))  # a health check's few tokens
    planner.decide(fleet(3, *idle, **told))
    burst = planner.decide(fleet(4, [(20, 8_000)] * 2, [(0, 1_500)] * 2, 16, **told))
    assert burst.action is Action.STAY and "keeps the split its boundary chose, 2:2" in burst.reason, burst


def test_a_step_its_prefills_held_back_moves_a_decode_to_prefill_at_the_next_boundary() -> None:
    """A step owned by its boundary's split moves nothing within it, so what its queues said is
    read at the next boundary: a step whose prefills held the fleet back in most of its readings,
    with no balance to size it (decodes never short: no decode capacity), moves one decode to
    prefill ahead of the next burst, where its prefill alone would have said it does not bound the
    step (the 8-engine agentic steps stayed at 4:4 through six steps so, 5:3 being faster)."""
    planner = RolePlanner(PlannerConfig(interval_secs=1, cooldown_secs=0, sustain=1))
    idle = ([(0, 0)] * 2, [(0, 0)] * 2, 16)
    planner.decide(fleet(0, *idle))
    told = {"step_prompt_tokens": 64_000.0, "step_requests": 64.0}
    planner.decide(fleet(1, *idle, steps=1.0, **told))
    for at in range(2, 9):  # the burst queues at the prefills for 7 s
        burst = planner.decide(fleet(at, [(20, 8_000)] * 2, [(0, 1_500)] * 2, 16, steps=1.0, **told))
        assert burst.action is Action.STAY and "keeps the split" in burst.reason, burst
    planner.decide(fleet(9, *idle, steps=1.0, **told))  # its work done
    boundary = planner.decide(fleet(10, [(0, 0)] * 2, [(0, 0)] * 2, 32, steps=2.0, **told))  # (decodes wound down)
    assert boundary.action is Action.SWITCH and boundary.to_role is P and not boundary.more, boundary
    assert "with its prefills holding the fleet back in 7 of its 7 readings" in boundary.reason, boundary


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # (the drop itself, as CPython reports it)
def test_a_stop_signal_dropped_where_it_landed_still_stops_the_planner(tmp_path, monkeypatch, sig) -> None:
    """The KeyboardInterrupt a stop signal raises goes where the main thread is; CPython drops one
    raised in a weakref callback (asyncio's set of tasks runs one as each task ends). The planner
    still stops at once, and says it was interrupted (a planner under load once decided on for
    minutes after its SIGINT)."""
    import weakref

    from pdctl.cluster import planner_loop
    from pdctl.cluster.state import ClusterState, Phase, StateStore
    from pdctl.signals import interrupt_on_every_stop_signal

    class Task:
        pass

    intervals: list[int] = []

    async def interval(*_args) -> list:
        intervals.append(1)
        if len(intervals) == 1:  # the signal lands in a weakref callback, as the task set's does
            task = Task()
            _ref = weakref.ref(task, lambda _r: signal.raise_signal(sig))
            del task
        return [None, None]

    obs = fleet(0, [(0, 300)], [(0, 100)])
    monkeypatch.setattr(planner_loop, "_interval", interval)
    monkeypatch.setattr(planner_loop, "observe", lambda *_args: obs)
    monkeypatch.setattr(planner_loop, "generated_since", lambda *_args: None)
    store = StateStore(tmp_path)
    store.save(ClusterState("c", "run-1", Phase.UP, []))
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        interrupt_on_every_stop_signal()  # (what pdctl's main does: SIGTERM raises as SIGINT does)
        loop = planner_loop.PlannerLoop("c", PlannerConfig(mode=PlannerMode.ADVISE), store)
        with pytest.raises(KeyboardInterrupt):
            loop.run(intervals=5)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert len(intervals) == 1 and loop.stop.is_set()


def test_an_idle_interval_is_no_measure_of_its_split() -> None:
    """A split is remembered as giving what the fleet gave only while it was loaded (a queue, or
    decodes running full): an idle interval at 1:3 (1 output token/s) must not make 1:3 a split
    "measured as no better" that the planner then refuses when the load comes."""
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    idle = fleet(0, [(0, 300)], [(0, 1), (0, 0), (0, 0)])
    planner.decide(idle)
    assert (1, 3) not in planner.splits
    busy = fleet(10, [(0, 300)], [(5, 100), (5, 100), (5, 100)])
    planner.decide(busy)
    assert planner.splits[(1, 3)].output_tokens_per_s == 300


def test_a_split_is_remembered_at_its_best_on_a_workload() -> None:
    """A loaded interval that gives less than its split did before on the same mix (a load's
    tail) lowers nothing; an interval of another mix replaces the record."""
    planner = RolePlanner(PlannerConfig(sustain=1, cooldown_secs=0))
    planner.decide(fleet(0, [(0, 300)], [(5, 100), (5, 100), (5, 100)]))
    assert planner.splits[(1, 3)].output_tokens_per_s == 300
    planner.decide(fleet(10, [(0, 100)], [(5, 33), (5, 33), (5, 34)]))  # same mix, a third of it
    assert planner.splits[(1, 3)].output_tokens_per_s == 300
    planner.decide(fleet(20, [(0, 400)], [(5, 110), (5, 110), (5, 110)]))  # same mix, more
    assert planner.splits[(1, 3)].output_tokens_per_s == 330
    planner.decide(fleet(30, [(0, 3000)], [(5, 50), (5, 50), (5, 50)]))  # prompts longer per output token
    assert planner.splits[(1, 3)].output_tokens_per_s == 150
    # A decode tail whose prefills took no prompt in the interval is a mix of its own (it divided by
    # zero before: the planner process would have died in an RL step's tail).
    planner.decide(fleet(40, [(0, 0)], [(5, 40), (5, 40), (5, 40)]))
    assert planner.splits[(1, 3)].output_tokens_per_s == 120 and planner.splits[(1, 3)].mix == 0


def test_only_an_act_planner_settles_a_move_left_half_done(tmp_path, monkeypatch) -> None:
    """A move killed half way left an engine cordoned ahead: an act planner settles it before it
    decides anything (pdctl.cluster.switch.settle_half_done); an advise planner changes nothing and
    decides on."""
    from pdctl.cluster import planner_loop
    from pdctl.cluster.state import ClusterState, Phase, StateStore

    settled: list[str] = []
    obs = fleet(0, [(28, 29_000)], [(0, 47), (0, 47), (0, 47)])

    async def interval(*_args) -> list:
        return [None, None]

    monkeypatch.setattr(planner_loop, "settle_half_done", lambda name, **_kw: settled.append(name))
    monkeypatch.setattr(planner_loop, "_interval", interval)
    monkeypatch.setattr(planner_loop, "observe", lambda *_args: obs)
    monkeypatch.setattr(planner_loop, "generated_since", lambda *_args: None)
    store = StateStore(tmp_path)
    left = ClusterState("c", "run-1", Phase.UP, [])
    left.cordoned_ahead = {"command": "planner", "pid": 1, "engines": {"decode-1": "http://127.0.0.1:9"}}
    store.save(left)
    advise = planner_loop.PlannerLoop("c", PlannerConfig(mode=PlannerMode.ADVISE), store)
    advise.run(intervals=1)
    assert settled == []
    act = planner_loop.PlannerLoop("c", PlannerConfig(mode=PlannerMode.ACT, interval_secs=0.01), store)
    monkeypatch.setattr(act.planner, "decide", lambda _obs: Decision(Action.STAY, "steady"))
    calls = []

    def once(name: str, **_kw) -> None:  # settled: the record goes, as recover's lift makes it go
        calls.append(name)
        state = store.load(name)
        state.cordoned_ahead = None
        store.save(state)

    monkeypatch.setattr(planner_loop, "settle_half_done", once)
    act.run(intervals=1)
    assert calls == ["c"]


def test_a_whole_batch_queued_on_one_side_moves_without_the_streak() -> None:
    """The 8-engine 30 s shifting trace opened each phase with a whole batch queued per engine of
    one role (20 prompts per prefill, then 31.5 requests per decode) and nothing at the other: it
    moves at that first interval, not the second, and as far as a turn does with no balance
    learned (a quarter of the fleet: 4:4 -> 6:2; a planner new to the trace moved one, and the
    second a cooldown later). A queue under a batch, one with a queue at the other role too,
    slots not said, the cooldown: the streak as before. A fleet that announces steps (its bursts
    queue a batch by design; the step balance sizes them): its step keeps the split its boundary
    set."""
    config = PlannerConfig(interval_secs=1, cooldown_secs=6, sustain=2)
    first = RolePlanner(config).decide(fleet(0, [(20, 1_000)] * 4, [(0, 1_500)] * 4, 16))
    assert first.action is Action.SWITCH and first.to_role is P and len(first.engines) == 2, first
    assert "20 waiting per prefill, a whole batch of 16 or more, so no sustain" in first.reason
    assert "(6:2 is as far as a whole batch on one side moves at once without a balance)" in first.reason
    small = RolePlanner(config).decide(fleet(0, [(20, 1_000)] * 2, [(0, 1_500)] * 2, 16))  # (at 4: one, the minimum)
    assert small.action is Action.SWITCH and len(small.engines) == 1, small
    for prefills, decodes, slots in (
        ([(12, 1_000)] * 4, [(0, 1_500)] * 4, 16),  # under a batch
        ([(20, 1_000)] * 4, [(0, 1_500)] * 4, None),  # slots not said
    ):
        assert "1 of 2" in RolePlanner(config).decide(fleet(0, prefills, decodes, slots)).reason
    both = RolePlanner(config).decide(fleet(0, [(20, 1_000)] * 4, [(3, 1_500)] * 4, 16))
    assert both.action is Action.STAY, both
    cooling = RolePlanner(config)
    cooling.switched(0, None)  # (a turn: neither turned nor gone on with)
    assert "cooling down" in cooling.decide(fleet(3, [(20, 1_000)] * 4, [(0, 1_500)] * 4, 16)).reason
    announced = RolePlanner(config)
    idle = ([(0, 1_000)] * 4, [(0, 1_500)] * 4, 16)
    announced.decide(fleet(0, *idle))
    told = {"steps": 1.0, "step_prompt_tokens": 8_000.0, "step_requests": 64.0}
    announced.decide(fleet(1, *idle, **told))  # the step boundary
    burst = announced.decide(fleet(2, [(20, 1_000)] * 4, [(0, 1_500)] * 4, 16, **told))
    assert burst.action is Action.STAY and "keeps the split its boundary chose, 4:4" in burst.reason, burst


def test_a_workloads_first_step_keeps_its_boundarys_split_until_its_work_is_done() -> None:
    """Before any whole step of a workload was seen, its step is still bound to its engines when it
    is sent (pairing on arrival): the queues move nothing within it (on the 8-engine agentic steps
    such a move drained a decode for 10 s and the step took 18.8 s from 4:4, where static 4:4
    takes 17.1), and once an interval says its work is done their rules are back."""
    planner = RolePlanner(PlannerConfig(interval_secs=1, cooldown_secs=0, sustain=1))
    idle = ([(0, 0)] * 2, [(0, 0)] * 2, 16)
    planner.decide(fleet(0, *idle))
    told = {"steps": 1.0, "step_prompt_tokens": 64_000.0, "step_requests": 64.0}
    boundary = planner.decide(fleet(1, *idle, **told))
    assert boundary.action is Action.STAY and "no prefill capacity measured yet" in boundary.reason, boundary
    for at in (2, 3, 4):  # the burst queues at the prefills
        burst = planner.decide(fleet(at, [(20, 8_000)] * 2, [(0, 1_500)] * 2, 16, **told))
        assert burst.action is Action.STAY and "keeps the split its boundary chose, 2:2" in burst.reason, burst
    planner.decide(fleet(5, *idle, **told))  # its work done: nothing held, nothing made
    later = planner.decide(fleet(6, [(20, 8_000)] * 2, [(0, 1_500)] * 2, 16, **told))
    assert later.action is Action.SWITCH and later.to_role is P, later
