"""Test helpers: free ports, real sim processes, small HTTP clients (urllib, no extra deps)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # at run time imported where used, as this module's other imports of pdctl are
    from hypothesis.strategies import SearchStrategy

    from pdctl.topology import Topology

T = TypeVar("T")


@contextlib.contextmanager
def triton_stub() -> Iterator[None]:
    """SGLang imports triton at import time; on CPU an empty stub suffices for its parser. The
    stub is removed afterwards: torch (torch._dynamo, imported by torch.optim) takes any triton in
    sys.modules for the real one and fails on the stub."""
    added = "triton" not in sys.modules
    if added:
        sys.modules["triton"] = types.ModuleType("triton")
    try:
        yield
    finally:
        if added:
            sys.modules.pop("triton", None)


def eventually(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    *,
    interval: float = 0.05,
    what: str | Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Wait until ``predicate()`` returns something truthy and return it; AssertionError naming
    ``what`` (and the last value seen) once ``timeout`` seconds pass. A bound, not a measure: tests
    wait on events (a state change, a file, an answer) and the timeout only keeps a regression from
    hanging.

    The predicate is asked every ``interval`` seconds and once more at the deadline. What it raises
    propagates (an assertion inside it fails the wait at once), except the exceptions in ``ignore``,
    which count as "not yet" (``ignore=(OSError,)``: a server not listening yet). ``what``: a short
    text, or a function giving it (called once, when the time is up, for what is known only then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last: object = exc  # "not yet": shown as the last value seen
        else:
            if value:
                return value
            last = value
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(interval, left))
    if callable(what):
        try:
            what = what()
        except Exception as exc:  # the wait's own failure is the news, not its description's
            what = f"(its description failed: {exc!r})"
    seen = repr(last)
    if len(seen) > 500:
        seen = seen[:500] + "..."
    raise AssertionError(f"{what or 'the condition'}: not within {timeout:g} s (last seen: {seen})")


async def eventually_async(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    *,
    interval: float = 0.0,
    what: str | None = None,
) -> T:
    """``eventually`` inside an event loop: yields to the loop (``interval`` seconds, 0: one turn)
    between asks, so that the tasks that make ``predicate`` true run."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or 'the condition'}: not within {timeout:g} s (last seen: {value!r})")
        await asyncio.sleep(interval)


def free_port() -> int:
    """A port free now, for what cannot bind port 0 and say which it got (torch's rendezvous,
    sglang-router, a multi-node sim's peers); it may be taken before it is used."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_base(span: int = 200) -> int:
    """A ``ports.base`` for a local cluster: a random block of ``span`` ports, every one free now
    (a cluster's port cursor starts at the base). Random, not derived from the pid: two suites on
    one machine do not pick the same block; a port taken between this check and ``up`` is caught
    by up's preflight (a clear error, not a silent clash)."""
    rng = random.SystemRandom()
    ephemeral = 32768  # Linux's default start of the range outgoing connections take ports from
    with contextlib.suppress(OSError, ValueError):
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:  # below the ephemeral range: no client socket takes a port between this check and up
        base = rng.randrange(10000, ephemeral - span, 10)
        try:
            for port in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


_serial = itertools.count()


def bound_ports(port_file: Path, proc: subprocess.Popen, log: Path | None = None, timeout: float = 120) -> dict:
    """The ports a server started on port 0 wrote to ``port_file`` (``--sim-port-file``,
    ``--port-file``): ``{"port": N, "bootstrap_port": M, ...}``, written once it serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists():
            return json.loads(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{_tail(log)}")
        time.sleep(0.05)
    raise TimeoutError(f"no port file {port_file} after {timeout}s\n{_tail(log)}")


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout: float = 60,
    headers: dict | None = None,
    raw: bytes | None = None,
):
    """(status, parsed JSON or text). Never raises on HTTP errors. ``raw``: send these bytes as the body."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, answer = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read()
    text = answer.decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def engine_auth(name: str, home: str | Path | None = None) -> dict[str, str]:
    """The ``Authorization`` header for the engines of cluster ``name`` (the key ``pdctl up``
    made; ``home``: its PDCTL_HOME, else this process's)."""
    return _cluster_auth(name, home, "engine")


def control_auth(name: str, home: str | Path | None = None) -> dict[str, str]:
    """The ``Authorization`` header for the router's control plane of cluster ``name``."""
    return _cluster_auth(name, home, "control")


def _cluster_auth(name: str, home: str | Path | None, which: str) -> dict[str, str]:
    from pdctl.cluster.keys import load_keys
    from pdctl.cluster.state import StateStore

    keys = load_keys(StateStore(Path(home) if home else None), name)
    assert keys is not None, f"cluster {name} has no keys"
    return {"Authorization": f"Bearer {getattr(keys, which)}"}


def post(url: str, body: Any = None, **kw: Any):
    return http("POST", url, body if body is not None else {}, **kw)


def get(url: str, **kw: Any):
    return http("GET", url, **kw)


def sse(url: str, body: Any, timeout: float = 60, headers: dict[str, str] | None = None) -> list[Any]:
    """POST a streaming request; returns the parsed `data:` events (the last is "[DONE]")."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_http(url: str, timeout: float = 90, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    return log.read_text()[-3000:] if log and log.exists() else ""


class _SimForkServer:
    """This test process's tests/sim_forkserver.py (started at first use, one per process): it
    forks sim engines with torch already imported. ``PDCTL_TEST_SIM_EXEC=1`` turns it off (every
    engine exec'd as ``python -m pdctl.sim``)."""

    _lock = threading.Lock()
    _server: subprocess.Popen | None = None
    _path = ""

    @classmethod
    def connect(cls) -> socket.socket:
        with cls._lock:
            if cls._server is None or cls._server.poll() is not None:
                import tempfile

                cls._path = os.path.join(tempfile.mkdtemp(prefix="pdctl-forkserver-"), "sock")
                ready = os.pipe()
                cls._server = subprocess.Popen(
                    [sys.executable, "-c", _FORKSERVER_MAIN, cls._path, str(ready[1])],
                    stdin=subprocess.PIPE,
                    cwd=Path(__file__).resolve().parent.parent,
                    pass_fds=(ready[1],),
                    start_new_session=True,
                )
                os.close(ready[1])
                with os.fdopen(ready[0], "rb") as r:
                    if r.read(1) != b"1":  # written once it listens; EOF if it died first
                        raise RuntimeError(f"the sim fork server exited with {cls._server.wait()}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(cls._path)
            return sock


_FORKSERVER_MAIN = "import sys; from tests.sim_forkserver import serve; serve(sys.argv[1], int(sys.argv[2]))"


class ForkedProcess:
    """A sim engine forked by the fork server, with the parts of ``subprocess.Popen`` the tests
    use (pid, poll, wait, returncode, send_signal, terminate, kill): its exit code comes over the
    connection once the server has reaped it."""

    def __init__(self, argv: list[str], *, log: Path, env: dict, cwd: str | None = None):
        self.args = argv
        self.returncode: int | None = None
        self._conn = _SimForkServer.connect()
        request = {"args": argv[3:], "env": env, "cwd": cwd or os.getcwd(), "log": str(log)}
        self._conn.sendall(json.dumps(request).encode() + b"\n")
        self._lines = self._conn.makefile("rb")
        self.pid: int = json.loads(self._lines.readline())["pid"]

    def _read_exit(self, timeout: float | None) -> None:
        import select

        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            line = self._lines.readline()
            self.returncode = json.loads(line)["returncode"] if line else -9  # (server gone: taken as killed)
            self._lines.close()
            self._conn.close()

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_exit(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class SimProcess:
    """A real ``python -m pdctl.sim`` process on 127.0.0.1: on port 0 (the port it got is read
    from the port file it writes) unless ``port`` is given; a multi-node sim's ranks use free ports."""

    def __init__(self, tmp: Path, *args: str, name: str = "sim", env: dict | None = None, port: int | None = None):
        self.args = list(args)
        multinode = "--nnodes" in self.args
        self.port = port if port is not None else (free_port() if multinode else 0)
        self.bootstrap_port: int | None = None
        if "prefill" in args and "--disaggregation-bootstrap-port" not in args:
            self.bootstrap_port = free_port() if multinode else 0
            self.args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        serial = next(_serial)
        self.log = tmp / f"{name}-{serial}.log"
        self.port_file = tmp / f"{name}-{serial}.ports"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | ForkedProcess | None = None

    @property
    def url(self) -> str:
        assert self.port, "the port is known once the process started"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SimProcess:
        argv = [sys.executable, "-m", "pdctl.sim", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        if "--model-path" not in self.args:
            argv += ["--model-path", "sim://tiny"]
        if self.port == 0:
            argv += ["--sim-port-file", str(self.port_file)]
        if os.environ.get("PDCTL_TEST_SIM_EXEC") == "1":
            self.proc = subprocess.Popen(
                argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        else:
            self.proc = ForkedProcess(argv, log=self.log, env=self.env)
        if self.port == 0:
            self._learn_ports()
        self._ready(f"{self.url}/health")
        return self

    def _learn_ports(self) -> None:
        assert self.proc is not None
        try:
            ports = bound_ports(self.port_file, self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        self.port = ports["port"]
        if self.bootstrap_port == 0:
            self.bootstrap_port = ports.get("bootstrap_port")

    def _ready(self, url: str) -> None:
        """Wait until it answers; a process that never does is stopped, not left behind."""
        try:
            wait_http(url, proc=self.proc, log=self.log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, 9)
                self.proc.wait()


@contextlib.contextmanager
def sims(tmp: Path, *specs: tuple[str, ...]) -> Iterator[list[SimProcess]]:
    """Start several sims in parallel (each pays torch's import time once), stop them all."""
    procs = [SimProcess(tmp, *spec, name=f"sim{i}") for i, spec in enumerate(specs)]
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(SimProcess.start, procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


def pd_body(body: dict, prefill: SimProcess, *, room: int, batch: int | None = None) -> dict:
    out = dict(body)
    if batch is None:
        out.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
    else:
        out.update(
            bootstrap_host=["127.0.0.1"] * batch,
            bootstrap_port=[prefill.bootstrap_port] * batch,
            bootstrap_room=[room + i for i in range(batch)],
        )
    return out


class RouterProcess:
    """A real ``python -m pdctl router`` process on port 0 of 127.0.0.1 (the port it got is read
    from the port file it writes)."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None, port: int = 0):
        """``port``: give one when the router will not log its start-up line (--log-level warn)."""
        self.port = port
        self.bootstrap_port: int | None = None
        self.args = list(args)
        serial = next(_serial)
        self.log = tmp / f"router-{serial}.log"
        self.port_file = tmp / f"router-{serial}.ports"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        assert self.port, "the port is known once the process started"
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/health") -> RouterProcess:
        argv = [sys.executable, "-m", "pdctl", "router", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        argv += ["--port-file", str(self.port_file)]
        self.proc = subprocess.Popen(
            argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        if self.port == 0:
            SimProcess._learn_ports(self)  # same: read the port, or stop it
        SimProcess._ready(self, self.url + ready_path)  # same wait-or-stop
        return self

    def stop(self) -> None:
        SimProcess.stop(self)  # same terminate/kill dance


def pd_router_args(prefills: list[SimProcess], decodes: list[SimProcess], *extra: str) -> list[str]:
    args = ["--pd-disaggregation"]
    for p in prefills:
        args += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        args += ["--decode", d.url]
    return [*args, *extra]


class NullEngine:
    """``python -m pdctl.sim.null`` on port 0: answers at once; records bodies when asked."""

    def __init__(self, tmp: Path, role: str, record: bool = False, busy: bool = False):
        self.port = 0
        self.role = role
        self.busy = busy
        self.bootstrap_port: int | None = 0 if role == "prefill" else None
        serial = next(_serial)
        self.log = tmp / f"null-{role}-{serial}.log"
        self.record = tmp / f"null-{role}-{serial}.jsonl" if record else None
        self.port_file = tmp / f"null-{role}-{serial}.ports"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        assert self.port, "the port is known once the process started"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NullEngine:
        argv = [sys.executable, "-m", "pdctl.sim.null", "--port", "0", "--role", self.role]
        argv += ["--port-file", str(self.port_file)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", "0"]
        if self.record:
            argv += ["--record", str(self.record)]
        if self.busy:
            argv.append("--busy")
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        SimProcess._learn_ports(self)  # same: read the ports, or stop it
        SimProcess._ready(self, self.url + "/health")
        return self

    def bodies(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines()] if self.record else []

    def stop(self) -> None:
        SimProcess.stop(self)


@contextlib.contextmanager
def sglang_router(tmp: Path, prefills: list, decodes: list, *, expect_workers: int) -> Iterator[str]:
    """The real sglang-router 0.3.2 (Rust gateway) in PD mode; yields its URL once ready."""
    port = free_port()
    log = tmp / f"sglang-router-{port}.log"
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for p in prefills:
        argv += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        argv += ["--decode", d.url]
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
    ]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, out = get(url + "/readiness", timeout=2)
                if status == 200 and out.get("healthy_workers") == expect_workers:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"sglang-router not ready:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_metric(proc: RouterProcess, line: str, sent, interval: float = 0.05) -> None:
    """Until the router's /metrics shows ``line`` (the request ``sent`` must not have ended first)."""

    def shown() -> bool:
        if line in str(get(proc.url + "/metrics")[1]):
            return True
        assert not sent.done(), sent.result()
        return False

    eventually(shown, 60, interval=interval, what=f"{line!r} in the router's /metrics")


def pdctl(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``python -m pdctl ARGS`` under ``env``; its completed process (output captured as text)."""
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def local_topology(tmp_path, name: str, base: int, **sections) -> str:
    """A one-node localhost sim topology with a prefill and a decode; ``sections`` override."""
    import yaml

    topo = tmp_path / f"{name}.yaml"
    body = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 2, "workdir": str(tmp_path / "runs")}],
        "ports": {"base": base},
        "prefill": {},
        "decode": {},
        **sections,
    }
    topo.write_text(yaml.safe_dump(body))
    return str(topo)


def run_processes(run_id: str) -> list[int]:
    """Every process on this machine whose environment carries the cluster's run id."""
    import psutil

    out = []
    needle = f"PDCTL_RUN_ID={run_id}".encode()
    for p in psutil.process_iter(["pid"]):
        try:
            if needle in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0") and p.status() != "zombie":
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def checked(text: str, filename: str = "<topology>") -> tuple[Topology, list]:
    """What `pdctl validate` checks: the file, then whether it plans (load_plan_text)."""
    from pdctl.plan import load_plan_text

    planned = load_plan_text(text, filename)
    return planned.topology, planned.warnings


def errors_of(text: str) -> list[str]:
    """The error messages `pdctl validate` gives for the topology ``text`` (it must fail)."""
    import pytest

    from pdctl.errors import TopologyError
    from tests.conftest import yaml_text

    with pytest.raises(TopologyError) as info:
        checked(yaml_text(text), "f.yaml")
    return [i.format("f.yaml") for i in info.value.issues if i.severity == "error"]


def one_error(text: str, *needles: str) -> str:
    """The first error of the topology ``text`` that contains every needle (there must be one)."""
    errs = errors_of(text)
    hits = [e for e in errs if all(n in e for n in needles)]
    assert hits, f"no error with {needles} in {errs}"
    return hits[0]


def topologies() -> SearchStrategy[dict]:
    """A hypothesis strategy of random topologies (1-6 nodes, a prefill and a decode group, maybe a trainer)."""
    from hypothesis import strategies as st

    @st.composite
    def topology(draw):
        gpn = draw(st.sampled_from([1, 2, 4, 8]))
        n_nodes = draw(st.integers(1, 6))
        nodes = [{"name": f"n{i}", "host": f"10.1.0.{i + 1}", "gpus": gpn} for i in range(n_nodes)]
        total = gpn * n_nodes
        tps = [t for t in (1, 2, 4, 8, 16) if t <= gpn or t % gpn == 0]
        p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
        budget = total
        p_rep = draw(st.integers(1, max(1, budget // (2 * p_tp))))
        d_rep = draw(st.integers(1, max(1, (budget - p_rep * p_tp) // d_tp or 1)))
        data = {
            "name": "prop",
            "model": {"path": "/m"},
            "engine": draw(st.sampled_from(["sglang", "sim"])),
            "nodes": nodes,
            "ports": {"base": draw(st.integers(10000, 30000))},
            "prefill": {"replicas": p_rep, "tp": p_tp},
            "decode": {"replicas": d_rep, "tp": d_tp, "attn_dp": draw(st.sampled_from([1, d_tp]))},
            "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
        }
        if draw(st.booleans()):
            data["trainer"] = {"command": ["python", "t.py"], "nodes": [nodes[-1]["name"]], "nproc_per_node": 1}
        return data

    return topology()


def held_generate(url: str, body: dict, authorization: str):
    """A ``POST /generate`` of ``body`` sent to the engine at ``url`` over a raw socket whose answer
    is never read: the engine holds the request until the returned socket closes (it then aborts
    it, as for a client that left)."""
    import json as _json
    import socket

    data = _json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    held = socket.create_connection((host, int(port)))
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: {authorization}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    held.sendall(head.encode() + data)
    return held
