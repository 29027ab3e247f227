"""Sim decode throughput at batch 1 and batch 32: does continuous batching pay? (goal >= 10x)

Runs the sim's real scheduler thread (no HTTP) on one torch thread: B requests, a 32-token
prompt each, 128 greedy tokens with ignore_eos. Batch 1 and batch 32 alternate over several
rounds in one process (this machine is noisy); the median of each is reported.

    python benchmarks/sim_throughput.py   # writes benchmarks/results/sim_throughput.{json,md}
"""

from __future__ import annotations

import json
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from pdctl.sim.engine import Engine, Request
from pdctl.sim.model import resolve_model
from pdctl.sim.sampling import SamplingOptions

RESULTS = Path(__file__).parent / "results"
PROMPT = list(range(40, 72))
NEW_TOKENS = 128
ROUNDS = 5


def tokens_per_sec(engine: Engine, batch: int) -> float:
    done = threading.Semaphore(0)

    def emit(req: Request) -> None:
        if req.finished:
            done.release()

    opts = SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        engine.submit(Request(rid=f"b{batch}-{i}", input_ids=list(PROMPT), sampling=opts, emit=emit))
    for _ in range(batch):
        done.acquire()
    return batch * NEW_TOKENS / (time.perf_counter() - start)


def measure(preset: str) -> dict:
    engine = Engine(resolve_model(f"sim://{preset}", "auto", None), max_running=64)
    engine.start()
    try:
        tokens_per_sec(engine, 4)  # warm-up
        runs: dict[int, list[float]] = {1: [], 32: []}
        for _ in range(ROUNDS):
            for batch in runs:
                runs[batch].append(tokens_per_sec(engine, batch))
    finally:
        engine.stop()
    b1, b32 = statistics.median(runs[1]), statistics.median(runs[32])
    return {
        "model": f"sim://{preset}",
        "batch1_tok_s": b1,
        "batch32_tok_s": b32,
        "speedup": b32 / b1,
        "runs": {str(k): v for k, v in runs.items()},
    }


def main() -> None:
    torch.set_num_threads(1)
    rows = [measure("tiny"), measure("small")]
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": 1,
        "rounds": ROUNDS,
        "new_tokens": NEW_TOKENS,
        "prompt_tokens": len(PROMPT),
    }
    (RESULTS / "sim_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["| model | batch 1 (tok/s) | batch 32 (tok/s) | batch 32 / batch 1 |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch1_tok_s']:.0f} | {r['batch32_tok_s']:.0f} | {r['speedup']:.1f}x |")
    lines.append(f"\nMedian of {ROUNDS} alternating rounds, one torch thread. Goal: >= 10x at batch 32.")
    (RESULTS / "sim_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
