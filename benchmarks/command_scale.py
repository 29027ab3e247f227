"""Every read-only command and `down` against a 1024-node cluster's state whose nodes do not
answer: half take the SSH connection and never speak (a hung host), half refuse it (a host
that is down). All addresses are loopback (127.1.x.y); nothing leaves the machine.

    python benchmarks/command_scale.py [--nodes 1024] [--out benchmarks/results/command_scale.json]

Prints, per command, its wall seconds, exit code, and whether its output names the nodes that
did not answer. The connect bound (pdctl.remote.ssh.CONNECT_TIMEOUT_SECS, 10 s) is the floor
of any command that must ask a hung node.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMANDS = [
    ("status", ["status", "{name}", "--json"]),
    ("endpoints", ["endpoints", "{name}", "--json"]),
    ("top --once", ["top", "{name}", "--once", "--json"]),
    ("weights status", ["weights", "status", "{name}"]),
    ("metrics --targets", ["metrics", "{name}", "--targets"]),
    ("apply --dry-run", ["apply", "{grown}", "--dry-run"]),  # the same file with one decode fewer
    ("down", ["down", "{name}"]),
]


def host_of(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


def topology(n_nodes: int, silent_port: int, refused_port: int, known_hosts: Path) -> dict:
    nodes = []
    for i in range(n_nodes):
        port = silent_port if i % 2 == 0 else refused_port
        ssh = {"port": port, "known_hosts": str(known_hosts)}
        nodes.append({"name": f"n{i}", "host": host_of(i), "gpus": 8, "ssh": ssh})
    pairs = max(1, n_nodes // 2)
    return {
        "name": f"scale{n_nodes}",
        "model": {"path": "/models/m"},
        "nodes": nodes,
        "prefill": {"replicas": pairs * 2, "tp": 4},
        "decode": {"replicas": pairs, "tp": 8},
        "router": {"host": "127.0.0.1", "port": refused_port},
    }


def write_state(home: Path, raw: dict) -> str:
    """A cluster `up` would have recorded (every process started), without starting anything."""
    os.environ["PDCTL_HOME"] = str(home)
    from pdctl.cluster.keys import ClusterKeys, save_keys
    from pdctl.cluster.state import Phase, StateStore
    from pdctl.cluster.up import process_record, starting_state
    from pdctl.plan.planner import make_plan
    from pdctl.topology.load import load_topology_text

    top, _ = load_topology_text(yaml.safe_dump(raw))
    plan = make_plan(top)
    store = StateStore()  # under $PDCTL_HOME
    state = starting_state(top, plan)
    state.status = Phase.UP
    for spec in plan.processes:
        state.processes[spec.id] = process_record(spec, 4_000_000, 4_000_000, 1.0)
    store.save(state)
    save_keys(store, plan.name, ClusterKeys.generate())
    return plan.name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind(("0.0.0.0", 0))  # reached only at 127.1.x.y
    silent.listen(4096)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except TimeoutError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()  # nothing listens there now
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        raw = topology(args.nodes, silent.getsockname()[1], refused_port, home / "known_hosts")
        t0 = time.perf_counter()
        name = write_state(home, raw)
        setup = time.perf_counter() - t0
        env = {**os.environ, "PDCTL_HOME": str(home)}
        grown = home / "grown.yaml"
        grown.write_text(
            yaml.safe_dump({**raw, "decode": {**raw["decode"], "replicas": raw["decode"]["replicas"] - 1}})
        )
        rows = []
        for label, argv in COMMANDS:
            argv = [a.format(name=name, grown=grown) for a in argv]
            started = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "pdctl", *argv], capture_output=True, text=True, env=env, timeout=1200
            )
            secs = time.perf_counter() - started
            text = out.stdout + out.stderr
            named = sum(f"n{i} " in text or f'"n{i}"' in text for i in range(args.nodes))
            traceback = "Traceback" in text
            rows.append(
                {"command": label, "secs": round(secs, 2), "exit": out.returncode, "nodes_named": named,
                 "traceback": traceback}
            )  # fmt: skip
            print(
                f"{label:18} {secs:7.2f} s  exit {out.returncode}  names {named} of {args.nodes} nodes"
                + ("  TRACEBACK" if traceback else "")
            )
            print("   ", (out.stderr.strip().splitlines() or [""])[-1][:200])
        stop.set()
        for conn in held:
            conn.close()
    result = {"nodes": args.nodes, "state_written_secs": round(setup, 2), "rows": rows}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
