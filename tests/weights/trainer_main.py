"""A trainer process for tests: connects to the engines given on the command line and pushes a
model; with --stall-after N it stops in the middle of the push (after N tensors) and waits to
be killed, having written --marker; with --go FILE it pushes only once FILE exists."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdctl.sim.model import PRESETS, TinyLM
from pdctl.weights import WeightSync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", required=True, help="JSON list of {id, url, gpus}")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router", required=True)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--stall-after", type=int, default=-1)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--refit", default="drain")
    parser.add_argument("--go", type=Path, help="push only once this file exists (after connecting)")
    args = parser.parse_args()
    from dataclasses import replace

    model = TinyLM(replace(PRESETS["tiny"], seed=args.seed))

    def tensors():
        for i, pair in enumerate(model.named_parameters()):
            if i == args.stall_after:
                args.marker.write_text("stalled")
                time.sleep(600)
            yield pair

    sync = WeightSync(
        json.loads(args.engines),
        master_address="127.0.0.1",
        master_port=args.port,
        router_url=args.router,
        bucket_mb=0.01,
        lease_secs=3,
        timeout_secs=60,
        refit=args.refit,
    )
    sync.connect()
    deadline = time.monotonic() + 120  # the test that starts it makes the file, or fails and leaves
    while args.go is not None and not args.go.exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {args.go} within 120 s")
        time.sleep(0.01)
    sync.push(tensors(), version=f"seed{args.seed}")


if __name__ == "__main__":
    main()
