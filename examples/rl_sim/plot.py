"""Plot the RL example's reward curve: ``python examples/rl_sim/plot.py rewards.jsonl reward.png``.

Needs matplotlib (``pip install matplotlib``); pdctl itself does not.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, out: str) -> None:
    with open(src) as f:
        rows = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, [r["reward"] for r in rows], marker=".", label="mean reward of the step's rollouts")
    for r in rows:
        if "pushed" in r:
            ax.axvline(r["step"], color="0.85", lw=0.8, zorder=0)
    ax.set_xlabel("training step (grey: weight push into every engine)")
    ax.set_ylabel("reward (share of vowels/spaces)")
    ax.set_title("pdctl RL example on the CPU sim")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
