"""Watching a fleet (observability issue): `pdctl top` against a local sim cluster under load,
after a `pdctl weights load` and with an engine killed; `pdctl metrics` scraped by a real
Prometheus (Debian's package; skipped with the reason where it is missing), every query of the
Grafana dashboard answered; the frame arithmetic and the scrape files on their own.

One cluster serves the module (an `up` costs seconds); the test that kills an engine runs last.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import yaml

from pdctl.cluster.sampling import EngineSample, RouterSample, Sample
from pdctl.cluster.state import ClusterState, Phase, ProcessRecord, StateStore
from pdctl.cluster.watch import make_frame, quantile
from pdctl.refit import Release
from pdctl.roles import Role
from pdctl.sim.model import PRESETS, TinyLM, save_checkpoint
from tests.helpers import eventually, free_port_base, get, local_topology, pdctl, post

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "pdctl-fleet.json"
NAME = "obs"


# -- the pure parts ---------------------------------------------------------------------------------
def test_quantile_is_prometheus_histogram_quantile() -> None:
    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, float("inf"): 40.0}
    assert quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {0.1: 1.0, float("inf"): 5.0}) == 0.1  # in +Inf: the largest finite bound


def _state() -> ClusterState:
    def rec(pid: str, role: Role, url: str | None, **ports: int) -> ProcessRecord:
        return ProcessRecord(pid, role, "me", 1, 1, 0.0, "/x.log", dict(ports), url, "/health", pid)

    procs = [
        rec("prefill-0", Role.PREFILL, "http://10.0.0.2:3000", http=3000),
        rec("decode-0", Role.DECODE, "http://10.0.0.2:3001", http=3001),
        rec("router", Role.ROUTER, "http://127.0.0.1:3004", http=3004, metrics=3005),
        rec("trainer.me", Role.TRAINER, None),
    ]
    return ClusterState("c", "run", Phase.UP, [], "http://127.0.0.1:3004", {p.id: p for p in procs})


def test_frame_rates_come_from_counter_deltas_and_survive_a_restart() -> None:
    state = _state()
    router0 = RouterSample("up", {200: 100.0, 503: 1.0}, {0.1: 50.0, 1.0: 100.0, float("inf"): 101.0}, retries=2)
    router1 = RouterSample(
        "up", {200: 120.0, 503: 3.0}, {0.1: 50.0, 1.0: 120.0, float("inf"): 123.0}, retries=6, workers_known=True
    )
    s0 = Sample(10.0, {"prefill-0": EngineSample("up", prompt_tokens=1000.0), "decode-0": EngineSample(
        "up", generation_tokens=500.0)}, router0)  # fmt: skip
    s1 = Sample(12.0, {"prefill-0": EngineSample("up", prompt_tokens=1400.0), "decode-0": EngineSample(
        "refused", generation_tokens=None)}, router1)  # fmt: skip
    frame = make_frame(state, [s0, s1], None, None)
    prefill, decode = frame.engines
    assert prefill.prompt_tokens_per_s == pytest.approx(200.0) and prefill.health == "up (not routed)"
    assert decode.health == "down" and decode.generation_tokens_per_s is None  # no figure, not a zero
    r = frame.router
    assert r is not None and r.requests_per_s == pytest.approx(11.0) and r.errors_per_s == pytest.approx(1.0)
    assert r.retries_per_s == pytest.approx(2.0)
    assert r.p50_ms is not None and 100 < r.p50_ms <= 1000  # the window's 22 answers: 20 in (0.1, 1], 2 above
    # a restarted engine's counter starts again: its rate is what it counted since, never negative
    s2 = Sample(13.0, {"prefill-0": EngineSample("up", prompt_tokens=50.0), "decode-0": EngineSample("up")}, router1)
    assert make_frame(state, [s1, s2], None, None).engines[0].prompt_tokens_per_s == pytest.approx(50.0)
    assert frame.trainer is not None and frame.trainer.state.startswith("unknown")
    # the router's view unknown (its /workers did not answer): an engine that answers is just "up"
    blind = make_frame(state, [s0, replace(s1, router=replace(router1, workers_known=False))], None, None)
    assert blind.engines[0].health == "up"


def test_scrape_targets_and_config(tmp_path) -> None:
    from pdctl.cluster.scrape import scrape_config, targets, write_targets

    state = _state()
    listed = targets(state.name, state.scrape_targets())
    assert [t["targets"] for t in listed] == [["10.0.0.2:3000"], ["10.0.0.2:3001"], ["127.0.0.1:3005"]]
    assert listed[2]["labels"] == {"cluster": "c", "role": "router", "process": "router", "node": "me"}
    path = write_targets(tmp_path, state.name, state.scrape_targets())
    assert json.loads(path.read_text()) == listed and path.stat().st_mode & 0o777 == 0o600
    store = StateStore(tmp_path / "home")  # every save of the state rewrites the list: down empties it
    store.save(state)
    assert json.loads((store.dir("c") / "prometheus-targets.json").read_text()) == listed
    store.save(replace(state, processes={}))
    assert json.loads((store.dir("c") / "prometheus-targets.json").read_text()) == []
    config = yaml.safe_load(scrape_config("c", path, interval_secs=2))
    job = config["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == [str(path)] and job["scrape_interval"] == "2s"


def test_release_carries_phases_and_refuses_bad_ones() -> None:
    body = Release("t1", ("http://a",), {}, {"transfer": 0.5, "hold": 0.01}).to_json()
    assert Release.from_json(body).phases == {"transfer": 0.5, "hold": 0.01}
    assert Release.from_json({"complete": []}).phases == {}  # an older trainer sends none
    for bad in ({"transfer": "fast"}, {"transfer": -1}, {"transfer": True}, ["transfer"]):
        with pytest.raises(ValueError, match="phases"):
            Release.from_json({"phases": bad})


# -- a running cluster ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    # the decode stays down once killed (restart: never): the killed-engine check sees it down
    trainer = {"command": ["python", "-c", "import time; time.sleep(3600)"], "nproc_per_node": 1, "startup_secs": 0.5}
    node = {"name": "me", "host": "127.0.0.1", "gpus": 3, "workdir": str(tmp / "runs")}
    topo = local_topology(tmp, NAME, free_port_base(), decode={"restart": "never"}, trainer=trainer, nodes=[node])
    env = {**os.environ, "PDCTL_HOME": str(tmp / "home")}
    save_checkpoint(TinyLM(replace(PRESETS["tiny"], seed=7)), tmp / "ckpt")
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    url = next(line.split()[-1] for line in up.stdout.splitlines() if line.startswith("router:"))
    try:
        yield {"tmp": tmp, "env": env, "url": url, "home": tmp / "home"}
    finally:
        pdctl("down", NAME, env=env)


class Load:
    """Requests through the router, two at a time, until stopped."""

    def __init__(self, url: str):
        self.url, self.stop, self.answers = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        while not self.stop.is_set():
            body = {"text": "watch the fleet " * 8, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
            self.answers.append(post(self.url + "/generate", body, timeout=60)[0])

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        eventually(lambda: self.answers, 60, what="a first answer through the router")  # the engines' counters move
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def top_json(cluster, *args: str) -> dict:
    res = pdctl("top", NAME, "--once", "--json", *args, env=cluster["env"])
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)


def test_top_under_load_and_after_a_weights_load(cluster) -> None:
    with Load(cluster["url"]) as load:
        frame = top_json(cluster)
        loaded = pdctl("weights", "load", str(cluster["tmp"] / "ckpt"), NAME, "--version", "top-v2", env=cluster["env"])
        assert loaded.returncode == 0, loaded.stdout + loaded.stderr
        after = top_json(cluster)
        narrow = pdctl("top", NAME, "--once", env={**cluster["env"], "COLUMNS": "80"})
    assert set(load.answers) == {200}, load.answers
    rows = {e["engine"]: e for e in frame["engines"]}
    assert set(rows) == {"prefill-0", "decode-0"} and all(e["health"] == "serving" for e in rows.values()), rows
    assert rows["decode-0"]["generation_tokens_per_s"] > 0 and rows["prefill-0"]["prompt_tokens_per_s"] > 0, rows
    assert all(e["restarts"] == 0 and e["kv_use"] is not None and e["running"] is not None for e in rows.values())
    router = frame["router"]
    assert router["health"] == "up" and router["requests_per_s"] > 0 and router["p50_ms"] > 0, router
    assert router["errors_per_s"] == 0 and router["open_breakers"] == [], router
    assert frame["trainer"] == {"state": "running", "processes": 1, "restarts": 0}, frame["trainer"]
    # after the load: every engine on the new version, the update with its phases
    assert {e["weight_version"] for e in after["engines"]} == {"top-v2"}, after["engines"]
    weights = after["weights"]
    assert weights["version"] == "top-v2" and weights["state"] == "complete", weights
    assert {"hold", "pause", "transfer", "version", "continue"} <= set(weights["phases"]), weights
    assert weights["seconds"] > 0 and all(v >= 0 for v in weights["phases"].values())
    # the text frame fits 80 columns without splitting a word
    assert narrow.returncode == 0 and "Traceback" not in narrow.stderr, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), narrow.stdout
    flat = " ".join(narrow.stdout.split())
    for word in ("prefill-0", "decode-0", "serving", "top-v2", "complete", "req/s", "transfer", "restarts"):
        assert word in flat, f"{word!r} missing or split:\n{narrow.stdout}"


def test_top_in_a_terminal_quits_on_q_and_on_ctrl_c(cluster) -> None:
    for stop in ("q", signal.SIGINT):
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdctl", "top", NAME, "--interval", "0.5"],
            stdin=follower, stdout=follower, stderr=follower, env={**cluster["env"], "COLUMNS": "100"},
            start_new_session=True,
            # a suite started as a background job ignores SIGINT, and Python leaves it ignored in its
            # children: the Ctrl-C below must reach a top that handles it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        os.close(follower)
        seen = b""
        try:
            while b"router" not in seen:  # a first frame is on the screen
                chunk = os.read(leader, 65536)
                assert chunk, seen
                seen += chunk
            if stop == "q":
                os.write(leader, b"q")
            else:
                proc.send_signal(stop)
            assert proc.wait(timeout=30) == 0
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal's other end closed: all read
                    break
                if not chunk:
                    break
                seen += chunk
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(leader)
        assert b"Traceback" not in seen and b"prefill-0" in seen, seen[-2000:]


# -- Prometheus -------------------------------------------------------------------------------------
def _prometheus_bins() -> tuple[str, str]:
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        pytest.skip("Prometheus is not installed (scripts/setup.sh installs Debian's `prometheus` as root)")
    return prom, tool


def _listening_port(proc: subprocess.Popen, log: Path) -> int:
    """The port a server started on port 0 listens on, as the kernel says (not its log)."""
    ps = psutil.Process(proc.pid)

    def ports() -> list[int]:
        assert proc.poll() is None, log.read_text()[-3000:]
        return [c.laddr.port for c in ps.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]

    return eventually(ports, 60, what=lambda: f"prometheus listening:\n{log.read_text()[-3000:]}")[0]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query in the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] if p.get("type") != "row" for t in p["targets"]]


def _concrete(expr: str) -> str:
    """The query as Grafana sends it: its variables replaced (cluster: all; rate windows: 30 s)."""
    return expr.replace("$cluster", ".*").replace("$__rate_interval", "30s").replace("$__range", "5m")


def test_dashboard_queries_are_documented() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text().replace("\\|", "|")
    for title, expr in dashboard_queries():
        assert f"`{expr}`" in doc, f"panel {title!r}: its query is not in docs/observability.md"


def test_a_real_prometheus_scrapes_the_fleet_and_answers_every_dashboard_query(cluster) -> None:
    prom, tool = _prometheus_bins()
    tmp, env = cluster["tmp"], cluster["env"]
    config = pdctl("metrics", NAME, "--prometheus-config", "--scrape-interval", "1", env=env)
    assert config.returncode == 0, config.stderr
    listed = pdctl("metrics", NAME, "--targets", env=env)
    keys = json.loads((cluster["home"] / NAME / "keys.json").read_text())
    for secret in keys.values():  # no key is written into either
        assert secret not in config.stdout and secret not in listed.stdout
    roles = sorted(t["labels"]["role"] for t in json.loads(listed.stdout))
    assert roles == ["decode", "prefill", "router"], listed.stdout
    (tmp / "prom.yml").write_text(config.stdout)
    check = subprocess.run([tool, "check", "config", str(tmp / "prom.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [prom, f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             "--web.listen-address=127.0.0.1:0"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{_listening_port(server, log)}"
        # Prometheus listens before it serves queries (503 while its storage opens): /-/ready says when.
        _wait(lambda: get(base + "/-/ready", timeout=30)[0] == 200, "itself ready (/-/ready)", log)
        api = base + "/api/v1/query?query="

        def series(expr: str) -> list:
            status, body = get(api + urllib.parse.quote(_concrete(expr)), timeout=30)
            assert status == 200 and body["status"] == "success", (expr, body)
            return body["data"]["result"]

        _wait(lambda: len(series('up{job="pdctl-obs"} == 1')) == 3, "all three targets up", log)
        bench = pdctl("bench", NAME, "--num-prompts", "24", "--max-concurrency", "4", "--dataset", "fixed",
                      "--input-len", "32", "--output-len", "16", env=env, timeout=300)  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        # p99 TTFT by role: a figure, not only a series. Read while the bench's observations are
        # inside the panel's 30 s rate window: after the waits below only the router's health
        # checks (a one-token generation per worker every 10 s) land in it, a loaded machine can
        # space those past 30 s, and the figure is then rightly NaN (seen in a fresh clone).
        queries = dashboard_queries()
        figures: list = []

        def decode_ttft() -> bool:
            figures[:] = series(queries[1][1])
            decode = [float(s["value"][1]) for s in figures if s["metric"].get("role") == "decode"]
            return bool(decode) and 0 < decode[0] < 60  # NaN compares false

        _wait(decode_ttft, lambda: f"a finite decode p99 TTFT after the bench (last: {figures})", log)
        loaded = pdctl("weights", "load", str(tmp / "ckpt"), NAME, "--version", "prom-v3", env=env)
        assert loaded.returncode == 0, loaded.stdout + loaded.stderr
        # every panel's query has its series once a scrape after the bench and the load is in
        # (a series born in the bench needs two scrapes before rate() shows it: waited for, per query)
        assert len(queries) >= 20
        empty = list(queries)

        def answered() -> bool:
            empty[:] = [(title, expr) for title, expr in empty if not series(expr)]
            return not empty

        _wait(lambda: series('pdctl_router_worker_weight_version{version="prom-v3"}') != [], "the loaded version", log)
        _wait(answered, lambda: f"a series for every dashboard query (still without: {empty})", log)
        assert series('pdctl_router_weight_updates_total{outcome="complete"} >= 1'), "the weight update"
        assert series('pdctl_router_weight_update_phase_seconds_count{phase="transfer"} >= 1'), "its phases"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait(predicate, what, log: Path, timeout: float = 90) -> None:
    """Until ``predicate()``; ``what`` (text, or a function giving it) names it when it never is."""

    def said() -> str:
        return f"Prometheus showing {what() if callable(what) else what}:\n{log.read_text()[-3000:]}"

    eventually(predicate, timeout, interval=0.2, what=said)


# -- last: an engine killed -------------------------------------------------------------------------
def test_top_says_a_killed_engine_is_down_within_three_frames(cluster) -> None:
    env = cluster["env"]
    # The pid first: top's frames would queue in the pipe while a slower command ran between the
    # first frame and the kill, and frames taken before the kill would be read as after it.
    status = json.loads(pdctl("status", NAME, "--json", env=env).stdout)
    pid = next(p["pid"] for p in status["processes"] if p["id"] == "decode-0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "top", NAME, "--json", "--interval", "1", "--count", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        decode = next(e for e in first["engines"] if e["engine"] == "decode-0")
        assert decode["health"] == "serving", decode
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):  # (its supervisor may have reaped it already)
            psutil.Process(pid).wait(timeout=30)
        healths = []
        for _ in range(3):  # frames 1 s apart: within 3 s of the kill
            frame = json.loads(proc.stdout.readline())
            healths.append(next(e for e in frame["engines"] if e["engine"] == "decode-0")["health"])
            if healths[-1] == "down":
                break
        assert healths[-1] == "down", healths
        text = pdctl("top", NAME, "--once", env=env)  # the text view degrades, it does not fail
        assert text.returncode == 0 and re.search(r"decode-0.*down", text.stdout), text.stdout + text.stderr
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_routers_fleet_metrics_follow_its_workers() -> None:
    """Per worker at scrape time: breaker opens, restarts (gone, then a passed check), the
    version it holds now (no stale version series), and refit phases once an update ends."""
    from prometheus_client.parser import text_string_to_metric_families

    from pdctl.router.breaker import CircuitBreaker
    from pdctl.router.config import BreakerConfig, HealthConfig, RouterConfig
    from pdctl.router.metrics import RouterMetrics
    from pdctl.router.workers import WorkerRegistry

    def scrape() -> dict[tuple[str, tuple], float]:
        text = metrics.render(reg).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    config = RouterConfig(
        breaker=BreakerConfig(failure_threshold=1, timeout_duration_secs=60),
        health=HealthConfig(success_threshold=3),
    )
    reg, metrics = WorkerRegistry(config), RouterMetrics()
    w = reg.add("http://a:1", "decode", None, healthy=True)
    w.weight_version = "v1"
    key = (("worker", "http://a:1"), ("worker_type", "decode"))
    first = scrape()
    assert first[("pdctl_router_worker_restarts_total", key)] == 0
    assert first[("pdctl_router_worker_weight_version", tuple(sorted((*key, ("version", "v1")))))] == 1
    assert first[("pdctl_router_retries_total", (("reason", "busy"),))] == 0  # present before any retry
    CircuitBreaker(config.breaker).record(w, False)  # the breaker opens
    assert scrape()[("pdctl_router_worker_circuit_open", key)] == 1
    reg.lost(w, "test")  # its process went away ...
    reg.observe_health(w, True)  # ... and a new one answers
    w.weight_version = "v2"
    metrics.weight_update_ended("complete", {"transfer": 0.5, "hold": 0.01}, 0.6)
    after = scrape()
    assert after[("pdctl_router_worker_circuit_opens_total", key)] == 1
    assert after[("pdctl_router_worker_circuit_open", key)] == 0  # back from the dead: on trial (half-open)
    assert after[("pdctl_router_worker_restarts_total", key)] == 1 and after[("pdctl_router_worker_healthy", key)] == 1
    versions = {k[1] for k in after if k[0] == "pdctl_router_worker_weight_version"}
    assert versions == {tuple(sorted((*key, ("version", "v2"))))}, versions  # v1's series is gone
    assert after[("pdctl_router_weight_updates_total", (("outcome", "complete"),))] == 1
    assert after[("pdctl_router_weight_update_phase_seconds_sum", (("phase", "transfer"),))] == 0.5
    assert after[("pdctl_router_weight_update_held_seconds_count", ())] == 1


def test_the_view_follows_an_apply_that_removes_an_engine() -> None:
    """The status source brings the state as saved now: a removed engine leaves the frame, and
    the sampler is told to sample the new state's engines."""
    import asyncio

    from pdctl.cluster.inspect import ClusterStatus
    from pdctl.cluster.watch import Watch

    full = _state()
    shrunk = replace(full, processes={k: v for k, v in full.processes.items() if k != "decode-0"})

    class Sampler:
        def __init__(self) -> None:
            self.followed: list = []

        async def sample(self) -> Sample:  # both engines still answer this time
            return Sample(time.monotonic(), {"prefill-0": EngineSample("up"), "decode-0": EngineSample("up")}, None)

        def follow(self, state) -> None:
            self.followed.append(state)

    async def run() -> list[str]:
        sampler = Sampler()
        watch = Watch(full, sampler, lambda: (shrunk, ClusterStatus("c", Phase.UP, None, [])))  # type: ignore[arg-type]
        await watch.refresh_status()
        frame = await watch.frame()
        assert sampler.followed == [shrunk]
        return [e.engine for e in frame.engines]

    assert asyncio.run(run()) == ["prefill-0"]
