"""How fast could any role schedule run the planner benchmark's RL steps? An event model of one PD
step on N engines of a sim profile, with every static split and every schedule of one or two
mid-step moves searched, beside the static rows that ``benchmarks/planner.py`` measured.

Issue 58 asks the planner for 1.1x the best static split on the RL steps. A planner can only
choose when engines change role, so the best it can do on a step is the best *schedule* of
switches for that step, known in advance (an oracle: the planner sees only the load, never the
answers' lengths). This searches those schedules on the model, on the same steps
(``benchmarks.planner.rl_steps`` / ``agentic_steps``, same seeds, 8 engines by default), so the
goal can be weighed against what role choice can give at all, not against a floor that ignores
how SGLang pairs and schedules.

The model is the sim's own cost model (``pdctl.gpu_profiles``, llama3-8b-h100 by default) with
SGLang's PD scheduling as pdctl.sim follows it, simplified:

- the router pairs each request with a prefill and a decode on arrival (power of two choices on
  in-flight requests), or, with ``--late-pairing P``, once a prefill holds fewer than P of them;
- the decode reserves the request's KV (prompt and answer tokens) when paired, first come first
  served while its pool has room; the prefill computes only reserved requests, in that order;
- a prefill forward takes up to ``chunk_tokens`` new tokens from its queue (a longer prompt takes
  several forwards) at ``prefill_ms``; a prompt the engine computed before is cached (one token
  left to compute), as the sim's radix tree gives a GRPO group's later samples;
- the KV then moves at ``transfer_ms``; the decode runs up to ``max-running-requests`` (16, as the
  benchmark sets) in a batch, each step at ``decode_step_ms(batch, context tokens)``;
- a move switches an engine once it is drained (a prefill: its queue; a decode: every request paired
  with it) and 0.42 s more (the role switch, decode graphs captured at ``up`` as the benchmark does).

Not modelled: the sim's CPU costs on a 2-core machine, the stream interval, the router's own time,
batched prefill admission beyond the chunk. The printed table puts the model's static rows beside
the measured ones so its error can be read.

    python benchmarks/step_schedules.py          # benchmarks/results/step_schedules.{json,md}
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.gpu_profiles import SimProfile, profile_named

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import STEPS, WORKLOADS  # (the benchmark's own steps and seeds)

RESULTS = Path(__file__).resolve().parent / "results"
SLOTS = 16
"""``max-running-requests`` as benchmarks/planner.py sets it."""
SWITCH_SECS = 0.42
"""A role switch once drained (benchmarks/results/role_switch.md)."""


@dataclass(frozen=True)
class Move:
    """``count`` engines leave ``role`` for the other once ``at`` of the step's requests are prefilled."""

    at: float
    role: str
    count: int

    def __str__(self) -> str:
        to = "decode" if self.role == "P" else "prefill"
        return f"{self.count} to {to} at {self.at:.0%} prefilled"


@dataclass
class Engine:
    role: str
    queue: list[int] = field(default_factory=list)
    """A prefill's reserved requests, in the order their decodes reserved them."""
    done_tokens: dict[int, int] = field(default_factory=dict)
    """A prefill's partly computed prompts: tokens computed so far."""
    cached: set[int] = field(default_factory=set)
    """Prompts this prefill computed (by identity)."""
    busy: bool = False
    paired: int = 0
    """Requests paired with it, not finished (a prefill: not yet prefilled)."""
    kv_used: int = 0
    reserving: list[int] = field(default_factory=list)
    """A decode's requests paired, waiting for KV room."""
    ready: list[int] = field(default_factory=list)
    """A decode's requests whose KV arrived, waiting for a slot."""
    running: dict[int, int] = field(default_factory=dict)
    """A decode's running requests: tokens left to make."""
    context: dict[int, int] = field(default_factory=dict)
    draining: bool = False
    switching: bool = False
    """Drained, its switch under way (scheduled once)."""


def run_step(
    step: Sequence[tuple[Sequence[int], int]],
    profile: SimProfile,
    prefills: int,
    decodes: int,
    moves: Sequence[Move] = (),
    late_room: int | None = None,
    seed: int = 0,
) -> float:
    """The modelled makespan (s) of ``step`` (prompt, answer tokens; all sent at 0) on ``prefills``
    + ``decodes`` engines, with ``moves`` made as the step goes."""
    rng = random.Random(seed)
    prompts = [len(p) for p, _ in step]
    answers = [o for _, o in step]
    identity = [id(p) for p, _ in step]
    engines = [Engine("P") for _ in range(prefills)] + [Engine("D") for _ in range(decodes)]
    prefill_of: dict[int, int] = {}
    decode_of: dict[int, int] = {}
    unpaired = list(range(len(step)))
    finished: dict[int, float] = {}
    events: list[tuple[float, int, str, int, tuple[int, ...]]] = []
    tick = itertools.count()
    pending = sorted(moves, key=lambda m: m.at)
    prefilled = 0
    now = 0.0

    def at(when: float, kind: str, engine: int, reqs: tuple[int, ...] = ()) -> None:
        heapq.heappush(events, (when, next(tick), kind, engine, reqs))

    def pick(candidates: list[int]) -> int:
        a, b = rng.sample(candidates, 2) if len(candidates) > 1 else (candidates[0],) * 2
        return a if engines[a].paired <= engines[b].paired else b

    def pair() -> None:
        while unpaired:
            ps = [i for i, e in enumerate(engines) if e.role == "P" and not e.draining]
            ds = [i for i, e in enumerate(engines) if e.role == "D" and not e.draining]
            if late_room is not None:
                ps = [i for i in ps if engines[i].paired < late_room]
            if not ps or not ds:
                return
            r = unpaired.pop(0)
            p, d = pick(ps), pick(ds)
            prefill_of[r], decode_of[r] = p, d
            engines[p].paired += 1
            engines[d].paired += 1
            engines[d].reserving.append(r)
            reserve(d)

    def reserve(d: int) -> None:
        e = engines[d]
        while e.reserving and e.kv_used + prompts[e.reserving[0]] + answers[e.reserving[0]] <= profile.kv_pool_tokens:
            r = e.reserving.pop(0)
            e.kv_used += prompts[r] + answers[r]
            engines[prefill_of[r]].queue.append(r)
            prefill(prefill_of[r])

    def prefill(p: int) -> None:
        e = engines[p]
        if e.busy or not e.queue:
            return
        pieces, batch, room = [], [], profile.chunk_tokens
        for r in e.queue:
            total = 1 if identity[r] in e.cached else prompts[r]
            done = e.done_tokens.get(r, 0)
            take = min(room, total - done)
            pieces.append((take, prompts[r] - total + done))
            e.done_tokens[r] = done + take
            room -= take
            if e.done_tokens[r] == total:
                batch.append(r)
            if room <= 0:
                break
        e.busy = True
        at(now + profile.prefill_ms(pieces) / 1000, "prefilled", p, tuple(batch))

    def decode(d: int) -> None:
        e = engines[d]
        if e.busy:
            return
        while e.ready and len(e.running) < SLOTS:
            r = e.ready.pop(0)
            e.running[r], e.context[r] = answers[r] - 1, prompts[r] + 1
        if e.running:
            e.busy = True
            at(now + profile.decode_step_ms(len(e.running), sum(e.context.values())) / 1000, "stepped", d)

    def finish(r: int) -> None:
        d = engines[decode_of[r]]
        finished[r] = now
        d.paired -= 1
        d.kv_used -= prompts[r] + answers[r]
        reserve(decode_of[r])
        drained(decode_of[r])

    def drained(i: int) -> None:
        e = engines[i]
        if e.draining and not e.switching and e.paired == 0 and not e.queue and not e.busy:
            e.switching = True
            at(now + SWITCH_SECS, "switched", i)

    def move() -> None:
        while pending and prefilled >= pending[0].at * len(step):
            m = pending.pop(0)
            mine = [i for i, e in enumerate(engines) if e.role == m.role and not e.draining]
            for i in sorted(mine, key=lambda i: engines[i].paired)[: m.count]:
                engines[i].draining = True
                drained(i)

    pair()
    while events:
        now, _, kind, i, reqs = heapq.heappop(events)
        e = engines[i]
        if kind == "prefilled":
            e.busy = False
            for r in reqs:
                e.queue.remove(r)
                del e.done_tokens[r]
                e.cached.add(identity[r])
                e.paired -= 1
                prefilled += 1
                at(now + profile.transfer_ms(prompts[r]) / 1000, "kv", decode_of[r], (r,))
            prefill(i)
            drained(i)
            move()
            pair()
        elif kind == "kv":
            (r,) = reqs
            if answers[r] <= 1:
                finish(r)
            else:
                e.ready.append(r)
                decode(i)
        elif kind == "stepped":
            e.busy = False
            for r in list(e.running):
                e.running[r] -= 1
                e.context[r] += 1
                if e.running[r] <= 0:
                    del e.running[r], e.context[r]
                    finish(r)
            decode(i)
            drained(i)
            pair()
        elif kind == "switched":
            e.role, e.draining, e.switching, e.cached = ("D" if e.role == "P" else "P"), False, False, set()
            pair()
    assert len(finished) == len(step), f"{len(step) - len(finished)} requests never finished"
    return max(finished.values())


def mean_makespan(steps: Sequence[Sequence[tuple[Sequence[int], int]]], **kwargs) -> float:
    return sum(run_step(step, **kwargs) for step in steps) / len(steps)


def schedules(n: int) -> list[tuple[int, tuple[Move, ...]]]:
    """Every (start split's prefills, moves) searched: every split with both roles, alone, with one
    move (1-3 engines either way at 10%-90% of the step prefilled) and with two moves to decode."""
    points = [k / 10 for k in range(1, 10)]
    out: list[tuple[int, tuple[Move, ...]]] = []
    for k in range(1, n):
        out.append((k, ()))
        for a, c in itertools.product(points, (1, 2, 3)):
            if k - c >= 1:
                out.append((k, (Move(a, "P", c),)))
            if n - k - c >= 1:
                out.append((k, (Move(a, "D", c),)))
        for (a, b), c, d in itertools.product(itertools.combinations(points[::2], 2), (1, 2), (1, 2)):
            if k - c - d >= 1:
                out.append((k, (Move(a, "P", c), Move(b, "P", d))))
    return out


def measured_statics(engines: int) -> dict[str, dict[str, float]]:
    """The static rows' measured makespans from the newest committed every-split run, if any."""
    path = RESULTS / f"planner_{engines}_steps_every.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["runs"]
    return {
        name: {work: rows[0][work]["makespan_s"] for work in STEPS if work in rows[0]}
        for name, rows in runs.items()
        if name.startswith("static")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--out", default="step_schedules")
    args = parser.parse_args(argv)
    profile, n = profile_named(args.profile), args.engines
    measured = measured_statics(n)
    report: dict = {"engines": n, "profile": profile.name, "workloads": {}}
    lines = [
        f"# Role schedules of the RL steps on the model ({n} engines, {profile.name})",
        "",
        "`python benchmarks/step_schedules.py`: every static split, and every schedule of one or two mid-step "
        "moves from every starting split (an oracle: chosen knowing the step), on an event model of SGLang's PD "
        "scheduling with the profile's costs; the same steps and seeds as benchmarks/planner.py.",
        "",
    ]
    for work, make in STEPS.items():
        steps = make(WORKLOADS.index(work) + 1, n // 4 or 1)
        rows: dict[str, dict] = {}
        for pairing, room in (("on arrival", None), ("late, room 1", 1), ("late, room 2", 2)):
            static: dict[int, float] = {}
            best: tuple[float, int, tuple[Move, ...]] = (float("inf"), 0, ())
            for k, moves in schedules(n):
                span = mean_makespan(steps, profile=profile, prefills=k, decodes=n - k, moves=moves, late_room=room)
                if not moves:
                    static[k] = span
                best = min(best, (span, k, moves), key=lambda b: b[0])
            rows[pairing] = {
                "static": {f"{k}:{n - k}": round(v, 2) for k, v in static.items()},
                "best_schedule": {
                    "makespan_s": round(best[0], 2),
                    "start": f"{best[1]}:{n - best[1]}",
                    "moves": [str(m) for m in best[2]],
                },
            }
        best_static = min((v, f"{p}, {s}") for p, row in rows.items() for s, v in row["static"].items())
        best_any = min((row["best_schedule"]["makespan_s"], p) for p, row in rows.items())
        ratio = best_static[0] / best_any[0]
        report["workloads"][work] = {"pairings": rows, "best_static": best_static, "best_schedule": best_any}
        report["workloads"][work]["ratio"] = round(ratio, 3)
        lines += [f"## {work}", "", "| split | measured (paired on arrival) | " + " | ".join(rows) + " |"]
        lines.append("|---" * (2 + len(rows)) + "|")
        for k in range(1, n):
            split = f"{k}:{n - k}"
            seen = measured.get(f"static {split}", {}).get(work)
            cells = [f"{rows[p]['static'][split]:.2f}" for p in rows]
            lines.append(f"| {split} | {'-' if seen is None else f'{seen:.2f}'} | " + " | ".join(cells) + " |")
        for p, row in rows.items():
            b = row["best_schedule"]
            how = f"from {b['start']}, " + (", then ".join(b["moves"]) or "no move")
            lines.append(f"\nBest schedule, pairing {p}: {b['makespan_s']:.2f} s ({how}).")
        best_row = report["workloads"][work]["best_schedule"]
        lines += [
            "",
            f"**Best of all schedules {best_row[0]:.2f} s against the best static split's {best_static[0]:.2f} s "
            f"({best_static[1]}): {ratio:.3f}x** (the issue's goal: 1.1x).",
            "",
        ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
