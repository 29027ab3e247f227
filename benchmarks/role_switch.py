"""A live role switch against a restart of the same engine (issue 52), side by side in one run on
one local sim cluster (2 prefills, 2 decodes, `role_switch: true`), driven through the CLI.

Per round: `pdctl switch` of prefill-1 to decode and back (two switches), and `pdctl restart` of
prefill-0 (cordon, drain, stop, start, back in rotation); each command's wall time. The restart's
time includes the engine process's own start (python, torch import, a tiny model; a real GPU
engine adds its model load, minutes for a large model, which a switch never pays); the switch's
includes the drain, SGLang's call and the router's re-registration. Goal: switch <= 0.2x restart.

    python benchmarks/role_switch.py   # writes benchmarks/results/role_switch.{json,md}
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
ROUNDS = int(os.environ.get("ROLE_SWITCH_BENCH_ROUNDS", 5))


def pdctl(*args: str, env: dict) -> float:
    start = time.monotonic()
    res = subprocess.run([PY, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - start
    if res.returncode != 0:
        raise RuntimeError(f"pdctl {' '.join(args)}: {res.stderr[-2000:]}")
    return took


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-switch-bench-"))
    env = {**os.environ, "PDCTL_HOME": str(tmp / "home")}
    topo = tmp / "sw.yaml"
    switchable = {"replicas": 2, "role_switch": True}
    topo.write_text(
        yaml.safe_dump(
            {
                "name": "swb",
                "model": {"path": "sim://tiny"},
                "engine": "sim",
                "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 4, "workdir": str(tmp / "runs")}],
                "ports": {"base": int(os.environ.get("ROLE_SWITCH_BENCH_PORT", 24600))},
                "prefill": switchable,
                "decode": dict(switchable),
            }
        )
    )
    pdctl("up", str(topo), env=env)
    switches, restarts, cli = [], [], []
    try:
        for _ in range(ROUNDS):
            # the CLI's own start: python, click and the cluster commands' imports (switch's and restart's)
            cli.append(pdctl("switch", "--help", env=env))
            switches.append(pdctl("switch", "swb", "prefill-1", "decode", env=env))
            switches.append(pdctl("switch", "swb", "decode-2", "prefill", env=env))
            restarts.append(pdctl("restart", "swb", "prefill-0", env=env))
    finally:
        subprocess.run([PY, "-m", "pdctl", "down", "swb"], env=env, capture_output=True, timeout=300)
    switch_s, restart_s, cli_s = statistics.median(switches), statistics.median(restarts), statistics.median(cli)
    bare = (switch_s - cli_s) / (restart_s - cli_s)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rounds": ROUNDS,
        "switch_secs": switches,
        "restart_secs": restarts,
        "switch_median_secs": round(switch_s, 3),
        "restart_median_secs": round(restart_s, 3),
        "ratio": round(switch_s / restart_s, 3),
        "cli_start_secs": cli,
        "cli_start_median_secs": round(cli_s, 3),
        "ratio_without_cli_start": round(bare, 3),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "role_switch.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "role_switch.md").write_text(
        f"# role switch vs restart ({result['machine']}; sim engines; medians of {2 * ROUNDS} switches and "
        f"{ROUNDS} restarts, one run)\n\n"
        "| command | median wall time (s) |\n|---|---|\n"
        f"| `pdctl switch` (drain, /pd_role_switch, re-register) | {switch_s:.2f} |\n"
        f"| `pdctl restart` of the same kind of engine (drain, stop, start, back) | {restart_s:.2f} |\n"
        f"| switch / restart | {switch_s / restart_s:.2f}x (goal <= 0.2x) |\n"
        f"| the CLI's own start (`pdctl switch --help`: python and the cluster commands' imports) | {cli_s:.2f} |\n"
        f"| switch / restart, the CLI's start taken from both | {bare:.2f}x |\n\n"
        "Both include the drain and the CLI's own start (python, loading the state). The restart also "
        "includes the sim engine's process start (python, torch import, a tiny model); a GPU engine's "
        "restart adds its model load and CUDA graph capture (tens of seconds to minutes for a large model), "
        "which a switch does not pay (a first switch to decode captures decode graphs: seconds).\n"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
