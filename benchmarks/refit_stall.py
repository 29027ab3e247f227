"""What a weight update costs the requests around it, refit ``drain`` against ``interrupt``, side by
side in one run (pdctl.refit).

Fleet: a prefill sim and a decode sim (latency model: DECODE_MS per batched decode step) behind
pdctl's router. For each rollout length, ROLLOUTS streamed greedy rollouts of that many tokens are
started; once the decode runs them all, a ``Fleet.load_from_disk`` transaction (the update) runs in
one mode, and LATE short requests arrive while it runs (sent once the router says it is held).
Measured per update: its wall time (hold to release), its transfer time (the load itself), the
longest gap between two events any stream saw, the TTFT of the late requests, and failed requests (a
non-200, an error event, or a stream without every token). Modes alternate order per repetition.

The update loads a checkpoint of MODEL_MB (256) MiB from disk into both engines: the sim's tiny
model (2 layers, hidden 64) whose position table is grown to that size, while the engines serve
only CONTEXT positions, so that a decode step costs what the tiny model's does and the update moves
the full size (the transfer: reading and copying 256 MiB into each engine's weights).

Goals (the refit issue): in interrupt mode the update's wall time <= transfer + 0.3 s and flat in
rollout length (drain grows with it); stream gaps and late TTFT <= the update's wall time + 0.3 s;
0 failed requests.

    python benchmarks/refit_stall.py   # writes benchmarks/results/refit_stall.{json,md,png}
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdctl.sim.model import save_checkpoint
from pdctl.weights.fleet import Fleet

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
LENGTHS = [int(x) for x in os.environ.get("REFIT_BENCH_LENGTHS", "100,400,1600").split(",")]
REPS = int(os.environ.get("REFIT_BENCH_REPS", 2))
ROLLOUTS = 8
LATE = 4
DECODE_MS = float(os.environ.get("REFIT_BENCH_DECODE_MS", 5))
MODES = ["drain", "interrupt"]
MODEL_MB = int(os.environ.get("REFIT_BENCH_MB", 256))
CONTEXT = 4096


def model_of(seed: int):
    """The tiny sim model with its position table grown so that the whole is MODEL_MB MiB."""
    from dataclasses import replace

    from pdctl.sim.model import PRESETS, TinyLM

    base = replace(PRESETS["tiny"], seed=seed, context_length=CONTEXT)
    rest = sum(p.numel() * 8 for n, p in TinyLM(base).named_parameters() if "embed_positions" not in n)
    positions = (MODEL_MB * 2**20 - rest) // (8 * base.hidden)
    return TinyLM(replace(base, max_positions=max(CONTEXT, positions)))


def start(argv: list[str], log: Path, port_flag: str = "--port-file") -> tuple[subprocess.Popen, dict]:
    """Start a server on port 0; the ports it bound, from the port file it writes."""
    ports = log.with_suffix(".ports")
    proc = subprocess.Popen(
        [*argv, port_flag, str(ports)], stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    sys.path.insert(0, str(ROOT.parent))
    from tests.helpers import bound_ports  # the tests' reader of a server's port file

    return proc, bound_ports(ports, proc, log)


def wait_ok(url: str) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)


def post(url: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode()}


def stream(url: str, body: dict) -> dict:
    """One streamed request: event arrival times, the final event, and whether it failed."""
    sent = time.monotonic()
    times: list[float] = []
    final: dict | None = None
    failed = None
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.strip()
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
                    data = json.loads(line[6:])
                    if "error" in data:
                        failed = str(data["error"])
                    else:
                        final = data
    except OSError as exc:
        failed = str(exc)
    wanted = body["sampling_params"]["max_new_tokens"]
    if failed is None and (final is None or len(final["output_ids"]) != wanted):
        failed = f"{len(final['output_ids']) if final else 0} of {wanted} tokens"
    return {"sent": sent, "times": times, "final": final, "failed": failed}


def held(router: str) -> bool:
    with urllib.request.urlopen(router + "/pdctl/weights", timeout=10) as r:
        return bool(json.loads(r.read())["held"])


def running(url: str) -> int:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        return sum(s.get("num_running_reqs", 0) for s in json.loads(r.read())["internal_states"])


def one_update(router: str, engines: list[str], decode: str, length: int, mode: str, ckpt: Path, version: str) -> dict:
    body = {"text": "a rollout", "sampling_params": {"max_new_tokens": length, "temperature": 0, "ignore_eos": True}}
    body["stream"] = True
    late_body = {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 16}}
    with cf.ThreadPoolExecutor(ROLLOUTS + LATE) as pool:
        rollouts = [pool.submit(stream, router + "/generate", body) for _ in range(ROLLOUTS)]
        while running(decode) < ROLLOUTS:
            time.sleep(0.01)
        time.sleep(length * DECODE_MS / 1000 / 4)  # a quarter into the rollouts
        fleet = Fleet(engines, router_url=router, refit=mode)
        box: dict = {}
        began = time.monotonic()
        updater = threading.Thread(target=lambda: box.update(report=fleet.load_from_disk(str(ckpt), version)))
        updater.start()
        while not held(router):  # late requests arrive once the update holds the router
            time.sleep(0.002)
        late = [pool.submit(stream, router + "/generate", late_body) for _ in range(LATE)]
        updater.join()
        ended = time.monotonic()
        fleet.close()
        done = [f.result() for f in rollouts]
        late_done = [f.result() for f in late]
    report = box["report"]
    gaps = [b - a for s in done for a, b in zip(s["times"], s["times"][1:], strict=False)]
    ttft = [s["times"][0] - s["sent"] for s in late_done if s["times"]]
    failed = [s["failed"] for s in done + late_done if s["failed"]]
    interrupted = sum(
        1 for s in done if s["final"] and len(s["final"]["meta_info"].get("weight_version_spans") or []) > 1
    )
    return {
        "length": length,
        "mode": mode,
        "update_wall_s": ended - began,
        "transfer_s": report.phases.get("transfer", 0.0),
        "max_stream_gap_s": max(gaps) if gaps else 0.0,
        "late_ttft_max_s": max(ttft) if ttft else None,
        "late_ttft_median_s": statistics.median(ttft) if ttft else None,
        "failed": len(failed),
        "failures": failed[:3],
        "interrupted_rollouts": interrupted,
    }


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="refit-bench-"))
    ckpts = {}
    for name, seed in (("a", 0), ("b", 9)):
        save_checkpoint(model_of(seed), tmp / name)
        ckpts[name] = tmp / name
    model_mib = (tmp / "a" / "model.safetensors").stat().st_size / 2**20
    print(f"checkpoints of {model_mib:.0f} MiB", flush=True)
    sim = [PY, "-m", "pdctl.sim", "--host", "127.0.0.1", "--port", "0", "--model-path", str(ckpts["a"])]
    procs = []
    try:
        p_proc, p_ports = start(
            [*sim, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
            tmp / "p.log",
            "--sim-port-file",
        )
        procs.append(p_proc)
        p_port, bootstrap = p_ports["port"], p_ports["bootstrap_port"]
        d_proc, d_ports = start(
            [*sim, "--disaggregation-mode", "decode", "--sim-decode-ms-per-step", str(DECODE_MS)],
            tmp / "d.log",
            "--sim-port-file",
        )
        procs.append(d_proc)
        d_port = d_ports["port"]
        prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        wait_ok(prefill + "/health")
        wait_ok(decode + "/health")
        r_proc, r_ports = start(
            [PY, "-m", "pdctl", "router", "--host", "127.0.0.1", "--port", "0", "--pd-disaggregation",
             "--prefill", prefill, str(bootstrap), "--decode", decode, "--health-check-interval-secs", "1"],
            tmp / "r.log",
        )  # fmt: skip
        procs.append(r_proc)
        router = f"http://127.0.0.1:{r_ports['port']}"
        wait_ok(router + "/readiness")
        rows = []
        n = 0
        for rep in range(REPS):
            for length in LENGTHS:
                for mode in MODES if rep % 2 == 0 else reversed(MODES):
                    n += 1
                    ckpt = ckpts["b" if n % 2 else "a"]
                    row = one_update(router, [prefill, decode], decode, length, mode, ckpt, f"v{n}")
                    row["rep"] = rep
                    row["model_mib"] = round(model_mib)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    write(rows)


def write(rows: list[dict]) -> None:
    summary = []
    for length in LENGTHS:
        for mode in MODES:
            mine = [r for r in rows if r["length"] == length and r["mode"] == mode]
            med = {
                k: statistics.median(r[k] for r in mine) for k in ("update_wall_s", "transfer_s", "max_stream_gap_s")
            }
            ttft = [r["late_ttft_max_s"] for r in mine if r["late_ttft_max_s"] is not None]
            summary.append(
                {
                    "length": length,
                    "mode": mode,
                    **med,
                    "late_ttft_max_s": statistics.median(ttft) if ttft else None,
                    "failed": sum(r["failed"] for r in mine),
                    "interrupted_rollouts": sum(r["interrupted_rollouts"] for r in mine),
                    "updates": len(mine),
                }
            )
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rollouts": ROLLOUTS,
        "late_requests": LATE,
        "decode_ms_per_step": DECODE_MS,
        "reps": REPS,
        "update_mib": MODEL_MB,
    }
    (RESULTS / "refit_stall.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2))
    lines = [
        f"# refit stall: drain vs interrupt ({meta['machine']}; {ROLLOUTS} streamed rollouts + {LATE} late requests "
        f"per update; decode {DECODE_MS:g} ms/step; an update loads {MODEL_MB} MiB into each of 2 engines; medians of "
        f"{REPS} updates)",
        "",
        "| rollout tokens | mode | update wall (s) | transfer (s) | wall - transfer (s) | longest stream gap (s) "
        "| late TTFT, max (s) | failed | interrupted rollouts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        ttft = "-" if s["late_ttft_max_s"] is None else f"{s['late_ttft_max_s']:.3f}"
        lines.append(
            f"| {s['length']} | {s['mode']} | {s['update_wall_s']:.3f} | {s['transfer_s']:.3f} | "
            f"{s['update_wall_s'] - s['transfer_s']:.3f} | {s['max_stream_gap_s']:.3f} | {ttft} | {s['failed']} | "
            f"{s['interrupted_rollouts']}/{ROLLOUTS * s['updates']} |"
        )
    (RESULTS / "refit_stall.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("drain", "o"), ("interrupt", "s")):
        mine = [s for s in summary if s["mode"] == mode]
        xs = [s["length"] for s in mine]
        axes[0].plot(xs, [s["update_wall_s"] for s in mine], marker=marker, label=mode)
        axes[1].plot(xs, [s["late_ttft_max_s"] or 0 for s in mine], marker=marker, label=mode)
    for ax, title in zip(axes, ("update wall time (s)", "TTFT of requests arriving during it (s)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("rollout length in flight (tokens)")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "refit_stall.png", dpi=110)


if __name__ == "__main__":
    main()
