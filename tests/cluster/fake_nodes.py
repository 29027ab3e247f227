"""In-memory nodes for the cluster code: ``FakeExecutor`` answers the node agent's commands from
a ``FakeNode`` (a process table), so up/down/status rules run in milliseconds with no process,
SSH or port. The agent's replies are built to ``pdctl.node.replies``' types and go through
``Executor.agent``'s own JSON parsing and error handling, as real replies do.

A test scripts a node: ports already taken, processes that die right after they start (with an
exit code) or never become healthy, a command that fails, a node that cannot be reached.
The real agent's behaviour is tested separately (tests/cluster/test_agent_replies.py,
test_local_cli.py, test_lifecycle_ssh.py); these fakes test the cluster code's decisions.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from pdctl.cluster.nodes import NodeSet
from pdctl.errors import RemoteError
from pdctl.node.replies import (
    PreflightReply,
    ReadReply,
    RmReply,
    SpawnReply,
    StatusReply,
    StopReply,
    WaitReadyReply,
)
from pdctl.remote.base import Executor
from pdctl.topology.model import Node

_pids = itertools.count(1000)


@dataclass
class FakeProcess:
    id: str
    pid: int
    argv: list[str]
    env: dict[str, str]
    log_path: str
    alive: bool = True
    exit_code: int | None = None


@dataclass
class FakeNode:
    name: str
    busy_ports: dict[int, str] = field(default_factory=dict)  # port -> owner's name
    dies_at_start: dict[str, int] = field(default_factory=dict)  # process id -> exit code
    never_ready: set[str] = field(default_factory=set)
    failing: dict[str, str] = field(default_factory=dict)  # agent command -> its error
    unreachable: bool = False
    old_agent: bool = False  # a pdctl from before key files: it starts engines without them
    interrupt_on: str | None = None  # an agent command during which the user presses Ctrl-C
    processes: dict[str, FakeProcess] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def alive(self) -> list[str]:
        return sorted(p.id for p in self.processes.values() if p.alive)

    def answer(self, command: str, request: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(command)
        if self.interrupt_on == command:
            raise KeyboardInterrupt
        if command in self.failing:
            return {"error": self.failing[command]}
        handler = getattr(self, command.replace("-", "_"))
        return dict(handler(request))

    def preflight(self, req: dict[str, Any]) -> PreflightReply:
        busy = [{"port": p, "pid": 4242, "name": owner} for p, owner in self.busy_ports.items() if p in req["ports"]]
        return {
            "python": "/usr/bin/python3",
            "pdctl": "test",
            "sglang": False,
            "torch": True,
            "busy_ports": busy,
            "ephemeral_range": [32768, 60999],
        }

    def spawn(self, req: dict[str, Any]) -> SpawnReply:
        started = {}
        for spec in req["processes"]:
            proc = FakeProcess(spec["id"], next(_pids), spec["argv"], spec["env"], spec["log_path"])
            if spec["id"] in self.dies_at_start:
                proc.alive, proc.exit_code = False, self.dies_at_start[spec["id"]]
            self.processes[proc.id] = proc
            started[proc.id] = {"pid": proc.pid, "pgid": proc.pid, "create_time": 1.0}
        if self.old_agent:
            return {"started": started}
        return {"started": started, "configured": [spec["id"] for spec in req["processes"] if spec.get("config")]}

    def wait_ready(self, req: dict[str, Any]) -> WaitReadyReply:
        for target in [*req["watch"], *req["targets"]]:
            if not self._by_pid(target["pid"]).alive:
                return {"ready": False, "ready_ids": [], "died": target["id"], "reason": "process exited"}
        ready = [t["id"] for t in req["targets"] if t["id"] not in self.never_ready]
        pending = sorted(t["id"] for t in req["targets"] if t["id"] in self.never_ready)
        if pending:
            reason = f"not healthy after {req['timeout_secs']}s"
            return {"ready": False, "ready_ids": ready, "failed": pending[0], "reason": reason}
        return {"ready": True, "ready_ids": ready}

    def status(self, req: dict[str, Any]) -> StatusReply:
        out: dict[str, Any] = {}
        for entry in req["processes"]:
            proc = self._by_pid(entry["pid"])
            out[entry["id"]] = {"alive": proc.alive}
            if not proc.alive and entry.get("exit_file"):
                out[entry["id"]]["exit_code"] = proc.exit_code
        return {"processes": out}

    def stop(self, req: dict[str, Any]) -> StopReply:
        victims = [self._by_pid(p["pid"]) for p in req["processes"]]
        if req.get("run_id"):  # the sweep: everything tagged with the run id
            victims += [p for p in self.processes.values() if p.env.get("PDCTL_RUN_ID") == req["run_id"]]
        terminated = 0
        for proc in victims:
            if proc.alive:
                proc.alive, terminated = False, terminated + 1
        return {"terminated": terminated, "killed": 0, "left": []}

    def read(self, req: dict[str, Any]) -> ReadReply:
        proc = next((p for p in self.processes.values() if p.log_path == req["path"]), None)
        text = f"log of {proc.id}: Traceback ... RuntimeError: boom\n" if proc else ""
        return {"size": len(text), "data": text}

    def rm(self, req: dict[str, Any]) -> RmReply:
        return {"removed": list(req["paths"])}

    def _by_pid(self, pid: int) -> FakeProcess:
        return next(p for p in self.processes.values() if p.pid == pid)


class FakeExecutor(Executor):
    """An Executor whose node is a FakeNode."""

    def __init__(self, node: Node, fake: FakeNode):
        super().__init__(node)
        self.fake = fake

    def _run(self, argv: list[str], stdin: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        if self.fake.unreachable:
            raise RemoteError(f"node {self.node.name}: cannot connect to {self.node.host}:22: timed out")
        reply = self.fake.answer(argv[-1], json.loads(stdin))
        return (1 if "error" in reply else 0), json.dumps(reply).encode(), b""


class FakeCluster:
    """One FakeNode per node name; ``nodes(top_nodes)`` is a NodeSet over them."""

    def __init__(self, *names: str):
        self.fakes = {name: FakeNode(name) for name in names}

    def __getitem__(self, name: str) -> FakeNode:
        return self.fakes[name]

    def nodes(self, nodes: list[Node]) -> NodeSet:
        return NodeSet(nodes, factory=lambda node: FakeExecutor(node, self.fakes[node.name]))

    def alive(self) -> dict[str, list[str]]:
        return {name: fake.alive() for name, fake in self.fakes.items() if fake.alive()}

    def spawned(self) -> bool:
        return any("spawn" in fake.calls for fake in self.fakes.values())
