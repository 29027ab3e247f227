"""Run the RL example twice on the same sim fleet, synchronous (refit drain) and asynchronous
(``topologies/rl-sim-async.yaml``: rollouts in flight, refit interrupt), and plot reward against
wall-clock time side by side:

    python examples/rl_sim/compare_async.py examples/rl_sim   # writes async.{jsonl,png}, sync.jsonl

The synchronous run is the same topology with ``--async-rollouts 0`` and ``refit: drain``. Needs
matplotlib for the plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASYNC = ROOT / "topologies" / "rl-sim-async.yaml"


def run(name: str, rollouts: int, refit: str, log: Path) -> None:
    """``pdctl up`` the topology with ``rollouts`` groups in flight and ``refit``, its trainer
    writing ``log``; wait for the trainer to finish; ``pdctl down``."""
    text = (
        ASYNC.read_text()
        .replace("name: rl-sim-async", f"name: {name}")
        .replace('--async-rollouts, "4"]', f'--async-rollouts, "{rollouts}", --log, "{log}"]')
        .replace("refit: interrupt, max_staleness: 2", f"refit: {refit}, max_staleness: 2")
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    pdctl = [sys.executable, "-m", "pdctl"]
    subprocess.run([*pdctl, "up", f.name], check=True)
    try:
        while True:  # the trainer exits when its steps are done
            status = json.loads(
                subprocess.run([*pdctl, "status", name, "--json"], capture_output=True, text=True).stdout
            )
            trainer = [p for p in status["processes"] if p["role"] == "trainer"]
            if trainer and not trainer[0]["alive"]:
                break
            time.sleep(1)
    finally:
        subprocess.run([*pdctl, "down", name], check=True)


def main(out: Path) -> None:
    run("rl-async", 4, "interrupt", out / "async.jsonl")
    run("rl-sync", 0, "drain", out / "sync.jsonl")
    plot(out / "sync.jsonl", out / "async.jsonl", out / "async.png")


def plot(sync: Path, asynchronous: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    for src, label in ((sync, "synchronous, refit drain"), (asynchronous, "asynchronous, refit interrupt")):
        rows = [json.loads(line) for line in src.read_text().splitlines()]
        ax.plot([r["t"] for r in rows], [r["reward"] for r in rows], marker=".", label=f"{label} ({len(rows)} steps)")
    ax.set_xlabel("wall-clock seconds since the trainer's first step")
    ax.set_ylabel("reward (share of vowels/spaces)")
    ax.set_title("pdctl RL example: the same 40 steps, synchronous vs asynchronous")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(os.getcwd()))
