"""validate + plan wall time and plan size for 1 to 4096 nodes of 8 GPUs (goals: < 1 s at 1024
nodes; the plan's JSON bytes per engine flat as the fleet grows, i.e. the plan linear in it).

Each size: per 2 nodes, two TP-4 prefills and one TP-8 decode, so every GPU is used. Best of 3
runs (1 at 4096), all sizes in one process.

    python benchmarks/plan_scale.py   # writes benchmarks/results/plan_scale.{json,md}
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import yaml

from pdctl.plan import make_plan
from pdctl.topology import load_topology_text

RESULTS = Path(__file__).parent / "results"


def topology_text(n_nodes: int) -> str:
    nodes = [{"name": f"n{i}", "host": f"10.{i // 250}.{i % 250}.1", "gpus": 8} for i in range(n_nodes)]
    pairs = max(1, n_nodes // 2)
    data = {
        "name": f"scale{n_nodes}",
        "model": {"path": "/models/m"},
        "nodes": nodes,
        "prefill": {"replicas": pairs * 2 if n_nodes > 1 else 1, "tp": 4},
        "decode": {"replicas": pairs if n_nodes > 1 else 1, "tp": 8 if n_nodes > 1 else 4},
        "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
    }
    return yaml.safe_dump(data)


def measure(n_nodes: int, repeats: int = 3) -> dict:
    text = topology_text(n_nodes)
    best = {"load_validate_s": float("inf"), "plan_s": float("inf")}
    processes = plan_bytes = engines = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        top, _ = load_topology_text(text)
        t1 = time.perf_counter()
        plan = make_plan(top)
        t2 = time.perf_counter()
        best["load_validate_s"] = min(best["load_validate_s"], t1 - t0)
        best["plan_s"] = min(best["plan_s"], t2 - t1)
        processes, engines = len(plan.processes), len(plan.engines)
        plan_bytes = len(json.dumps(plan.to_dict()))
    total = best["load_validate_s"] + best["plan_s"]
    return {
        "nodes": n_nodes,
        "gpus": n_nodes * 8,
        "processes": processes,
        **best,
        "total_s": total,
        "plan_bytes": plan_bytes,
        "bytes_per_engine": round(plan_bytes / engines),
    }


def main() -> None:
    rows = [measure(n, 1 if n > 1024 else 3) for n in (1, 64, 256, 1024, 4096)]
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    (RESULTS / "plan_scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "| nodes | GPUs | processes | load+validate (s) | plan (s) | total (s) | plan JSON | bytes/engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['gpus']} | {r['processes']} | {r['load_validate_s']:.3f} | "
            f"{r['plan_s']:.3f} | {r['total_s']:.3f} | {r['plan_bytes'] / 1e6:.1f} MB | {r['bytes_per_engine']} |"
        )
    at_1024 = next(r for r in rows if r["nodes"] == 1024)
    per_engine = [r["bytes_per_engine"] for r in rows if r["nodes"] >= 64]
    flat = max(per_engine) <= 1.1 * min(per_engine)
    lines.append(f"\nGoal: total < 1 s at 1024 nodes: {'met' if at_1024['total_s'] < 1 else 'NOT met'}.")
    lines.append(f"Goal: bytes per engine flat (within 10%) from 64 to 4096 nodes: {'met' if flat else 'NOT met'}.")
    (RESULTS / "plan_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
