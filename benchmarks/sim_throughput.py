"""Sim decode throughput at batch 1 and batch 32: does continuous batching pay? (goal >= 10x)

Runs the sim's real scheduler thread (no HTTP) on one torch thread: B requests, a 32-token
prompt each, 128 greedy tokens with ignore_eos. Decode tokens/s counts the tokens after each
request's first one, over the time from the last first token to the end (prefill excluded);
end-to-end tokens/s (prefill included) is reported beside it. Batch 1 and batch 32 alternate
over several rounds in one process (this machine is noisy); medians are reported.

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
ROUNDS = 9


def tokens_per_sec(engine: Engine, batch: int) -> tuple[float, float]:
    """(decode tokens/s, end-to-end tokens/s) for ``batch`` concurrent requests."""
    done = threading.Semaphore(0)
    first: list[float] = []

    def emit(req: Request) -> None:
        if len(req.output_ids) == 1:
            first.append(time.perf_counter())
        if req.finished:
            done.release()

    opts = SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        engine.submit(Request(rid=f"b{batch}-{i}", input_ids=list(PROMPT), sampling=opts, emit=emit))
    for _ in range(batch):
        done.acquire()
    end = time.perf_counter()
    return batch * (NEW_TOKENS - 1) / (end - max(first)), batch * NEW_TOKENS / (end - start)


def measure(preset: str) -> dict:
    engine = Engine(resolve_model(f"sim://{preset}", "auto", None), max_running=64)
    engine.start()
    try:
        tokens_per_sec(engine, 4)  # warm-up
        runs: dict[int, list[tuple[float, float]]] = {1: [], 32: []}
        for _ in range(ROUNDS):
            for batch in runs:
                runs[batch].append(tokens_per_sec(engine, batch))
    finally:
        engine.stop()
    d1, d32 = (statistics.median(r[0] for r in runs[b]) for b in (1, 32))
    e1, e32 = (statistics.median(r[1] for r in runs[b]) for b in (1, 32))
    return {
        "model": f"sim://{preset}",
        "decode_batch1_tok_s": d1,
        "decode_batch32_tok_s": d32,
        "decode_speedup": d32 / d1,
        "e2e_batch1_tok_s": e1,
        "e2e_batch32_tok_s": e32,
        "e2e_speedup": e32 / e1,
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
    lines = [
        "| model | decode b1 (tok/s) | decode b32 (tok/s) | decode b32/b1 | e2e b1 | e2e b32 | e2e b32/b1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['decode_batch1_tok_s']:.0f} | {r['decode_batch32_tok_s']:.0f} | "
            f"{r['decode_speedup']:.1f}x | {r['e2e_batch1_tok_s']:.0f} | {r['e2e_batch32_tok_s']:.0f} | "
            f"{r['e2e_speedup']:.1f}x |"
        )
    lines.append(f"\nMedian of {ROUNDS} alternating rounds, one torch thread. Goal: decode >= 10x at batch 32.")
    (RESULTS / "sim_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
