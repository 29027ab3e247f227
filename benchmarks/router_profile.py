"""Where the router's CPU goes per request: py-spy samples pdctl's router under the load of
router_overhead.py (null backends, closed loop at concurrency 64, plain or streamed /generate).

    pip install py-spy   # not a project dependency: a sampling profiler, run by hand
    python benchmarks/router_profile.py [--stream] [--duration 10]
        # writes benchmarks/results/router_profile_{plain,streamed}.md

Reported: the functions with the most samples on the stack (inclusive) and at its top (self),
as shares of the router's busy samples (idle samples are not taken). Sampling shows shares,
not absolute costs: read it beside router_overhead's CPU per request.

    python benchmarks/router_profile.py --native
        # writes benchmarks/results/router_profile_native_{plain,streamed}.md

``--native`` samples with Linux perf instead (``perf record -e cpu-clock``, kernel included, needs
kernel.perf_event_paranoid <= 1) and splits the router's CPU by what runs: the interpreter, the
kernel, uvloop, httptools, the C library.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from router_overhead import (
    OTHER_CPUS,
    PY,
    RESULTS,
    ROOT,
    ROUTER_CPUS,
    STREAM_TOKENS,
    free_port,
    start,
    wait,
)

TOP = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", action="store_true", help="streamed /generate requests")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--native", action="store_true", help="perf, by shared object (kernel included)")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if args.native:
        spy = shutil.which("perf") or sys.exit("perf not found (Debian: linux-perf)")
    elif not Path(spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    prefill_port, boot_port, decode_port, router_port = free_port(), free_port(), free_port(), free_port()
    null = [PY, "-m", "pdctl.sim.null", "--stream-tokens", str(STREAM_TOKENS)]
    procs = [
        start([*null, "--port", str(prefill_port), "--role", "prefill", "--bootstrap-port", str(boot_port)]),
        start([*null, "--port", str(decode_port), "--role", "decode"]),
    ]
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    try:
        wait(prefill + "/health")
        wait(decode + "/health")
        pd_args = ["--prefill", prefill, str(boot_port), "--decode", decode, "--policy", "round_robin"]
        pd_args += ["--log-level", "error"]
        router = start(
            [PY, "-m", "pdctl", "router", "--port", str(router_port), "--pd-disaggregation", *pd_args],
            ROUTER_CPUS,
        )
        procs.append(router)
        url = f"http://127.0.0.1:{router_port}/generate"
        wait(f"http://127.0.0.1:{router_port}/health")
        loadgen = [PY, str(ROOT / "loadgen.py"), url, "--concurrency", "64", *(["--stream"] if args.stream else [])]
        subprocess.run([*loadgen, "--duration", "2"], capture_output=True, check=True)  # warm-up
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "profile.txt"
            if args.native:
                record = [spy, "record", "-e", "cpu-clock", "-F", "2000", "-p", str(router.pid), "-o", str(raw)]
                record += ["--", "sleep", str(args.duration)]
            else:
                spy_args = ["--duration", str(int(args.duration)), "--output", str(raw), "--nonblocking"]
                record = [spy, "record", "--pid", str(router.pid), "--rate", "1000", "--format", "raw", *spy_args]
            spy_proc = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            out = subprocess.run(
                [*loadgen, "--duration", str(args.duration)],
                capture_output=True,
                text=True,
                check=True,
                preexec_fn=lambda: __import__("os").sched_setaffinity(0, OTHER_CPUS),
            )
            spy_proc.wait(timeout=args.duration + 60)
            if args.native:
                report = [spy, "report", "-i", str(raw), "--stdio", "--no-children", "--sort", "dso", "-g", "none"]
                stacks = subprocess.run(report, capture_output=True, text=True, check=True).stdout.splitlines()
            else:
                stacks = raw.read_text().splitlines()
            if os.environ.get("PROFILE_RAW"):  # the raw stacks, for a closer look by line
                shutil.copy(raw, os.environ["PROFILE_RAW"])
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
    mode = "streamed" if args.stream else "plain"
    RESULTS.mkdir(exist_ok=True)
    if args.native:
        report = summarize_native(stacks, mode, json.loads(out.stdout))
        (RESULTS / f"router_profile_native_{mode}.md").write_text(report)
    else:
        report = summarize(stacks, mode, json.loads(out.stdout))
        (RESULTS / f"router_profile_{mode}.md").write_text(report)
    print(report)


_PARTS = (  # what runs, and how its shared object shows in perf's report (file names, no paths)
    ("the kernel (sockets, scheduling)", "[kernel"),
    ("the Python interpreter (libpython)", "libpython"),
    ("uvloop (event loop, transports)", "loop.cpython"),
    ("httptools (HTTP parsing)", "parser.cpython"),
    ("asyncio's C futures and tasks", "_asyncio"),
    ("orjson", "orjson"),
    ("the C library (malloc, memcpy)", "libc.so"),
)


def summarize_native(report: list[str], mode: str, load: dict) -> str:
    """perf's ``--sort dso`` lines (``  61.80%  libpython3.11.so.1.0``) as shares by part."""
    shares: dict[str, float] = {}
    for line in report:
        share, _, dso = line.strip().partition("%")
        if not dso or line.lstrip().startswith("#"):
            continue
        part = next((name for name, marker in _PARTS if marker in dso), "other")
        shares[part] = shares.get(part, 0.0) + float(share)
    lines = [
        f"# pdctl router, native profile: {mode} PD /generate, concurrency 64",
        "",
        f"{load['requests']} requests in {load['seconds']:.1f} s ({load['rps']:.0f} req/s) while sampled "
        "(perf record -e cpu-clock at 2 kHz on the router's process: kernel time included, idle not sampled).",
        "",
        "| share of the router's CPU | what runs |",
        "|---|---|",
        *(f"| {share:.1f}% | {part} |" for part, share in sorted(shares.items(), key=lambda kv: -kv[1])),
    ]
    return "\n".join(lines) + "\n"


def summarize(stacks: list[str], mode: str, load: dict) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in stacks:
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [_name(f) for f in stack.split(";")[1:]]  # the first frame is the process/thread
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    lines = [
        f"# pdctl router profile: {mode} PD /generate, concurrency 64",
        "",
        f"{load['requests']} requests in {load['seconds']:.1f} s ({load['rps']:.0f} req/s) while sampled; "
        f"{total} busy samples at 1 kHz (py-spy, no native frames: time in C is its Python caller's).",
        "",
        "## Inclusive (on the stack), the router's own functions",
        "",
        "| share | function |",
        "|---|---|",
        *[f"| {n / total:.1%} | `{name}` |" for name, n in inclusive.most_common() if "(router/" in name][:TOP],
        "",
        "## Self (top of the stack)",
        "",
        "`Runner.run` is the event loop itself (uvloop, in C): polling, reading sockets (the kernel's",
        "share of a read counts here), waking tasks. A write's system call counts in its caller.",
        "",
        "| share | function |",
        "|---|---|",
        *(f"| {n / total:.1%} | `{name}` |" for name, n in own.most_common(TOP)),
    ]
    return "\n".join(lines) + "\n"


def _name(frame: str) -> str:
    """``function (path/to/module.py:LINE)`` -> ``function (module.py)``."""
    func, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{func} ({short})"


if __name__ == "__main__":
    main()
