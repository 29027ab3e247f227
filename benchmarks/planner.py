"""The P:D planner against every static split of the same engines (issue 58), in one run on one
local cluster of N sim engines (4 by default, ``--engines 8``) costed as Llama-3.1-8B on H100s
(``--sim-profile llama3-8b-h100``, ``max-running-requests: 16``, ``stream-interval: 8``), same seeds
for every configuration. The load grows with N (clients, prompts, requests: x N / 4), so each
workload takes about as long at 8 engines as at 4.

Workloads (each client an aiohttp stream through the router, so TTFT and ITL are measured at the
client; the engines stream every 8 tokens, as SGLang does with ``--stream-interval 8``, which keeps
the 2-core machine's CPU out of the figures: benchmarks/results/sim_fleet.md):

(a) **An RL step** (GRPO): B = 8 prompts x n = 8 samples, all 64 sent at once, 3 steps in a row,
    each announced (``POST /pdctl/step``) 8 s before it is sent, while the trainer trains on the
    last rollout; the figure is the mean step's makespan (its sending to its last sample's end).
    Prompt and answer lengths are log-normal, the long tail reasoning RL shows (a few answers run
    5-10x the median; the prompts of a step differ in length by 10x): prompts median 1,500 tokens
    (sigma 0.6, 200-6,000), answers median 200 tokens (sigma 0.8, 16-1,200). A step opens
    prefill-bound (64 prompts, 8 distinct) and ends in a decode tail.
(a') **An agentic RL step** (a turn of multi-turn tool-use or coding agents): 64 trajectories, each
    with its own history as its prompt (so nothing is shared between them: an agent's turn prompts
    with everything it did so far), log-normal median 8,000 tokens (sigma 0.5, 2,000-24,000), and a
    short action as its answer, median 150 tokens (sigma 0.7, 16-800); 3 steps, each announced.
    Its prefill is several intervals long, so this is the step where switching ahead of the burst
    (the step hint) can pay, and its decode tail is short.
(b) **A serving trace whose mix shifts halfway**: 32 closed-loop clients, 320 requests of 4,000
    prompt tokens and 16 out, then 320 of 100 and 300 out (each half about 30 s); and the same
    three times as long (960 and 960: each half about 90 s). A serving day's shifts last minutes
    to hours, so the long one is the nearer, and still short, of the two; a switch costs a drain
    (and, with ``--graphs at-first-switch``, a first flip to decode the profile's 12 s graph
    capture; by default every prefill captured at ``up``), so phases of 30 s show what that leaves.
    The figure is goodput: requests within TTFT <= 3 s and mean ITL <= 60 ms per second of the
    trace; and the planner's reaction: seconds from each phase's first request to its first
    switch toward that phase's bottleneck.
(b') **The same two traces with 48 clients** (``shifting_full``, ``shifting_full_long``): with 32,
    the long-answer half asks for exactly the even split's decode slots, so only its long-prompt
    half can gain from a move; with 48 each half wants more of its role than the even split has.
(c) **A steady trace** (the second half's mix throughout, 240 requests): goodput again; the planner
    should hold the best split and not lose to it.

Each static split (1:N-1 ... N-1:1) is set with ``pdctl switch`` and runs with a planner in advise
mode beside it: on this 2-core machine the planner's sampling (five samples of every engine per
interval) takes CPU the sim engines and the router need, which on GPUs it would not; an advise
planner samples the same and changes nothing, so every row pays the same. The steady trace once
more on a bare 1:N-1 shows what that costs here. The planner starts from the even split in act
mode (interval 1 s unless ``--interval``, cooldown 6 s, sustain 2), each workload anew and with no
record to recall (the advise planners' beside the static rows is set aside), as each static row runs
each from its split (``--planner-start goes-on``: one planner through them all, from wherever
the last left it).
``--repeats R`` runs every configuration's workloads R times in turn (a row each time) and reports
each figure's median and range. Goals (issue 58): on the shifting workloads the planner >= 1.1x the
best static split; on the steady one >= 0.95x.

    python benchmarks/planner.py                # 4 engines: benchmarks/results/planner.{json,md}
    python benchmarks/planner.py --engines 8    # benchmarks/results/planner_8.{json,md}
    python benchmarks/planner.py --only shifting --splits 2 --repeats 2   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import yaml

from pdctl.cluster.keys import load_keys
from pdctl.cluster.planner_record import KEEP_DECISIONS, decisions_path, recent_decisions
from pdctl.cluster.state import StateStore
from pdctl.gpu_profiles import profile_named
from pdctl.role_planner.config import reserve
from pdctl.signals import interrupt_on_every_stop_signal

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
NAME = "plbench"
PROFILE = {"sim-profile": "llama3-8b-h100", "max-running-requests": 16, "stream-interval": 8}
TTFT_SECS, ITL_SECS = 3.0, 0.060


def pdctl(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([PY, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=900)
    if check and res.returncode != 0:
        raise RuntimeError(f"pdctl {' '.join(args)}: {res.stderr[-2000:]}")
    return res


def split_of(home: Path) -> dict[str, list[str]]:
    engines = json.loads((home / NAME / "state.json").read_text())["plan"]["engines"]
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for e in engines:
        out[e["role"]].append(e["id"])
    return out


def set_split(prefills: int, home: Path, env: dict) -> None:
    while True:
        now = split_of(home)
        if len(now["prefill"]) == prefills:
            return
        if len(now["prefill"]) > prefills:
            pdctl("switch", NAME, sorted(now["prefill"])[-1], "decode", env=env)
        else:
            pdctl("switch", NAME, sorted(now["decode"])[-1], "prefill", env=env)


# -- the client ---------------------------------------------------------------------------------------
async def one(session: aiohttp.ClientSession, url: str, ids: list[int], out: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": out}, "stream": True}
    sent = time.monotonic()
    first = None
    tokens = 0
    async with session.post(url + "/generate", json=body) as resp:
        status = resp.status
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if first is None:
                first = time.monotonic()
            tokens = json.loads(line[6:])["meta_info"]["completion_tokens"]
    end = time.monotonic()
    ttft = (first or end) - sent
    itl = (end - (first or end)) / max(tokens - 1, 1)
    return {"status": status, "ttft": ttft, "itl": itl, "end": end, "tokens": tokens}


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(0.0, sigma) * median)))


TRAIN_SECS = 8.0
"""The trainer's own part of an RL step between two rollouts (its update and the weight push), while
the fleet idles: an 8B model's update takes seconds to minutes; 8 s is the short end."""


async def announced_steps(url: str, control_key: str, steps: list[list[tuple[list[int], int]]]) -> dict:
    """Each step's requests (prompt, answer tokens) sent at once, ``TRAIN_SECS`` after the step is
    announced, as a trainer does with ``pdctl.step_hint.announce_step`` (the same ``POST
    /pdctl/step``) when its dataloader gives it the next batch, before it trains on the last
    rollout: the distinct prompts' tokens, which the prefills compute. The figure is the mean step's
    makespan, from its requests' sending to its last answer (the training between is not in it)."""
    spans = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for step in steps:
            distinct = {id(prompt): len(prompt) for prompt, _ in step}
            said = {"prompt_tokens": sum(distinct.values()), "requests": len(step)}
            headers = {"Authorization": f"Bearer {control_key}"}
            async with session.post(url + "/pdctl/step", json=said, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
            await asyncio.sleep(TRAIN_SECS)  # the trainer trains on the last rollout meanwhile
            start = time.monotonic()
            done = await asyncio.gather(*(one(session, url, prompt, out) for prompt, out in step))
            assert all(d["status"] == 200 for d in done), [d["status"] for d in done]
            spans.append(max(d["end"] for d in done) - start)
    return {"makespan_s": sum(spans) / len(spans), "steps": spans}


def rl_steps(seed: int, scale: int, steps: int = 3) -> list[list[tuple[list[int], int]]]:
    """GRPO: 8 x ``scale`` prompts (median 1,500 tokens) x 8 samples each (answers median 200)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        step = []
        for _p in range(8 * scale):
            prompt = [rng.randrange(256) for _ in range(lognormal(rng, 1500, 0.6, 200, 6000))]
            step += [(prompt, lognormal(rng, 200, 0.8, 16, 1200)) for _ in range(8)]
        out.append(step)
    return out


def agentic_steps(seed: int, scale: int, steps: int = 3) -> list[list[tuple[list[int], int]]]:
    """64 x ``scale`` trajectories, each with its own long history (median 8,000 tokens) and a short action
    (median 150)."""
    rng = random.Random(seed)
    return [
        [
            (
                [rng.randrange(256) for _ in range(lognormal(rng, 8000, 0.5, 2000, 24000))],
                lognormal(rng, 150, 0.7, 16, 800),
            )
            for _ in range(64 * scale)
        ]
        for _ in range(steps)
    ]


async def trace(url: str, seed: int, phases: list[tuple[int, int, int]], clients: int = 32) -> dict:
    """Closed-loop ``clients`` over ``phases`` of (requests, prompt tokens, output tokens)."""
    rng = random.Random(seed)
    work = [(k, p, o) for k, (n, p, o) in enumerate(phases) for _ in range(n)]
    work = [(k, [rng.randrange(256) for _ in range(p)], o) for k, p, o in work]
    results: list[dict] = []
    queue = list(reversed(work))
    phase_starts: list[float] = []  # wall time each phase's first request was sent
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:

        async def client() -> None:
            while queue:
                phase, ids, out = queue.pop()
                if phase == len(phase_starts):
                    phase_starts.append(time.time())
                results.append({**await one(session, url, ids, out), "phase": phase})

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        took = time.monotonic() - start
    good = [r for r in results if r["status"] == 200 and r["ttft"] <= TTFT_SECS and r["itl"] <= ITL_SECS]
    failed = [r for r in results if r["status"] != 200]
    misses = [  # per phase: requests past each target (one request may miss both)
        {
            "ttft": sum(1 for r in results if r["phase"] == k and r["ttft"] > TTFT_SECS),
            "itl": sum(1 for r in results if r["phase"] == k and r["itl"] > ITL_SECS),
        }
        for k in range(len(phases))
    ]
    return {
        "goodput_rps": len(good) / took,
        "secs": took,
        "good": len(good),
        "requests": len(results),
        "failed": len(failed),
        "phase_starts": phase_starts,
        "misses": misses,
    }


SHIFT = [(320, 4000, 16), (320, 100, 300)]
LONG_SHIFT = [(960, 4000, 16), (960, 100, 300)]
STEADY = [(240, 100, 300)]
TRACES = {
    "shifting": SHIFT,
    "shifting_long": LONG_SHIFT,
    "steady": STEADY,
    "shifting_full": SHIFT,
    "shifting_full_long": LONG_SHIFT,
}
"""Each trace's phases at 4 engines (requests, prompt tokens, output tokens); the requests grow with the fleet."""
CLIENTS = {"shifting_full": 48, "shifting_full_long": 48}
"""Each trace's closed-loop clients at 4 engines (32 unless named here); they grow with the fleet.
With 32, the long-answer half asks for exactly the even split's decode slots (2 decodes x 16
running), so no split with more decodes serves it faster and no planner can gain there (the
``phase_ceiling`` line of the results before this one: at most 1.09x at 8 engines). The *full*
traces send 48: one and a half times the even split's slots, so the long-answer half wants
decodes past the even split as the long-prompt half wants prefills past it (a fleet sized for its
load, as serving fleets are, whose mix turns)."""
STEPS = {"rl_step": rl_steps, "agentic_step": agentic_steps}
WORKLOADS = [*STEPS, *TRACES]
GOALS = {w: 0.95 if w == "steady" else 1.1 for w in WORKLOADS}
"""Issue 58: the planner against the best static split, >= 1.1x on the RL steps and shifting traces, 0.95x steady."""
TITLES = {
    "rl_step": "RL step makespan (s)",
    "agentic_step": "agentic RL step makespan (s)",
    "shifting": "shifting trace, 30 s phases (req/s)",
    "shifting_long": "shifting trace, 90 s phases (req/s)",
    "steady": "steady trace (req/s)",
    "shifting_full": "shifting trace, 48 clients, 30 s phases (req/s)",
    "shifting_full_long": "shifting trace, 48 clients, 90 s phases (req/s)",
}


def alone_floor(work: str, scale: int, steps_per_workload: int) -> float:
    """The mean over ``work``'s steps (as ``workloads`` makes them) of its slowest request alone on an
    idle engine of the profile: a floor under any split's makespan, since a batch and a queue only add."""
    profile = profile_named(PROFILE["sim-profile"])
    seed = WORKLOADS.index(work) + 1

    def alone(prompt: int, out: int, shared: bool) -> float:
        ms = (0.0 if shared else profile.prefill_ms([(prompt, 0)])) + profile.transfer_ms(prompt)
        return (ms + sum(profile.decode_step_ms(1, prompt + k) for k in range(out))) / 1000

    def slowest(step: list[tuple[list[int], int]]) -> float:
        uses = collections.Counter(id(prompt) for prompt, _ in step)  # a shared prompt may be in a prefix cache
        return max(alone(len(prompt), out, uses[id(prompt)] > 1) for prompt, out in step)

    steps = STEPS[work](seed, scale, steps_per_workload)
    return sum(map(slowest, steps)) / len(steps)


def work_floor(work: str, engines: int, steps_per_workload: int) -> float:
    """The mean over ``work``'s steps of their work spread evenly over ``engines`` engines at the
    profile's cheapest: every distinct prompt prefilled once in one batch and every output token
    decoded in a full batch (``max-running-requests``) at its own request's context. A floor under
    any schedule's makespan, roles and switches free."""
    profile = profile_named(PROFILE["sim-profile"])
    full = PROFILE["max-running-requests"]
    per_token_ms = (profile.decode_ms_per_step + full * profile.decode_us_per_request / 1000) / full

    def work_ms(step: list[tuple[list[int], int]]) -> float:
        distinct = {id(prompt): len(prompt) for prompt, _ in step}
        prefill = profile.prefill_ms([(tokens, 0) for tokens in distinct.values()])
        decode = sum(
            out * per_token_ms + (out * len(prompt) + out * (out - 1) / 2) * profile.decode_us_per_ktok / 1e6
            for prompt, out in step
        )
        return prefill + decode

    steps = STEPS[work](WORKLOADS.index(work) + 1, max(1, engines // 4), steps_per_workload)
    return sum(map(work_ms, steps)) / len(steps) / 1000 / engines


def scaled(phases: list[tuple[int, int, int]], scale: int) -> list[tuple[int, int, int]]:
    return [(n * scale, p, o) for n, p, o in phases]


def workloads(
    url: str,
    control_key: str,
    engines: int,
    only: list[str],
    steps: int,
    after: Callable[[], None] = lambda: None,
) -> dict:
    """Every workload of ``only`` in turn, for a fleet of ``engines`` (``steps`` steps of each RL
    step workload); ``after`` is called after each."""
    scale = max(1, engines // 4)
    out: dict[str, dict] = {}
    for seed, name in enumerate(WORKLOADS, start=1):
        if name not in only:
            continue
        if name in STEPS:
            out[name] = asyncio.run(announced_steps(url, control_key, STEPS[name](seed, scale, steps)))
        else:
            clients = CLIENTS.get(name, 32) * scale
            out[name] = asyncio.run(trace(url, seed=seed, phases=scaled(TRACES[name], scale), clients=clients))
        print(f"  {name}: {json.dumps(out[name])}", flush=True)
        after()
    return out


@contextlib.contextmanager
def planner_beside(mode: str, work: Path, env: dict) -> Iterator[None]:
    """``pdctl planner NAME --mode MODE`` in the background while the block runs, which begins once
    the planner has recorded its first decision: started as a workload announces its first step, it
    would take that step's boundary as already seen (every planner row of the step workloads from
    2026-12-07 evening until this was fixed missed its first step's announcement so, the planner of each
    workload being started right before it)."""
    started = time.time()
    with (work / f"planner-{mode}.log").open("a") as log:
        planner = subprocess.Popen(
            [PY, "-m", "pdctl", "planner", NAME, "--mode", mode], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            store = StateStore(work / "home")
            while not any(d.get("mode") == mode and d.get("at", 0) >= started for d in recent_decisions(store, NAME)):
                if planner.poll() is not None:
                    raise RuntimeError(f"the {mode} planner exited with {planner.returncode}: {log.name}")
                time.sleep(0.1)  # (the record is a file the planner rewrites: no event to wait on)
            yield
        finally:
            # SIGTERM stops it as Ctrl-C does; a SIGINT is ignored by a planner this benchmark started
            # while itself run in the background (`cmd &`: a shell without job control ignores it)
            planner.send_signal(signal.SIGTERM)
            planner.wait(timeout=300)


def main() -> None:
    # SIGTERM and SIGHUP stop it as Ctrl-C does, through the `finally` that takes its cluster down
    # (killed with SIGTERM, it used to leave every engine of its cluster running)
    interrupt_on_every_stop_signal()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4, help="engines in the fleet (even; default 4)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every configuration's workloads")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="workloads to run, comma-separated")
    parser.add_argument("--splits", default="", help="prefill counts of the static splits (default: all)")
    parser.add_argument(
        "--policy",
        default="power_of_two",
        help="the router's policy for both roles (default power_of_two, the router's default in a fleet whose "
        "planner acts since 2026-12-04 evening; every committed result before ran round_robin unless it says)",
    )
    parser.add_argument(
        "--planner-start",
        choices=["even", "goes-on"],
        default="even",
        help="the planner row: each workload from the even split with a new planner (with no record to recall "
        "since 2026-12-07 evening), as each static row runs each from its split (default), or all in turn with "
        "one planner from wherever the last left the fleet (every committed result before 2026-12-03 evening)",
    )
    parser.add_argument(
        "--min-per-role",
        type=int,
        default=None,
        help="the planner's min_prefill and min_decode (default: unset, the planner's reserve of a quarter of the "
        "fleet per role, 1 at 4 engines and 2 at 8; every committed result before 2026-12-04 ran with 1 unless "
        "it says otherwise)",
    )
    parser.add_argument(
        "--graphs",
        choices=["at-up", "at-first-switch"],
        default="at-up",
        help="when each prefill captures its decode CUDA graphs: at `pdctl up` (planner.capture_graphs_at_up, "
        "the default for a planner that acts since 2026-12-04 evening), or on its first switch to decode, "
        "inside the load (every committed result before)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="the planners' interval_secs, the advise ones beside the static rows too (default 1; every "
        "committed result before 2026-12-04 evening ran 2)",
    )
    parser.add_argument(
        "--late-pairing",
        default="",
        metavar="P[:D]",
        help="the router pairs late: each prefill holds at most P of its requests, each decode at most D "
        "(router.admission prefill_room and decode_room; pdctl.router.pair_room), every row alike; default: "
        "paired on arrival (every committed result before 2026-12-07)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="steps of each RL step workload (default 3, every committed result before 2026-12-07 night); "
        "the results say the figure after the first step beside the mean of all",
    )
    parser.add_argument("--out", default="", help="results' name under benchmarks/results (default planner[_N])")
    args = parser.parse_args()
    rooms = [int(k) for k in args.late_pairing.split(":") if k]
    late = [*rooms, 0, 0][:2]
    n = args.engines
    only = [w for w in args.only.split(",") if w]
    unknown = set(only) - set(WORKLOADS)
    if unknown or n < 2 or n % 2 or args.steps < 1:
        parser.error(f"unknown workloads {sorted(unknown)}" if unknown else "--engines: an even count, 2 or more")
    splits = [int(k) for k in args.splits.split(",") if k] or list(range(1, n))
    out_name = args.out or ("planner" if n == 4 else f"planner_{n}")
    work = Path(tempfile.mkdtemp(prefix="pdctl-planner-bench-"))
    home = work / "home"
    env = {**os.environ, "PDCTL_HOME": str(home)}
    switchable = {"replicas": n // 2, "role_switch": True, "args": PROFILE}
    topo = {
        "name": NAME,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": n, "workdir": str(work / "runs")}],
        "ports": {"base": 27500},
        "prefill": switchable,
        "decode": switchable,
        "router": {
            "policy": args.policy,
            "admission": {"worker_wait_secs": 120, "prefill_room": late[0], "decode_room": late[1]},
        },
        "planner": {
            "mode": "off",
            "interval_secs": args.interval,
            "cooldown_secs": 6,
            "sustain": 2,
            **({} if args.min_per_role is None else dict.fromkeys(("min_prefill", "min_decode"), args.min_per_role)),
            "capture_graphs_at_up": args.graphs == "at-up",  # (mode off: the planners run beside, by hand)
        },
    }
    (work / "t.yaml").write_text(yaml.safe_dump(topo))
    up = pdctl("up", str(work / "t.yaml"), env=env)
    url = next(line.split()[-1] for line in up.stdout.splitlines() if line.startswith("router:"))
    control_key = load_keys(StateStore(home), NAME).control
    runs: dict[str, list[dict]] = {}
    decisions: list[dict] = []  # every planner decision of every run, in order (the advise planners' too)
    try:
        for _ in range(args.repeats):
            for prefills in splits:
                set_split(prefills, home, env)
                name = f"static {prefills}:{n - prefills}"
                with planner_beside("advise", work, env):  # its sampling costs every row the same CPU
                    runs.setdefault(name, []).append(workloads(url, control_key, n, only, args.steps))
                print(name, json.dumps(runs[name][-1]), flush=True)
            if "steady" in only:
                set_split(1, home, env)
                bare = asyncio.run(trace(url, seed=99, phases=scaled(STEADY, n // 4 or 1), clients=32 * (n // 4 or 1)))
                print(f"static 1:{n - 1} without a planner beside it, steady:", json.dumps(bare), flush=True)
                runs.setdefault("bare", []).append({"steady": bare})
            set_split(n // 2, home, env)
            started = time.time()
            decided: dict[tuple, dict] = {}  # planner.jsonl keeps the latest 200 (the advise planners' too)

            def collect(into: dict[tuple, dict] = decided) -> None:  # (`pdctl planner --history` prints 50)
                for d in recent_decisions(StateStore(home), NAME, KEEP_DECISIONS):
                    into[(d["at"], d.get("engine"), d.get("outcome"))] = d

            def forget(into: dict[tuple, dict] = decided) -> None:
                """Keep the record so far and start the next planner with none: a planner recalls what
                the record of its cluster's run says, and here that was what the advise planners
                beside the static rows had learned (their capacities, steps and splits), which a
                user's first planner does not know (every committed result before 2026-12-07 evening
                ran so)."""
                collect(into)
                decisions_path(StateStore(home), NAME).unlink(missing_ok=True)

            if args.planner_start == "goes-on":
                forget()
                with planner_beside("act", work, env):
                    row = workloads(url, control_key, n, only, args.steps, after=collect)
            else:  # each workload from the even split, with a planner that has seen none of the others
                row = {}
                for name in only:
                    set_split(n // 2, home, env)
                    forget()
                    with planner_beside("act", work, env):
                        row.update(workloads(url, control_key, n, [name], args.steps))
                    collect()
            collect()
            switched = sorted(
                (d for d in decided.values() if d["at"] >= started and (d.get("outcome") or "").startswith("switched")),
                key=lambda d: d["at"],
            )
            row["switches"] = [f"{' and '.join(d.get('engines') or [d['engine']])} -> {d['to_role']}" for d in switched]
            row["switches_done_at"] = [d["at"] for d in switched]  # wall clock, as phase_starts
            row["reactions"] = reactions(row, switched)
            runs.setdefault("planner", []).append(row)
            print("planner", json.dumps(row), flush=True)
            run_number = len(runs["planner"])
            decisions += [{"bench_run": run_number, **d} for d in sorted(decided.values(), key=lambda d: d["at"])]
            (RESULTS / f"{out_name}_decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    finally:
        pdctl("down", NAME, env=env, check=False)
    write(
        runs,
        n,
        only,
        out_name,
        args.policy,
        args.planner_start,
        args.min_per_role,
        args.graphs,
        args.interval,
        late,
        args.steps,
    )


def reactions(row: dict, switched: list[dict]) -> dict[str, list[float | None]]:
    """Per shifting trace, per phase: seconds from its first request to the end of the planner's
    first switch toward the phase's bottleneck (prefill for long prompts, decode for long answers;
    a decision is recorded once its switch is done); None when none was made in the phase."""
    out: dict[str, list[float | None]] = {}
    for name, phases in TRACES.items():
        if name not in row or len(phases) != 2:
            continue
        starts = row[name]["phase_starts"]
        ends = [*starts[1:], starts[0] + row[name]["secs"]]
        toward = [("prefill" if prompt > out_tokens else "decode") for _, prompt, out_tokens in phases]
        out[name] = [
            next((d["at"] - start for d in switched if start <= d["at"] < end and d["to_role"] == role), None)
            for start, end, role in zip(starts, ends, toward, strict=True)
        ]
    return out


def figure(run: dict, work: str) -> float:
    """A workload's figure in one run: a step's makespan (lower is better) or a trace's goodput."""
    return run[work]["makespan_s"] if work in STEPS else run[work]["goodput_rps"]


def write(
    runs: dict[str, list[dict]],
    engines: int,
    only: list[str],
    out_name: str,
    policy: str,
    planner_start: str,
    min_per_role: int | None,
    graphs: str,
    interval: float,
    late: list[int],
    steps: int,
) -> None:
    """The median of each configuration's runs per workload, the planner against the best static
    split by median, and each figure's range over the runs."""
    statics = {k: v for k, v in runs.items() if k.startswith("static")}
    planner = runs["planner"]
    med = {
        k: {w: statistics.median(figure(r, w) for r in v) for w in only}
        for k, v in {**statics, "planner": planner}.items()
    }
    best, ratios = {}, {}
    for work in only:
        if work in STEPS:
            best[work] = min(statics, key=lambda k: med[k][work])
            ratios[work] = med[best[work]][work] / med["planner"][work]
        else:
            best[work] = max(statics, key=lambda k: med[k][work])
            ratios[work] = med["planner"][work] / med[best[work]][work]
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "engines": engines,
        "repeats": len(planner),
        "profile": PROFILE,
        "router_policy": policy,
        "planner_start": planner_start,
        "planner_min_per_role": min_per_role,
        "decode_graphs_captured": graphs,
        "planner_interval_secs": interval,
        "late_pairing": {"prefill_room": late[0], "decode_room": late[1]},
        "steps_per_workload": steps,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{out_name}.json").write_text(
        json.dumps({"meta": meta, "runs": runs, "medians": med, "ratios": ratios}, indent=2) + "\n"
    )
    spread = len(planner) > 1

    def cell(name: str, work: str) -> str:
        figures = [figure(r, work) for r in runs[name]]
        text = f"{statistics.median(figures):.2f}"
        return text + (f" ({min(figures):.2f}-{max(figures):.2f})" if spread else "")

    lines = [
        f"{engines} engines ({PROFILE['sim-profile']}, max-running-requests {PROFILE['max-running-requests']}, "
        f"stream-interval {PROFILE['stream-interval']}), router policy {policy}; the planner "
        + ("starts each workload from the even split" if planner_start == "even" else "goes on through the workloads")
        + (
            f", at least {min_per_role} engine(s) per role"
            if min_per_role is not None
            else f", at least {reserve(engines)} engine(s) per role (the planner's default reserve)"
        )
        + (
            "; every prefill captured its decode graphs at up"
            if graphs == "at-up"
            else "; a prefill captures its decode graphs on its first switch to decode"
        )
        + f"; planner interval {interval:g} s"
        + (
            f"; the router pairs late (each prefill holds at most {late[0] or 'any number of'} of its requests, "
            f"each decode {late[1] or 'any number'})"
            if any(late)
            else ""
        )
        + f"; {len(planner)} run(s) per figure"
        + (": the median, then the range" if spread else "")
        + ".",
        "",
        "| configuration | " + " | ".join(TITLES[w] for w in only) + " | failed |",
        "|---|" + "---|" * (len(only) + 1),
    ]
    for name in [*statics, "planner"]:
        failed = sum(r[w]["failed"] for r in runs[name] for w in only if w in TRACES)
        lines.append(f"| {name} | " + " | ".join(cell(name, w) for w in only) + f" | {failed} |")
    said = [
        f"{TITLES[w].split(' (')[0]} {ratios[w]:.2f}x (best static: {best[w]}; goal >= {GOALS[w]}x: "
        f"{'met' if ratios[w] >= GOALS[w] else 'NOT met'})"
        for w in only
    ]
    lines += ["", "Planner against the best static split of each workload (medians): " + "; ".join(said) + "."]
    for k, row in enumerate(planner):
        lines.append(f"Planner switches, run {k + 1}: {', '.join(row.get('switches', [])) or 'none'}.")
        for name, secs in row.get("reactions", {}).items():
            told = ", ".join("none" if s is None else f"{s:.1f} s" for s in secs)
            lines.append(
                f"  {TITLES[name].split(' (')[0]}: the first switch toward each phase's bottleneck was done (drained "
                f"and switched) {told} after the phase's first request (two intervals are {2 * interval:g} s; "
                "a decision needs `sustain` = 2 of them, or one when a whole batch queues per engine, then the drain)."
            )
    for work in only:
        if work in TRACES and len(TRACES[work]) == 2 and len(statics) > 1:
            lines.append(phase_ceiling(statics, work, med["planner"][work]))
        if work in STEPS:
            if steps > 1:
                lines.append(after_first(statics, planner, work, best[work]))
            floor = alone_floor(work, max(1, engines // 4), steps)
            goal = med[best[work]][work] / GOALS[work]
            lines.append(
                f"  {TITLES[work].split(' (')[0]}: no split or planner ends a step before its slowest request would "
                f"alone on an idle engine (the profile's own costs: its KV transfer, every decode step at batch 1, and "
                f"its prefill unless its prompt is shared; the mean over the steps): {floor:.2f} s; nor before its "
                f"work spread over the {engines} engines at the profile's cheapest (each distinct prompt prefilled "
                f"once, every output token in a full decode batch): {work_floor(work, engines, steps):.2f} s; the goal "
                f"asks for {goal:.2f} s."
            )
    if "bare" in runs and "steady" in only:
        bare = statistics.median(r["steady"]["goodput_rps"] for r in runs["bare"])
        beside = med[f"static 1:{engines - 1}"]["steady"] if f"static 1:{engines - 1}" in med else None
        if beside is not None:
            lines.append(
                f"Steady trace on static 1:{engines - 1} with no planner beside it: {bare:.2f} req/s, against "
                f"{beside:.2f} with an advise planner sampling beside it (what sampling costs on this 2-core machine); "
                f"the planner's steady figure against the bare one: {med['planner']['steady'] / bare:.2f}x."
            )
    (RESULTS / f"{out_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def after_first(statics: dict[str, list[dict]], planner: list[dict], work: str, best: str) -> str:
    """The planner against the best static split on the steps after each run's first: what it does
    once it has seen a step of the workload (an RL run's later steps; a planner starts knowing none,
    and its first step is the price of that), beside the first step alone."""

    def mean_of(runs: list[dict], steps: slice) -> float:
        return statistics.median(statistics.fmean(r[work]["steps"][steps]) for r in runs)

    later, first = slice(1, None), slice(0, 1)
    fastest_later = min(statics, key=lambda k: mean_of(statics[k], later))
    return (
        f"  {TITLES[work].split(' (')[0]}, the first step alone: planner {mean_of(planner, first):.2f} s, "
        f"{best} {mean_of(statics[best], first):.2f} s; the steps after the first: planner "
        f"{mean_of(planner, later):.2f} s, the fastest static split on them ({fastest_later}) "
        f"{mean_of(statics[fastest_later], later):.2f} s: "
        f"{mean_of(statics[fastest_later], later) / mean_of(planner, later):.2f}x."
    )


def phases_secs(run: dict) -> tuple[float, float]:
    """A two-phase trace's seconds from its first request to the second phase's first, and from
    there to the end (the second phase's tail included)."""
    first, second = run["phase_starts"]
    return second - first, run["secs"] - (second - first)


def phase_ceiling(statics: dict[str, list[dict]], work: str, planner_goodput: float) -> str:
    """The most any split that changes at the phase turn could gain over the best static one in
    raw requests/s: each phase at its fastest static split, switched at once and for free (the
    medians of each split's phase times), against the fastest static split over the whole
    trace. A bound from the static rows alone, so a planner's figure can be read against it."""
    times = {name: [phases_secs(r[work]) for r in runs] for name, runs in statics.items()}
    med = {name: tuple(statistics.median(t[k] for t in ts) for k in (0, 1)) for name, ts in times.items()}
    fastest = {k: min(med, key=lambda name: med[name][k]) for k in (0, 1)}
    whole = min(med, key=lambda name: sum(med[name]))
    ideal = med[fastest[0]][0] + med[fastest[1]][1]
    return (
        f"  {TITLES[work].split(' (')[0]}: each phase at its fastest static split ({fastest[0]} "
        f"{med[fastest[0]][0]:.1f} s, then {fastest[1]} {med[fastest[1]][1]:.1f} s), switched at once and for "
        f"free, would take {ideal:.1f} s against {whole}'s {sum(med[whole]):.1f} s: at most "
        f"{sum(med[whole]) / ideal:.2f}x in raw requests/s over the fastest static split (the planner's goodput "
        f"{planner_goodput:.2f} req/s)."
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # (Ctrl-C, SIGTERM, SIGHUP) its `finally` took the cluster down
        print("planner benchmark: interrupted; its cluster is down, its results were not written", file=sys.stderr)
        sys.exit(130)
