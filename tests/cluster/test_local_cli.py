"""The CLI end to end on localhost nodes (no SSH): up, requests, status, logs, down, down again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

from tests.helpers import engine_auth, eventually, free_port_base, get, local_topology, pdctl, post


def test_local_cli_round_trip(tmp_path) -> None:
    topo = local_topology(tmp_path, "loc", free_port_base(), router={"policy": "cache_aware"})
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    # piped: one plain line per event, no redrawn table whose border runs into the next line
    assert not re.search(r"[┘┛╯]\S", up.stderr + up.stdout), up.stderr
    assert "prefill-0: healthy" in up.stderr and ".py:" not in up.stderr  # no pdctl source file names
    url = next(line.split()[-1] for line in up.stdout.splitlines() if line.startswith("router:"))
    try:
        code, out = post(url + "/generate", {"text": "cli", "sampling_params": {"max_new_tokens": 4}})
        assert code == 200 and out["meta_info"]["completion_tokens"] == 4
        st = pdctl("status", "--json", env=env)
        assert st.returncode == 0 and json.loads(st.stdout)["ok"] is True
        check_engine_keys_stay_off_command_lines(json.loads(st.stdout), tmp_path / "home", "loc", tmp_path / "runs")
        narrow = pdctl("status", env={**env, "COLUMNS": "80"})  # fits 80 columns (a table, or one block per
        lines = narrow.stdout.splitlines()  # process when the table would not fit), ids whole, plan order
        assert narrow.returncode == 0 and all(len(line) <= 80 for line in lines), narrow.stdout
        assert "…" not in narrow.stdout and ("ports: " in narrow.stdout or "│ http=" in narrow.stdout), narrow.stdout
        firsts = [line.strip("│ ").split()[0] for line in lines if line.strip("│ ").split()]
        assert firsts.index("prefill-0") < firsts.index("decode-0") < firsts.index("router"), narrow.stdout
        piped = pdctl("status", env={k: v for k, v in env.items() if k != "COLUMNS"})  # piped, no $COLUMNS
        assert "│ default " in piped.stdout and "│ http=" in piped.stdout, piped.stdout  # whole, not folded at 80
        again = pdctl("up", topo, env=env)
        assert again.returncode == 1 and "already up" in again.stderr and "Traceback" not in again.stderr
        log = pdctl("logs", "loc", "prefill-0", "-n", "5", env=env)
        assert log.returncode == 0 and "ready to roll" in log.stdout
        assert pdctl("logs", "nope-proc", env=env).returncode == 1
        bad = pdctl("logs", "loc", "prefill-0", "-n", "-3", env=env)
        assert bad.returncode == 2 and "-3 is not in the range" in bad.stderr
    finally:
        down = pdctl("down", env=env)
    assert down.returncode == 0 and "is down" in down.stdout
    assert "already down" in pdctl("down", "loc", env=env).stdout
    stopped = pdctl("status", "loc", env=env)
    assert stopped.returncode == 1 and "cluster 'loc' is down: no processes" in stopped.stdout
    assert "┏" not in stopped.stdout  # a sentence, not an empty table
    purge = pdctl("down", "loc", "--purge", env=env)
    assert purge.returncode == 0 and not (tmp_path / "runs" / "loc").exists()
    gone = pdctl("down", "loc", env=env)  # purged: no such cluster any more, which is not a success
    assert gone.returncode == 1 and "no cluster 'loc'" in gone.stderr and "nothing was stopped" in gone.stderr


def check_engine_keys_stay_off_command_lines(status: dict, home: Path, name: str, workdir: Path) -> None:
    """Each engine holds the cluster's engine key (it refuses a request without it) while no
    command line on the machine shows the key (any user of a node can read them), and the
    --config file that carries it is its owner's alone."""
    auth = engine_auth(name, home)
    key = auth["Authorization"].removeprefix("Bearer ")
    lines = []
    for proc in psutil.process_iter(["cmdline"]):
        lines.append(" ".join(proc.info["cmdline"] or []))
    assert not [line for line in lines if key in line], "the engine key shows in a command line"
    engines = [p for p in status["processes"] if p["role"] in ("prefill", "decode")]
    assert len(engines) == 2, status
    for engine in engines:
        body = {"text": "k", "sampling_params": {"max_new_tokens": 1}, "bootstrap_room": 1}
        code, _ = post(engine["url"] + "/generate", body)
        assert code == 401, (engine["id"], code)
        code, _ = get(engine["url"] + "/server_info", headers=auth)
        assert code == 200, engine["id"]
        (config,) = workdir.rglob(f"{engine['id']}.config.yaml")
        assert config.stat().st_mode & 0o777 == 0o600, oct(config.stat().st_mode)


def test_ctrl_c_during_up_stops_everything(tmp_path) -> None:
    import signal

    # the decode's warm-up prompt takes 60 s: up is still waiting when Ctrl-C comes
    slow = {"args": {"sim-prefill-ms-per-token": 60000}}
    topo = local_topology(tmp_path, "slow", free_port_base(), decode=slow)
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "up", topo],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it, whatever this suite inherited: a shell's background job
        # (``cmd &`` in a script) ignores SIGINT, and Python then leaves it ignored in its children.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    state_path = tmp_path / "home" / "slow" / "state.json"

    def started() -> dict:
        return json.loads(state_path.read_text())["processes"] if state_path.exists() else {}

    # prefill, decode and router launched
    eventually(lambda: len(started()) >= 3, 60, interval=0.1, what="three processes launched")
    pids = [p["pid"] for p in started().values()]
    assert len(pids) == 3, pids
    proc.send_signal(signal.SIGINT)
    # an impatient second Ctrl-C while up stops what it started: ignored, the cleanup finishes
    eventually(
        lambda: proc.poll() is not None or json.loads(state_path.read_text())["status"] == "failed",
        60,
        interval=0.01,
        what="up stopping what it started",
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "interrupted; everything that started was stopped" in err, err
    assert "Traceback" not in err
    import psutil

    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"pid {pid} survived"
    assert json.loads(state_path.read_text())["status"] == "down"


def test_logs_follow_sees_new_lines(tmp_path) -> None:
    from pdctl.cluster import ClusterState, StateStore, logs
    from pdctl.plan import LaunchSpec, Plan
    from pdctl.roles import Role

    log = tmp_path / "runs" / "p.log"
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\nthree\n")
    store = StateStore(tmp_path / "home")
    node = {
        "name": "me",
        "host": "127.0.0.1",
        "gpus": 1,
        "python": sys.executable,
        "workdir": str(tmp_path),
        "env": {},
        "ssh": {},
    }
    store.save(
        ClusterState(
            name="f",
            run_id="r",
            status="up",
            nodes=[node],
            plan=Plan(
                processes=(
                    LaunchSpec(
                        id="p",
                        role=Role.DECODE,
                        node="me",
                        host="127.0.0.1",
                        argv=(),
                        env={},
                        cwd=str(tmp_path),
                        log_path=str(log),
                    ),
                )
            ),
        )
    )
    polls = []

    def stop() -> bool:
        polls.append(1)
        if len(polls) == 2:
            with log.open("a") as f:
                f.write("four\n")
        return len(polls) > 4

    chunks = list(logs("f", "p", lines=2, follow=True, store=store, poll_secs=0.05, stop=stop))
    assert chunks[0].strip().splitlines() == ["two", "three"]
    assert "".join(chunks[1:]) == "four\n"


NULL_ENGINES = {"prefill": {"args": {"sim-null": True}}, "decode": {"args": {"sim-null": True}}}
"""Engines for tests whose subject is the trainer or the lifecycle, not the model: no torch to import."""


def test_up_fails_when_the_trainer_exits_with_an_error_and_status_shows_exit_codes(tmp_path) -> None:
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    base = free_port_base()
    # startup_secs 120, not the default 10: beside other jobs torchrun's own start has taken more
    # than 10 s, and up rightly called a trainer that had not failed yet ready (CI, 2026-11-29).
    crash = {
        "command": ["python", "-c", "import sys; print('trainer boom'); sys.exit(3)"],
        "nproc_per_node": 1,
        "startup_secs": 120,
    }
    topo = local_topology(
        tmp_path,
        "crash",
        base,
        trainer=crash,
        **NULL_ENGINES,
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 3, "workdir": str(tmp_path / "runs")}],
    )
    up = pdctl("up", topo, env=env)
    if up.returncode == 0:  # the check failed: leave nothing running behind it
        pdctl("down", "crash", env=env)
    assert up.returncode == 1 and "exited with code" in up.stderr and "trainer" in up.stderr, up.stderr
    # pdctl's own message comes first (no traceback of pdctl's); the trainer's log tail shows the cause.
    assert "trainer.me did not become ready: it exited with code 1 within 120s of its start" in up.stderr, up.stderr
    assert "trainer boom" in up.stderr
    # Everything that started was stopped: nothing of the cluster is alive.
    st = pdctl("status", "crash", "--json", env=env)
    assert all(not p["alive"] for p in json.loads(st.stdout)["processes"]) if st.stdout.strip() else True
    # A trainer that fails 4 s after its start (past the 3 s window up once had): still within
    # trainer.startup_secs, so up fails and stops everything. (60 here, not the default 10: beside
    # other jobs torchrun's own start took the rest of 10 s, and up rightly called it ready.)
    late = {
        "command": ["python", "-c", "import sys, time; time.sleep(4); sys.exit(3)"],
        "nproc_per_node": 1,
        "startup_secs": 60,
    }
    topo = local_topology(
        tmp_path,
        "late",
        base + 40,
        trainer=late,
        **NULL_ENGINES,
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 3, "workdir": str(tmp_path / "runs")}],
    )
    up = pdctl("up", topo, env=env)
    if up.returncode == 0:
        pdctl("down", "late", env=env)
    assert up.returncode == 1 and "within 60s of its start (trainer.startup_secs)" in up.stderr, up.stderr
    # A trainer that finishes cleanly: up succeeds; status shows its exit code.
    done = {"command": ["python", "-c", "print('trained')"], "nproc_per_node": 1}
    topo = local_topology(
        tmp_path,
        "done",
        base + 20,
        trainer=done,
        **NULL_ENGINES,
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 3, "workdir": str(tmp_path / "runs")}],
    )
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:

        def ended() -> dict | None:
            procs = json.loads(pdctl("status", "done", "--json", env=env).stdout)["processes"]
            trainer = next(p for p in procs if p["role"] == "trainer")
            return None if trainer["alive"] else trainer

        trainer = eventually(ended, 30, interval=0.5, what="the trainer's exit")
        assert trainer["alive"] is False and trainer["exit_code"] == 0, trainer
        table = pdctl("status", "done", env=env)
        assert "exited 0" in table.stdout and "trainer completed" in table.stdout
        assert table.returncode == 0, "a finished run is not a failure"
        assert json.loads(pdctl("status", "done", "--json", env=env).stdout)["completed"] is True
    finally:
        pdctl("down", "done", env=env)


def test_one_home_from_any_directory_and_logs_per_run(tmp_path) -> None:
    """State and logs live under ~/.pdctl whatever the working directory; a stopped cluster's
    state does not make NAME necessary; each run starts its own log; a refused up leaves nothing."""
    home, here, there = tmp_path / "user", tmp_path / "here", tmp_path / "there"
    for d in (home, here, there):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PDCTL_HOME"}
    env["HOME"] = str(home)
    node = [{"name": "me", "host": "127.0.0.1", "gpus": 2}]  # default workdir: ~/.pdctl/runs
    base = free_port_base()
    # null engines: what is checked is where state and logs live (the sim ready line: test_local_cli_round_trip)
    one = local_topology(tmp_path, "one", base, nodes=node, **NULL_ENGINES)
    two = local_topology(tmp_path, "two", base + 20, nodes=node, **NULL_ENGINES)

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdctl", *args], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=180)  # fmt: skip

    assert run("up", one, cwd=here).returncode == 0
    assert (home / ".pdctl" / "one" / "state.json").exists() and not (here / ".pdctl").exists()
    assert "cluster 'one' is down" in run("down", cwd=there).stdout  # found from another directory
    assert run("up", two, cwd=here).returncode == 0
    try:
        summary = run("status", cwd=there)
        assert summary.returncode == 0 and "one" in summary.stdout and "3/3" in summary.stdout, summary.stdout
        # 'one' is stopped, 'two' is the only live cluster: logs and down need no NAME
        log = run("logs", "prefill-0", cwd=there)
        assert log.returncode == 0 and "pdctl.sim.null (prefill) on http://" in log.stdout, log.stderr
        unknown = run("logs", "nctest", cwd=there)
        assert unknown.returncode == 1 and "'nctest' is neither a cluster" in unknown.stderr
        # a refused up (its ports are taken by 'two') leaves no state, lock or directory behind
        clash = local_topology(tmp_path, "clash", base + 20, nodes=node, **NULL_ENGINES)
        refused = run("up", clash, cwd=here)
        assert refused.returncode == 1 and "preflight failed" in refused.stderr
        assert not (home / ".pdctl" / "clash").exists()
    finally:
        assert "cluster 'two' is down" in run("down", cwd=there).stdout
    # a second run of 'one' starts its own log; the previous one is kept beside it
    assert run("up", one, cwd=there).returncode == 0
    try:
        log = run("logs", "one", "prefill-0", "-n", "1000", cwd=here).stdout
        assert log.count("=== pdctl") == 1, log
        assert (home / ".pdctl" / "runs" / "one" / "logs" / "prefill-0.log.1").exists()
    finally:
        run("down", "one", cwd=here)
