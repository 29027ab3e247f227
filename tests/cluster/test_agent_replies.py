"""What the node agent sends is what pdctl.node.replies declares (the types mypy checks both
sides against): every required key present, nothing undeclared. Real commands, through the
real agent process (LocalExecutor runs ``python -m pdctl.node.agent``)."""

from __future__ import annotations

import sys
import time
from typing import Any

from pdctl.node import replies as r
from pdctl.remote import agent_api
from pdctl.remote.local import LocalExecutor
from pdctl.topology.model import Node


def conforms(reply: Any, kind: type) -> None:
    keys = set(reply)
    required, optional = kind.__required_keys__, kind.__optional_keys__  # type: ignore[attr-defined]
    assert required <= keys, (kind.__name__, required - keys)
    assert keys <= required | optional, (kind.__name__, keys - required - optional)


def test_each_reply_has_the_declared_keys(tmp_path) -> None:
    ex = LocalExecutor(Node(name="me", host="127.0.0.1", gpus=0, python=sys.executable))
    conforms(agent_api.preflight(ex, [1], check_gpus=True), r.PreflightReply)
    log = tmp_path / "p.log"
    proc = {"id": "p", "argv": [sys.executable, "-c", "import time; time.sleep(30)"], "env": {},
            "cwd": str(tmp_path), "log_path": str(log)}  # fmt: skip
    spawned = agent_api.spawn(ex, [proc])
    conforms(spawned, r.SpawnReply)
    started = spawned["started"]["p"]
    conforms(started, r.Started)
    try:
        ident = {"id": "p", "pid": started["pid"], "create_time": started["create_time"]}
        status = agent_api.status(ex, [ident])
        conforms(status, r.StatusReply)
        conforms(status["processes"]["p"], r.ProcessState)
        ready = agent_api.wait_ready(ex, [{**ident, "url": "http://127.0.0.1:1/"}], [], 0.3)
        conforms(ready, r.WaitReadyReply)
        assert ready["ready"] is False and ready["failed"] == "p"
        conforms(agent_api.read_tail(ex, str(log), 5), r.ReadReply)
        conforms(agent_api.read_from(ex, str(log), 0), r.ReadReply)
        conforms(agent_api.read_tail(ex, str(tmp_path / "missing.log"), 5), r.ReadReply)
    finally:
        stopped = agent_api.stop(ex, [{"pid": started["pid"], "pgid": started["pgid"],
                                       "create_time": started["create_time"]}], run_id=None, grace_secs=5)  # fmt: skip
    conforms(stopped, r.StopReply)
    assert stopped["left"] == []
    time.sleep(0.1)
    conforms(agent_api.rm(ex, [str(tmp_path / "nothing")]), r.RmReply)


def test_a_key_file_is_written_only_where_no_other_user_could_swap_the_path(tmp_path) -> None:
    """The agent writes an engine's --config (its key) 0600 and says so in ``configured``; under a
    directory every user may write (no sticky bit) it starts nothing and says why."""
    import os
    import stat

    import pytest

    from pdctl.errors import RemoteError

    ex = LocalExecutor(Node(name="me", host="127.0.0.1", gpus=0, python=sys.executable))
    private = tmp_path / "private"
    proc = {"id": "e", "argv": [sys.executable, "-c", "import sys; print(sys.argv)"], "env": {},
            "cwd": str(private), "log_path": str(private / "logs" / "e.log"), "config": {"api-key": "k3y"}}  # fmt: skip
    spawned = agent_api.spawn(ex, [proc])
    assert spawned["configured"] == ["e"]
    key_file = private / "logs" / "e.config.yaml"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and "k3y" in key_file.read_text()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, not sticky: another user could rename logs/ under it
    with pytest.raises(RemoteError, match="writable by every user: an engine's key is not written under it"):
        agent_api.spawn(ex, [{**proc, "cwd": str(shared), "log_path": str(shared / "run" / "logs" / "e.log")}])
    assert not list(shared.rglob("*.config.yaml")) and not list(shared.rglob("*.log"))


def test_a_supervisor_still_finishing_reports_the_code_it_wrote(tmp_path) -> None:
    """Between writing its final exit code and exiting, a supervisor is alive: status says the
    process is done, with that code (up once read a trainer done with 0 as dead with none)."""
    import json
    import os

    import psutil

    from pdctl.node import agent

    exit_file = tmp_path / "trainer.log.exit"
    story = {"state": "exited", "restart": "never", "pid": None, "create_time": None, "restarts": 0}
    exit_file.write_text(json.dumps({**story, "last_exit": None, "reason": None, "exit_code": 0}))
    me = {"id": "t", "pid": os.getpid(), "create_time": psutil.Process().create_time(), "exit_file": str(exit_file)}
    entry = agent.status({"processes": [me]})["processes"]["t"]
    assert entry["alive"] is False and entry.get("exit_code") == 0, entry


def test_status_asks_an_engines_health_and_info_side_by_side(tmp_path) -> None:
    """An engine whose /health answers only once its /model_info has been asked (a server that holds
    the one until the other comes): asked one after the other, health waited out its timeout first and
    an engine that answers both was reported unhealthy, each status call paying two timeouts for a
    hung one."""
    import http.server
    import threading

    asked_info = threading.Event()

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/model_info":
                asked_info.set()
                body = b'{"model_path": "sim://tiny"}'
            else:
                asked_info.wait(30)
                body = b"{}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ex = LocalExecutor(Node(name="me", host="127.0.0.1", gpus=0, python=sys.executable))
    log = tmp_path / "p.log"
    proc = {"id": "p", "argv": [sys.executable, "-c", "import time; time.sleep(30)"], "env": {},
            "cwd": str(tmp_path), "log_path": str(log)}  # fmt: skip
    started = agent_api.spawn(ex, [proc])["started"]["p"]
    try:
        ident = {"id": "p", "pid": started["pid"], "create_time": started["create_time"],
                 "health_url": url + "/health", "info_url": url + "/model_info"}  # fmt: skip
        entry = agent_api.status(ex, [ident])["processes"]["p"]
        assert entry["healthy"] is True and entry["info"] == {"model_path": "sim://tiny"}, entry
    finally:
        agent_api.stop(ex, [{"pid": started["pid"], "pgid": started["pgid"], "create_time": started["create_time"]}],
                       run_id=None, grace_secs=5)  # fmt: skip
        server.shutdown()
