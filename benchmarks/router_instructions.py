"""The router's instructions per request, counted by callgrind: an A/B of the Python request path
that this machine's noise cannot move.

Timing A/Bs here move by 20-80% from run to run (the machine's speed drifts with its
neighbours'); an instruction count does not: valgrind's callgrind counts the instructions the
process runs, the same for the same code and inputs whatever else the machine does. It runs
router_inproc.py's request path (pdctl's HTTP server protocol, app, dispatcher and pooled
upstream connections over in-memory transports, in one process) for N and for 3N requests after
the same warm-up, and reports the difference per request, so that start-up is left out. Like
router_inproc.py it leaves out the kernel and the event loop's polling: it prices Python.

    python benchmarks/router_instructions.py [--stream] [--requests 1000]
    python benchmarks/router_instructions.py --baseline REF   # this tree against git REF

Needs valgrind (Debian's package). Each count takes one to three minutes; a run makes two per tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from router_overhead import checkout, remove_checkout

ROOT = Path(__file__).resolve().parent
WORKER = """
import sys, uvloop
sys.path[:0] = [{tree!r}, {tree!r} + "/benchmarks"]
import router_inproc
uvloop.run(router_inproc.measure({stream!r}, {requests!r}))
"""


def count(tree: Path, stream: bool, requests: int) -> int:
    """Instructions callgrind counts for the worker at ``tree`` serving ``requests`` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        code = WORKER.format(tree=str(tree), stream=stream, requests=requests)
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ),
        )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def per_request(tree: Path, stream: bool, requests: int) -> float:
    return (count(tree, stream, 3 * requests) - count(tree, stream, requests)) / (2 * requests)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", action="store_true", help="streamed /generate (8 SSE events)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--baseline", metavar="REF", help="also count the router as of this git ref")
    args = p.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: apt-get install valgrind")
    trees = {"this tree": ROOT.parent}
    tmp = checkout(args.baseline, Path(tempfile.mkdtemp()) / "baseline") if args.baseline else None
    if tmp is not None:
        trees[args.baseline] = tmp
    try:
        got = {name: per_request(tree, args.stream, args.requests) for name, tree in trees.items()}
    finally:
        if tmp is not None:
            remove_checkout(tmp)
    mode = "streamed" if args.stream else "plain"
    for name, value in got.items():
        print(f"{mode} {name}: {value / 1000:.1f}K instructions per request")
    if args.baseline:
        print(f"{mode} this tree / {args.baseline}: {got['this tree'] / got[args.baseline]:.3f}x")


if __name__ == "__main__":
    main()
