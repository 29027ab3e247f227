"""A framework's weight update through the router's SGLang facade, side by side with
``pdctl.weights``' own push of the same bytes to the same fleet (the facade issue's goals).

Fleet: weight_push.py's (sims prefill tp 1, prefill tp 1, decode tp 2 behind pdctl's router;
float64 tensors of a real model's layer shapes, 256 MiB and 1 GiB). Each round times, back to
back so that the machine's drift hits all of them: one bare gloo broadcast per tensor of the
same model in a standing group (the floor of both), a ``pdctl.weights`` push (``names`` format,
one broadcast per tensor, as gloo pushes go), and a framework's update as AReaL sends it through
the router: ``/pause_generation``, per bucket ``/update_weights_from_distributed`` beside rank 0's
broadcasts (one bucket in flight), ``/continue_generation``. Both use 1 GiB buckets (pdctl's and
AReaL's default) and every transaction phase (hold, pause, begin, end, version, verify on the
sims, continue, release).

Figures: push / facade wall time of the whole update, the median of per-round ratios (goal
>= 0.95x: the facade costs no more than 5% over pdctl's own push); the facade's own time per
update, everything but the broadcast (the router's phases outside the transfer, from its push
record; and the update's wall minus the bare broadcast of the round), goal <= 50 ms.

    python benchmarks/facade.py   # writes benchmarks/results/facade.{json,md}
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import free_port
from weight_push import ENGINES, BareGroup, Fleet, config_for, quartiles

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
ROUNDS = int(os.environ.get("FACADE_BENCH_ROUNDS", 8))
SIZES_MB = [int(s) for s in os.environ.get("FACADE_BENCH_SIZES_MB", "256,1024").split(",")]
BUCKET_BYTES = 1024 * 2**20
GROUP = "facade_bench"


def post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        raw = answer.read()
    return json.loads(raw) if raw else {}


class FrameworkTrainer:
    """Rank 0 of a group the router's fleet joins, sending AReaL's calls."""

    def __init__(self, router: str, world: int):
        from pdctl.sglang.group import init_custom_process_group

        self.router = router
        self.pool = cf.ThreadPoolExecutor(2)
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": str(port),
            "rank_offset": 1,
            "world_size": world,
            "backend": "gloo",
            "group_name": GROUP,
        }
        joined = self.pool.submit(post, router + "/init_weights_update_group", body)
        self.group = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            world_size=world,
            rank=0,
            group_name=GROUP,
            timeout_secs=600,
        )
        joined.result()

    def update(self, tensors: list) -> float:
        """One update (pause, buckets, continue); its wall time."""
        import torch.distributed as dist

        started = time.perf_counter()
        post(self.router + "/pause_generation", {})
        buckets, bucket, size = [], [], 0
        for name, t in tensors:
            if bucket and size + t.numel() * t.element_size() > BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        buckets.append(bucket)
        for bucket in buckets:
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).split("torch.")[1] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": GROUP,
                "abort_all_requests": True,
            }
            answer = self.pool.submit(post, self.router + "/update_weights_from_distributed", body)
            works = [dist.broadcast(t.detach(), src=0, group=self.group, async_op=True) for _, t in bucket]
            for w in works:
                w.wait()
            if not answer.result().get("success"):
                raise RuntimeError(f"update failed: {answer.result()}")
        post(self.router + "/continue_generation", {})
        return time.perf_counter() - started

    def close(self) -> None:
        from pdctl.sglang.group import destroy_group

        destroy_group(self.group)
        post(self.router + "/destroy_weights_update_group", {"group_name": GROUP})
        self.pool.shutdown()


def last_push(router: str) -> dict:
    with urllib.request.urlopen(router + "/pdctl/weights", timeout=30) as answer:
        return json.loads(answer.read())["last_push"]


def measure(megabytes: int, tmp: Path) -> dict:
    from pdctl.sim.model import TinyLM
    from pdctl.weights import WeightSync

    config = config_for(megabytes)
    model_dir = tmp / f"model-{megabytes}"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(asdict(config)))
    tensors = list(TinyLM(config).named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    world = 1 + sum(tp for _, tp in ENGINES)
    fleet = Fleet(tmp, model_dir)
    rounds = []
    try:
        sync = WeightSync(
            fleet.engines,
            master_address="127.0.0.1",
            master_port=free_port(),
            backend="gloo",
            router_url=fleet.router_url,
            timeout_secs=600,
            load_format="names",
            bucket_mb=BUCKET_BYTES // 2**20,
        )
        sync.connect()
        framework = FrameworkTrainer(fleet.router_url, world)
        try:
            sync.push(tensors, version=f"warm-{megabytes}")  # both first touch the trainer's and engines' buffers
            framework.update(tensors)
            with BareGroup(megabytes) as bare:
                for r in range(ROUNDS):
                    bare_secs = bare.seconds("per_tensor")
                    order = ("push", "facade") if r % 2 == 0 else ("facade", "push")  # neither always goes first
                    row: dict = {"bare_per_tensor_seconds": bare_secs}
                    for which in order:
                        if which == "push":
                            report = sync.push(tensors, version=f"push-{megabytes}-{r}")
                            row["push_seconds"] = report.seconds
                            row["push_phases"] = dict(report.phases)
                        else:
                            row["facade_seconds"] = framework.update(tensors)
                            row["facade_phases"] = dict(last_push(fleet.router_url)["phases"])
                    rounds.append(row)
                    print(
                        f"  {megabytes} MB round {r}: bare {bare_secs:.2f}s push {row['push_seconds']:.2f}s "
                        f"facade {row['facade_seconds']:.2f}s",
                        flush=True,
                    )
        finally:
            framework.close()
            sync.close()
    finally:
        fleet.stop()
    ratios = [row["push_seconds"] / row["facade_seconds"] for row in rounds]
    own_phases = [sum(v for k, v in row["facade_phases"].items() if k != "transfer") for row in rounds]
    beyond_bare = [row["facade_seconds"] - row["bare_per_tensor_seconds"] for row in rounds]
    push_beyond_bare = [row["push_seconds"] - row["bare_per_tensor_seconds"] for row in rounds]
    return {
        "megabytes": megabytes,
        "bytes": nbytes,
        "tensors": len(tensors),
        "rounds": rounds,
        "push_seconds": statistics.median(row["push_seconds"] for row in rounds),
        "facade_seconds": statistics.median(row["facade_seconds"] for row in rounds),
        "bare_per_tensor_seconds": statistics.median(row["bare_per_tensor_seconds"] for row in rounds),
        "push_over_facade": statistics.median(ratios),
        "push_over_facade_quartiles": quartiles(ratios),
        "facade_own_phases_seconds": statistics.median(own_phases),
        "facade_beyond_bare_seconds": statistics.median(beyond_bare),
        "push_beyond_bare_seconds": statistics.median(push_beyond_bare),
        "facade_phases": {
            k: statistics.median(row["facade_phases"].get(k, 0.0) for row in rounds) for k in rounds[0]["facade_phases"]
        },
    }


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-facade-bench-"))
    results = []
    try:
        for mb in SIZES_MB:
            (tmp / str(mb)).mkdir()
            results.append(measure(mb, tmp / str(mb)))
    finally:
        if not os.environ.get("FACADE_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    meta = {
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "rounds": ROUNDS,
        "bucket_mb": BUCKET_BYTES // 2**20,
        "engines": ENGINES,
        "commit": commit.strip(),
    }
    (RESULTS / "facade.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        "# The SGLang facade: a framework's update through the router vs pdctl.weights' push",
        "",
        f"{meta['cpus']} CPUs, Python {meta['python']}, commit {meta['commit']}, {ROUNDS} rounds per size; "
        f"sims {', '.join(f'{r} tp {t}' for r, t in ENGINES)} over gloo on loopback; 1 GiB buckets. "
        "Each round: a bare broadcast per tensor, then the push and the framework update in alternating order.",
        "",
        "| size | bare per tensor | push | facade | push / facade (median, quartiles) "
        "| facade's own phases | facade - bare | push - bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        q1, q3 = r["push_over_facade_quartiles"]
        lines.append(
            f"| {r['megabytes']} MiB | {r['bare_per_tensor_seconds']:.3f} s | {r['push_seconds']:.3f} s "
            f"| {r['facade_seconds']:.3f} s | **{r['push_over_facade']:.3f}x** ({q1:.3f}-{q3:.3f}) "
            f"| {r['facade_own_phases_seconds'] * 1000:.0f} ms | {r['facade_beyond_bare_seconds'] * 1000:.0f} ms "
            f"| {r['push_beyond_bare_seconds'] * 1000:.0f} ms |"
        )
    lines += [
        "",
        "Goals: push / facade >= 0.95x (the facade costs at most 5% over pdctl's own push); the facade's own "
        "time per update, everything but the broadcast, <= 50 ms. \"facade's own phases\": the router's "
        'pause, begin, end, verify, version and continue (its push record); "facade - bare": the update\'s '
        "wall time beyond the bare broadcast of its round (the extra HTTP hop per bucket included).",
        "",
        "Median phases of the framework update (s): "
        + "; ".join(
            f"{r['megabytes']} MiB: " + ", ".join(f"{k} {v:.3f}" for k, v in r["facade_phases"].items())
            for r in results
        ),
    ]
    (RESULTS / "facade.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
