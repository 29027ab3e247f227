"""The node agent: ``python -m pdctl.node.agent COMMAND`` runs on a node (over SSH or locally).

It is the only code that touches node processes, so local and SSH nodes behave the same.
Input is JSON on stdin (environment values can be secret: they never go on a command
line); output is one JSON object on stdout. Imports stay light (no torch) so it starts fast.

Commands:
    preflight   python/pdctl/sglang importable, GPUs visible, which planned ports are busy (and by whom)
    spawn       start processes, each in its own session under pdctl.node.supervise (restarts by policy),
                stdout+stderr to its log file; an engine's secret flags (its key) go in a 0600
                SGLang --config file beside the log, never on its command line
    wait-ready  poll local health URLs until 200, failing fast when a process dies
    status      which recorded processes are alive; HTTP probes of local URLs
    stop        SIGTERM whole process groups (and tagged escapees), wait, SIGKILL, verify
    read        a log file's bytes from an offset (for `pdctl logs` and `-f`)
    rm          remove a run directory (`down --purge`)
    retarget    the command a supervised process restarts with from now on (an engine's PD role switch)
    mps-start   make sure a CUDA MPS control daemon serves a pipe directory (pdctl.node.mps)
    mps-stop    stop one that this cluster started (quit, then force)
    mps-status  whether it still runs
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from pdctl.jsonhttp import call_json, exchange
from pdctl.node.proc import expand, recorded_start, redact, same_process, start_time, wait_gone
from pdctl.node.replies import (
    PreflightReply,
    ProcessState,
    ReadReply,
    RetargetReply,
    RmReply,
    SpawnReply,
    Started,
    StatusReply,
    StopReply,
    WaitReadyReply,
)
from pdctl.node.supervise import command_file, peers_file

RUN_ID_ENV = "PDCTL_RUN_ID"
PATH_VALUED_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
"""Variables whose value is a path under the run directory: expanded here, as cwd and log paths are."""


class AgentFailure(Exception):
    """A command's clear reason for failing, reported as is (no exception type in front)."""


def preflight(req: dict[str, Any]) -> PreflightReply:
    import importlib.util

    from pdctl import __version__

    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        ephemeral: list[int] | None = [int(low), int(high)]
    except OSError:
        ephemeral = None
    out: PreflightReply = {
        "python": sys.executable,
        "pdctl": __version__,
        "sglang": importlib.util.find_spec("sglang") is not None,
        "torch": importlib.util.find_spec("torch") is not None,
        "busy_ports": [],
        "ephemeral_range": ephemeral,
    }
    if req.get("check_gpus"):
        out["gpus"] = _visible_gpus()
    owners = _listeners()
    host = req.get("host", "0.0.0.0")
    for port in req.get("ports", []):
        if port in owners or not _can_bind(host, port):
            out["busy_ports"].append({"port": port, **owners.get(port, {"pid": None, "name": "unknown"})})
    return out


def _visible_gpus() -> int:
    try:
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return len([line for line in res.stdout.splitlines() if line.startswith("GPU ")])
    except (OSError, subprocess.TimeoutExpired):
        return 0


def _listeners() -> dict[int, dict[str, Any]]:
    owners: dict[int, dict[str, Any]] = {}
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return owners
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr:
            info: dict[str, Any] = {"pid": c.pid, "name": None, "cmdline": None}
            if c.pid:
                try:
                    p = psutil.Process(c.pid)
                    info.update(name=p.name(), cmdline=" ".join(redact(p.cmdline()))[:200])
                except psutil.Error:
                    pass
            owners.setdefault(c.laddr.port, info)
    return owners


def _can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too, so a port with only TIME_WAIT leftovers is free for them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def _check_private(directory: Path) -> None:
    """Refuse to put a secret in ``directory`` unless only this user (or root) could have put or
    swapped anything on its path: every directory from it up to / is owned by this user or
    root, and none is writable by others unless sticky (as /tmp is). Else another user of the
    node who can rename a directory above it could read the key, or hand the engine flags."""
    me = os.getuid()
    for part in [directory.resolve(), *directory.resolve().parents]:
        st = os.stat(part)
        if st.st_uid not in (me, 0):
            raise AgentFailure(f"{part} belongs to uid {st.st_uid}: an engine's key is not written under it")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise AgentFailure(f"{part} is writable by every user: an engine's key is not written under it")


def _write_config(path: Path, flags: dict[str, Any]) -> Path:
    """``flags`` as an SGLang ``--config`` file at ``path``, mode 0600 from its first byte (JSON
    is YAML). Replaced whole on each start: a file left by an earlier run is not trusted."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as out:
        json.dump(flags, out)
    return path


def _command(proc: dict[str, Any], log_path: Path) -> list[str]:
    """A process's command line; an engine's key goes in a ``--config`` file its owner alone
    reads, not in argv for all to see."""
    argv = list(proc["argv"])
    if proc.get("config"):
        argv += ["--config", str(_write_config(log_path.parent / f"{proc['id']}.config.yaml", proc["config"]))]
    return argv


def retarget(req: dict[str, Any]) -> RetargetReply:
    """The command a running supervised process restarts with from now on (its PD role switched
    live: a restart must come back in the new role, pdctl.node.supervise). Written 0600, replaced
    atomically; the running process is not touched."""
    proc = req["process"]
    exit_file = expand(proc["exit_file"])
    argv = _command(proc, Path(expand(proc["log_path"])))
    path = Path(command_file(exit_file))
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w") as out:
        json.dump(argv, out)
    tmp.replace(path)
    return {"written": str(path)}


def spawn(req: dict[str, Any]) -> SpawnReply:
    """Start each process in a new session; return pid, pgid and create_time per id."""
    started: dict[str, Started] = {}
    configured: list[str] = []
    for proc in req["processes"]:  # before anything starts: a refused key file leaves nothing behind
        log_dir = Path(expand(proc["log_path"])).parent
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_dir.chmod(0o700)  # logs hold prompts and errors (and key files): their owner's only
        if proc.get("config"):
            _check_private(log_dir)
    for proc in req["processes"]:
        cwd = expand(proc["cwd"])
        log_path = Path(expand(proc["log_path"]))
        Path(cwd).mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {**os.environ, **proc["env"]}
        for key in PATH_VALUED_ENV:  # the planner writes the run directory as the node spells it (~/...)
            if key in env:
                env[key] = expand(env[key])
        argv = _command(proc, log_path)
        if proc.get("config"):
            configured.append(proc["id"])
        if proc.get("exit_file"):  # supervised: restarted by its policy, its story kept (pdctl.node.supervise)
            exit_file = expand(proc["exit_file"])
            Path(exit_file).unlink(missing_ok=True)
            Path(command_file(exit_file)).unlink(missing_ok=True)  # a command kept by an earlier run's switch
            restart = proc.get("restart") or "never"
            watch: list[str] = []
            liveness = proc.get("liveness")
            if isinstance(liveness, dict) and liveness.get("url") and liveness.get("timeout_secs"):
                watch = ["--liveness", str(liveness["url"]), str(float(liveness["timeout_secs"]))]
            if proc.get("peer_weights"):
                watch += ["--peers", str(_write_config(Path(peers_file(exit_file)), proc["peer_weights"]))]
            argv = [sys.executable, "-m", "pdctl.node.supervise", exit_file, "--restart", restart, *watch, "--", *argv]
        if log_path.exists():  # each run its own log; the previous one stays as PROC.log.1
            log_path.replace(log_path.with_name(log_path.name + ".1"))
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb", buffering=0) as log:
            log.write(f"=== pdctl {time.strftime('%Y-%m-%d %H:%M:%S')} {proc['id']}: start ===\n".encode())
            child = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        started[proc["id"]] = {
            "pid": child.pid,
            "pgid": child.pid,
            "create_time": start_time(psutil.Process(child.pid)),
        }
    return {"started": started, "configured": configured}


def wait_ready(req: dict[str, Any]) -> WaitReadyReply:
    """Poll each target {id, url, pid, create_time} until 200, and check that each ``watch``
    process {id, pid, create_time} lives, until every target is ready, one of them all dies
    (``died``), or the deadline passes. ``ready_ids``: the targets that became ready.

    It also ends when its caller is gone (it was re-parented: a ``pdctl up`` killed, its SSH
    session closed), so that a killed ``up`` leaves no agent polling on the node for the rest of
    its timeout."""
    deadline = time.monotonic() + float(req["timeout_secs"])
    pending = {t["id"]: t for t in req["targets"]}
    watch = req.get("watch", [])
    ready: list[str] = []
    caller = os.getppid()
    while True:
        if _caller_gone(caller):
            return {"ready": False, "ready_ids": ready, "failed": sorted(pending)[0], "reason": "its caller went away"}
        for t in [*watch, *pending.values()]:
            exited = _exited(t)
            if exited is not None:
                return {"ready": False, "ready_ids": ready, "died": t["id"], "failed": t["id"], "reason": exited}
        for tid, t in list(pending.items()):
            if _http_ok(t["url"], timeout=float(req.get("probe_timeout_secs", 5))):
                ready.append(tid)
                del pending[tid]
        if not pending:
            return {"ready": True, "ready_ids": ready}
        if time.monotonic() > deadline:
            reason = f"not healthy after {req['timeout_secs']}s"
            return {"ready": False, "ready_ids": ready, "failed": sorted(pending)[0], "reason": reason}
        time.sleep(0.25)


def _caller_gone(caller: int) -> bool:
    """The agent's caller is gone: it was re-parented, or nobody reads its answer any more (the
    read end of its stdout closed: an SSH session whose client died)."""
    if os.getppid() != caller:
        return True
    poller = select.poll()
    poller.register(sys.stdout.fileno(), 0)  # POLLERR and POLLHUP are always reported
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def _exited(target: dict[str, Any]) -> str | None:
    """Why a starting process is no good: it exited, or its supervisor saw it exit once (it
    would restart it, but a process that fails while ``up`` waits for it fails ``up``)."""
    if same_process(target["pid"], target["create_time"]) is None:
        return "process exited"
    story = _story(target.get("exit_file"))
    last = story.get("last_exit") if story else None
    if isinstance(last, dict):
        code = last.get("code")
        how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"code {code}"
        return f"process exited ({how})"
    return None


def _http_ok(url: str, timeout: float) -> bool:
    """Whether ``url`` answers GET with 200 within ``timeout`` seconds."""
    try:
        return exchange("GET", url, timeout_secs=timeout).status == 200
    except (OSError, ValueError):
        return False


def _http_json(url: str, timeout: float, key: str | None = None) -> Any:
    """The JSON ``url`` answers GET with (the key as a bearer token), or None when it answers no JSON
    with a 2xx status."""
    try:
        return call_json(url, key=key, timeout_secs=timeout)
    except (OSError, ValueError):
        return None


def status(req: dict[str, Any]) -> StatusReply:
    """Each process of ``req``: alive, its supervisor's story, and (when it answers HTTP) its health
    and info. Processes are probed at once (a bounded pool): a paused engine's health check waits
    out its timeout, and it must not add up across a node's engines."""
    timeout = float(req.get("timeout_secs", 5))
    procs = req["processes"]
    with ThreadPoolExecutor(max(1, min(STATUS_PROBES, len(procs)))) as pool:
        entries = list(pool.map(lambda proc: _process_status(proc, timeout), procs))
    return {"processes": {proc["id"]: entry for proc, entry in zip(procs, entries, strict=True)}}


STATUS_PROBES = 16
"""Most processes of one node that ``status`` probes at once."""


def _process_status(proc: dict[str, Any], timeout: float) -> ProcessState:
    p = same_process(proc["pid"], proc["create_time"])
    entry: ProcessState = {"alive": p is not None}
    story = _story(proc.get("exit_file"))
    if story is not None:
        entry["restarts"] = int(story.get("restarts") or 0)
        entry["last_exit"] = story.get("last_exit")
        entry["supervisor"] = story.get("state")
        entry["reason"] = story.get("reason")
        if story.get("peer"):
            entry["peer"] = story["peer"]
        child = story.get("pid")
        if p is not None and story.get("state") != "running":
            entry["alive"] = False  # the supervisor waits to restart it, or is about to exit
        if p is not None and child and story.get("create_time"):
            entry["child_pid"] = child
            p = same_process(child, story["create_time"]) or p
    if proc.get("exit_file") and (p is None or not entry["alive"]):
        # (also while its supervisor is still finishing: it wrote the final code before it exits, and
        # `up` read such a trainer, done with 0, as one that died with no code)
        entry["exit_code"] = story.get("exit_code") if story else None  # None: SIGKILL of the group
    if p is not None and entry["alive"]:
        started = _safe(p.create_time)
        if started is not None:
            entry["uptime_secs"] = time.time() - started
        entry["rss_mb"] = _safe(lambda p=p: p.memory_info().rss / 2**20)
    if p is None or not entry["alive"]:
        return entry
    # Health and info side by side: a hung or paused engine makes each wait out its timeout, and one
    # after the other they made every `pdctl status` of such a fleet wait twice as long.
    with ThreadPoolExecutor(1) as pool:
        info_url = proc.get("info_url")
        info = pool.submit(_http_json, info_url, timeout, proc.get("info_key")) if info_url else None
        if proc.get("health_url"):
            entry["healthy"] = _http_ok(proc["health_url"], timeout=timeout)
        if info is not None:
            entry["info"] = info.result()
    return entry


def _story(path: str | None) -> dict[str, Any] | None:
    """What a process's supervisor wrote (pdctl.node.supervise), if anything yet."""
    if not path:
        return None
    try:
        story = json.loads(Path(expand(path)).read_text())
    except (OSError, ValueError):
        return None
    return story if isinstance(story, dict) else None


def _safe(fn):
    try:
        return fn()
    except psutil.Error:
        return None


def stop(req: dict[str, Any]) -> StopReply:
    """SIGTERM every group (and any process tagged with the run id), wait, SIGKILL the rest.

    A group member counts only if it was created after the group's leader: a reused pgid
    cannot make us kill a stranger.
    """
    grace = float(req.get("grace_secs", 10))
    run_id = req.get("run_id")
    groups = _processes_by_pgid()
    victims: dict[int, psutil.Process] = {}
    for proc in req["processes"]:
        for member in groups.get(proc["pgid"], []):
            created = _safe(lambda m=member: start_time(m))
            if created is not None and created >= recorded_start(proc["create_time"]) - 0.01:
                victims[member.pid] = member
    if run_id:
        victims.update({p.pid: p for p in _tagged(run_id)})
    victims.pop(os.getpid(), None)
    procs = list(victims.values())
    for p in procs:
        _signal(p, signal.SIGTERM)
    gone, alive = wait_gone(procs, grace)
    for p in alive:
        _signal(p, signal.SIGKILL)
    killed, alive = wait_gone(alive, 5)
    left = {p.pid for p in alive if _safe(p.status) not in (None, psutil.STATUS_ZOMBIE)}
    if run_id:
        left |= {p.pid for p in _tagged(run_id)}
    return {"terminated": len(gone), "killed": len(killed), "left": sorted(left)}


def _processes_by_pgid() -> dict[int, list[psutil.Process]]:
    out: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["pid"]):
        try:
            out.setdefault(os.getpgid(p.pid), []).append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def _tagged(run_id: str) -> list[psutil.Process]:
    """Processes whose environment carries this run's id (children that left the group)."""
    out = []
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                tagged = needle in f.read().split(b"\0")
            if tagged and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def read(req: dict[str, Any]) -> ReadReply:
    path = Path(expand(req["path"]))
    try:
        size = path.stat().st_size
    except OSError as exc:
        return {"error": f"{path}: {exc.strerror}", "size": 0, "data": ""}
    offset = int(req.get("offset", -1))
    if offset < 0:  # the last N lines
        lines = int(req.get("lines", 50))
        with open(path, "rb") as f:
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
        text = b"\n".join(data.split(b"\n")[-(lines + 1) :])
        return {"size": size, "data": text.decode(errors="replace")}
    with open(path, "rb") as f:
        f.seek(min(offset, size))
        data = f.read(1024 * 1024)
    return {"size": offset + len(data), "data": data.decode(errors="replace")}


def rm(req: dict[str, Any]) -> RmReply:
    import shutil

    removed = []
    for path in req["paths"]:
        p = Path(expand(path))
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    return {"removed": removed}


def _mps(command: str):
    def run(req: dict[str, Any]) -> dict[str, Any]:
        from pdctl.node import mps

        try:
            return getattr(mps, command)(req)
        except mps.MpsError as exc:
            raise AgentFailure(str(exc)) from exc

    return run


COMMANDS = {
    "preflight": preflight,
    "spawn": spawn,
    "wait-ready": wait_ready,
    "status": status,
    "stop": stop,
    "read": read,
    "rm": rm,
    "retarget": retarget,
    "mps-start": _mps("start"),
    "mps-stop": _mps("stop"),
    "mps-status": _mps("status"),
}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in COMMANDS:
        print(json.dumps({"error": f"usage: python -m pdctl.node.agent {{{','.join(COMMANDS)}}} < request.json"}))
        sys.exit(2)
    raw = sys.stdin.read()
    try:
        result = COMMANDS[args[0]](json.loads(raw) if raw.strip() else {})
    except AgentFailure as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(1)
    except Exception as exc:  # report, never a traceback on the wire
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
