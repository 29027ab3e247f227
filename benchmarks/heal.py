"""How fast a cluster heals and grows (the keep-as-declared issue), on local sim clusters driven
through the CLI as a user would.

For each fleet size N (1 prefill + N decodes): `pdctl up`; then `kill -9` of one decode, timed
until the router routes to it again (the kill -> back time), next to the time a bare
`python -m pdctl.sim` of the same command takes to answer /health on this machine, measured right
before (the engine's own start; the difference is what pdctl adds: the supervisor's backoff, the
router noticing the death and checking it back). Then `pdctl apply` of the same file with N more
decodes (at most APPLY_MAX), timed per added engine. Meanwhile the supervisors' own CPU while the cluster idles.
Then the same on SSH test hosts (one network namespace and sshd per host, as the tests build them;
needs root): the router and prefill on h0, SSH_DECODES decodes spread over the other hosts.

Goals: pdctl adds under 1 s to an engine's own start; supervisors under 1% of a core per node.

Weights from a peer (part ``peer``): a local cluster of 1 prefill + 2 decodes on a 267 MiB sim
model (mostly a large position table: cheap to run), a trainer's push of version B, a closed loop of two
clients through the router; then `kill -9` of a decode, timed until the router routes to it at B
(its supervisor took B from a peer), against the engine's own start plus a bare gloo broadcast of
the same bytes between two processes (goal: within 1 s beyond both); and the clients' p50/p99
latency while the engine heals (the seed's scheduler stalls during the transfer: every request
passes through the one prefill, a seed) against a window of the same length before.

    python benchmarks/heal.py                      # writes benchmarks/results/heal.{json,md}
    HEAL_BENCH_PARTS=peer python benchmarks/heal.py  # writes benchmarks/results/heal_peer.{json,md}
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
SIZES = [int(n) for n in os.environ.get("HEAL_BENCH_SIZES", "1,4,16").split(",")]
KILLS = int(os.environ.get("HEAL_BENCH_KILLS", 3))
IDLE_SECS = float(os.environ.get("HEAL_BENCH_IDLE_SECS", 10))
SSH_HOSTS = int(os.environ.get("HEAL_BENCH_SSH_HOSTS", 3))
SSH_DECODES = int(os.environ.get("HEAL_BENCH_SSH_DECODES", 4))
PARTS = set(os.environ.get("HEAL_BENCH_PARTS", "sizes,ssh,peer").split(","))
PEER_MODEL = {"hidden": 256, "layers": 2, "heads": 4, "mlp": 512, "max_positions": 131072, "context_length": 2048}
"""267 MiB of float32 (mostly a 131072-position table), served at 2048 positions."""
APPLY_MAX = 4
"""At most this many decodes added by the apply (a sim holds ~0.5 GB; 2 x 17 would not fit in 24 GiB)."""


def pdctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run([PY, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"pdctl {' '.join(args)}: {res.stderr[-2000:]}")
    return res


CONTROL: dict[str, dict[str, str]] = {}
"""Router URL -> its cluster's control-plane header (``/workers`` is control plane)."""


def learn_control_key(router: str, name: str, env: dict) -> None:
    sys.path.insert(0, str(ROOT.parent))
    from pdctl.cluster.keys import load_keys
    from pdctl.cluster.state import StateStore

    keys = load_keys(StateStore(Path(env["PDCTL_HOME"])), name)
    if keys is not None:
        CONTROL[router] = {"Authorization": f"Bearer {keys.control}"}


def get(url: str, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return json.loads(r.read())


def until(predicate, what: str, timeout: float = 300.0) -> None:
    """Poll ``predicate`` until true; RuntimeError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def in_rotation(router: str, url: str) -> bool:
    try:
        workers = get(router + "/workers", CONTROL.get(router))["workers"]
    except OSError:
        return False
    return any(w["url"] == url and w["is_healthy"] and not w["quarantined"] for w in workers)


def in_rotation_at(router: str, url: str, version: str) -> bool:
    try:
        workers = get(router + "/workers", CONTROL.get(router))["workers"]
    except OSError:
        return False
    return any(w["url"] == url and w["is_healthy"] and not w["quarantined"] and w["weight_version"] == version
               for w in workers)  # fmt: skip


def status(env: dict) -> dict[str, dict]:
    out = subprocess.run([PY, "-m", "pdctl", "status", "--json"], env=env, capture_output=True, text=True)
    return {p["id"]: p for p in json.loads(out.stdout)["processes"]}


def bare_start(argv: list[str], port: int) -> float:
    """Seconds from exec to a 200 on /health for one engine started alone on ``port``."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not healthy(f"http://127.0.0.1:{port}"):
            time.sleep(0.02)
        return time.monotonic() - began
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def topology(tmp: Path, name: str, decodes: int, base: int, hosts=None) -> Path:
    """Local node ``me`` by default; with ``hosts`` (tests.netns.TestHosts) the prefill and the
    router on h0 and the decodes over the other hosts."""
    path = tmp / f"{name}.yaml"
    body = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 64, "workdir": str(tmp / "runs")}],
        "ports": {"base": base},
        "prefill": {},
        "decode": {"replicas": decodes},
    }
    if hosts is not None:
        names = [h.name for h in hosts.hosts]
        body["nodes"] = [hosts.node(i, gpus=64) for i in range(len(names))]
        body["prefill"] = {"nodes": names[:1]}
        body["decode"] = {"replicas": decodes, "nodes": names[1:]}
        body["router"] = {"host": "0.0.0.0", "node": names[0], "allow_unauthenticated": True}
    path.write_text(yaml.safe_dump(body))
    return path


def supervisors_cpu(run_dirs: Path, secs: float) -> float:
    """The supervisors' CPU over ``secs`` of idling, as a fraction of one core (all of them together)."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if "pdctl.node.supervise" in " ".join(p.info["cmdline"] or [])]
    procs = [p for p in procs if str(run_dirs) in " ".join(p.info["cmdline"] or [])]
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(secs)  # a measuring window, not a wait for an event
    used = 0.0
    for p in procs:
        try:
            used += sum(p.cpu_times()[:2]) - before[p.pid]
        except psutil.Error:
            pass
    return used / secs


def one_size(tmp: Path, n: int, base: int, hosts=None) -> dict:
    env = {**os.environ, "PDCTL_HOME": str(tmp / f"home-{n}")}
    name = f"heal{n}" if hosts is None else f"healssh{n}"
    topo = topology(tmp, name, n, base, hosts)
    pdctl("up", str(topo), env=env)
    try:
        st = status(env)
        router = st["router"]["url"]
        learn_control_key(router, name, env)
        victim = st["decode-0"]
        state = json.loads((Path(env["PDCTL_HOME"]) / name / "state.json").read_text())
        argv = state["plan"]["processes"]
        decode_argv = next(p["argv"] for p in argv if p["id"] == "decode-0")
        spare = base + 900
        bare = [bare_start([*_with_port(decode_argv, spare)], spare) for _ in range(KILLS)] if hosts is None else []
        story = Path(state["processes"]["decode-0"]["log_path"] + ".exit")  # its supervisor's (shared filesystem)
        back = []
        for _ in range(KILLS):
            pid = json.loads(story.read_text())["pid"]
            began = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while json.loads(story.read_text()).get("pid") in (pid, None):
                time.sleep(0.005)  # until its supervisor started the new process
            while not (healthy(victim["url"]) and in_rotation(router, victim["url"])):
                time.sleep(0.005)  # the new process answers, and the router routes to it
            back.append(time.monotonic() - began)
        idle = supervisors_cpu(tmp / "runs", IDLE_SECS)
        more = min(n, APPLY_MAX)
        grown = topology(tmp, name, n + more, base, hosts)
        began = time.monotonic()
        pdctl("apply", str(grown), env=env)
        apply_secs = time.monotonic() - began
        return {
            "where": "localhost" if hosts is None else f"{len(hosts.hosts)} SSH test hosts",
            "decodes": n,
            "engine_start_s": statistics.median(bare) if bare else None,
            "kill_to_back_s": statistics.median(back),
            "added_by_pdctl_s": statistics.median(back) - statistics.median(bare) if bare else None,
            "kills": back,
            "bare_starts": bare,
            "supervisors_idle_cores": idle,
            "supervisors": n + 2,
            "nodes": 1 if hosts is None else len(hosts.hosts),
            "apply_added": more,
            "apply_s": apply_secs,
            "apply_per_engine_s": apply_secs / more,
        }
    finally:
        subprocess.run([PY, "-m", "pdctl", "down", name], env=env, capture_output=True, timeout=600)


def _with_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    for flag in ("--port",):
        out[out.index(flag) + 1] = str(port)
    if "--nccl-port" in out:
        out[out.index("--nccl-port") + 1] = str(port + 1)
    return out


PUSH_B = """
import json, sys
from pdctl.sim.model import SimModelConfig, TinyLM
from pdctl.weights import WeightSync
config = json.load(open(sys.argv[1]))
model = TinyLM(SimModelConfig(**{**config, "seed": 7}))
with WeightSync.from_env() as sync:
    sync.push(list(model.named_parameters()), version="B")
"""

BARE_BROADCAST = """
import sys, time, torch, torch.distributed as dist
rank, port, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.zeros(nbytes // 4)
dist.barrier()
began = time.monotonic()
dist.broadcast(t, src=0)
if rank == 1:
    print(time.monotonic() - began, flush=True)
dist.destroy_process_group()
"""


def bare_transfer(nbytes: int, port: int) -> float:
    """Seconds of one gloo broadcast of ``nbytes`` between two fresh processes, once both joined."""
    procs = [
        subprocess.Popen([PY, "-c", BARE_BROADCAST, str(r), str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return float(out[1].strip())


class Loop:
    """A closed loop of two clients through the router: (sent, done, status) per request."""

    def __init__(self, router: str):
        import threading

        self.router, self.done, self.stop = router, [], threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = json.dumps({"text": "heal", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).encode()
        while not self.stop.is_set():
            sent = time.monotonic()
            headers = {"Content-Type": "application/json"}
            req = urllib.request.Request(self.router + "/generate", data=body, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    code = r.status
                    r.read()
            except OSError:
                code = 0
            self.done.append((sent, time.monotonic(), code))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def latencies(self, start: float, end: float) -> list[float]:
        return [d - s for s, d, _ in self.done if start <= s < end]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


BASE_SECS = 15.0
"""The clients' window before the first kill (their baseline latency)."""


def peer_rows(tmp: Path, base: int) -> dict:
    """Both runs: weights from a peer, and the same kills with ``from_peer: false`` (a plain
    restart that waits for the next push), whose latency window shows what a restarting engine
    costs this 2-core machine by itself, apart from the seed's stall."""
    sys.path.insert(0, str(ROOT.parent))
    from pdctl.sim.model import SimModelConfig, TinyLM, save_checkpoint

    model = TinyLM(SimModelConfig(**PEER_MODEL))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    save_checkpoint(model, tmp / "peer-ckpt")
    row = {"bytes": nbytes, **_peer_cluster(tmp, base, True, nbytes)}
    plain = _peer_cluster(tmp, base + 100, False, nbytes)
    row.update({f"plain_{k}": v for k, v in plain.items() if k.startswith(("p50", "p99", "requests", "kill"))})
    return row


def _peer_cluster(tmp: Path, base: int, from_peer: bool, nbytes: int) -> dict:
    name = "peer" if from_peer else "plain"
    env = {**os.environ, "PDCTL_HOME": str(tmp / f"home-{name}")}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "model": {"path": str(tmp / "peer-ckpt")},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 8, "workdir": str(tmp / "runs")}],
        "ports": {"base": base},
        "prefill": {},
        "decode": {"replicas": 2, "args": {"sim-decode-ms-per-step": 10}},
        "trainer": {"command": ["python", "-c", PUSH_B, str(tmp / "peer-ckpt" / "config.json")], "nodes": ["me"],
                    "nproc_per_node": 1},
        "weights": {"backend": "gloo", "bucket_mb": 64, "from_peer": from_peer},
    }))  # fmt: skip
    pdctl("up", str(path), env=env)
    loop = None
    try:
        until(lambda: status(env).get("trainer.me", {}).get("exit_code") is not None, "the trainer's push")
        st = status(env)
        if st["trainer.me"]["exit_code"] != 0:
            raise RuntimeError("the trainer's push failed")
        router, victim = st["router"]["url"], st["decode-0"]
        learn_control_key(router, name, env)
        until(lambda: all(in_rotation_at(router, st[e]["url"], "B") for e in ("prefill-0", "decode-0", "decode-1")),
              "every engine in rotation at B")  # fmt: skip
        state = json.loads((Path(env["PDCTL_HOME"]) / name / "state.json").read_text())
        out: dict = {}
        if from_peer:
            decode_argv = next(p["argv"] for p in state["plan"]["processes"] if p["id"] == "decode-0")
            spare = base + 900
            bare = [bare_start(_with_port(decode_argv, spare), spare) for _ in range(KILLS)]
            transfer = [bare_transfer(nbytes, spare + 10 + i) for i in range(KILLS)]
            out.update(engine_start_s=statistics.median(bare), bare_transfer_s=statistics.median(transfer))
        story = Path(state["processes"]["decode-0"]["log_path"] + ".exit")
        loop = Loop(router)
        time.sleep(3)  # the loop warms up (a measuring gap, not a wait for an event)
        baseline = (time.monotonic(), time.monotonic() + BASE_SECS)
        time.sleep(BASE_SECS)  # the baseline window
        back, windows, peer_secs = [], [], []
        for _ in range(KILLS):
            pid = json.loads(story.read_text())["pid"]
            began = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            until(lambda old=pid: json.loads(story.read_text()).get("pid") not in (old, None), "a restart")
            if from_peer:
                until(lambda: in_rotation_at(router, victim["url"], "B"), "decode-0 in rotation at B")
            else:
                until(lambda: healthy(victim["url"]), "decode-0 answering (out of rotation until a push)")
            ended = time.monotonic()
            back.append(ended - began)
            windows.append((began, ended))
            peer = json.loads(story.read_text()).get("peer") or {}
            if from_peer and peer.get("state") != "done":
                raise RuntimeError(f"decode-0 did not take B from a peer: {peer}")
            peer_secs.append(peer.get("secs") or 0.0)
            time.sleep(2)  # settle between kills (a measuring gap)
        before = loop.latencies(*baseline)
        during = [lat for b, e in windows for lat in loop.latencies(b, e)]
        loop.close()
        out.update(
            kill_to_back_s=statistics.median(back),
            kills=back,
            supervisor_peer_secs=statistics.median(peer_secs),
            p50_before_ms=1000 * (_pct(before, 0.5) or 0),
            p99_before_ms=1000 * (_pct(before, 0.99) or 0),
            p50_during_ms=1000 * (_pct(during, 0.5) or 0),
            p99_during_ms=1000 * (_pct(during, 0.99) or 0),
            requests_before=len(before),
            requests_during=len(during),
            failed=sum(1 for d in loop.done if d[2] != 200),
        )
        if from_peer:
            out["beyond_start_and_transfer_s"] = out["kill_to_back_s"] - out["engine_start_s"] - out["bare_transfer_s"]
        return out
    finally:
        if loop is not None and not loop.stop.is_set():
            loop.close()
        subprocess.run([PY, "-m", "pdctl", "down", name], env=env, capture_output=True, timeout=600)


def write_peer(row: dict) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    (RESULTS / "heal_peer.json").write_text(json.dumps({"machine": machine, "kills": KILLS, "row": row}, indent=2))
    mib = row["bytes"] / 2**20
    lines = [
        f"# weights from a peer ({machine}; sim engines, a {mib:.0f} MiB model, gloo; medians of {KILLS} kills)",
        "",
        "| engine's own start (s) | bare gloo transfer of the bytes (s) | kill -9 -> back in rotation at B (s) "
        "| beyond both (s) | supervisor: start to stamped (s) |",
        "|---|---|---|---|---|",
        f"| {row['engine_start_s']:.2f} | {row['bare_transfer_s']:.2f} | {row['kill_to_back_s']:.2f} "
        f"| {row['beyond_start_and_transfer_s']:.2f} | {row['supervisor_peer_secs']:.2f} |",
        "",
        "Clients' latency through the router (closed loop of 2; every request passes through the one",
        "prefill, which is a seed). The plain run kills the same decode with `weights.from_peer: false`",
        "(it comes back on its boot weights and waits for a push): what a restarting engine costs this",
        "machine's 2 cores by itself, apart from the seed's stall.",
        "",
        "| run | window | requests | p50 (ms) | p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for run, prefix in (("from a peer", ""), ("plain restart", "plain_")):
        for window, key in (("before (baseline)", "before"), ("kill -> back", "during")):
            lines.append(
                f"| {run} | {window} | {row[prefix + 'requests_' + key]} | {row[prefix + 'p50_' + key + '_ms']:.0f} "
                f"| {row[prefix + 'p99_' + key + '_ms']:.0f} |"
            )
    lines += ["", f"Failed requests in the peer run: {row['failed']}."]
    (RESULTS / "heal_peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="heal-bench-"))
    if "peer" in PARTS:
        write_peer(peer_rows(tmp, 25000))
    if not PARTS & {"sizes", "ssh"}:
        return
    rows = []
    for i, n in enumerate(SIZES if "sizes" in PARTS else []):
        row = one_size(tmp, n, 27000 + 1000 * i)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if SSH_HOSTS and "ssh" in PARTS:
        sys.path.insert(0, str(ROOT.parent))
        from tests.netns import TestHosts, netns_unavailable

        if why := netns_unavailable():
            print(f"no SSH test hosts: {why}", flush=True)
        else:
            (tmp / "hosts").mkdir()
            hosts = TestHosts(SSH_HOSTS, tmp / "hosts").start()
            try:
                row = one_size(tmp, SSH_DECODES, 26000, hosts)
            finally:
                hosts.close()
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "kills": KILLS, "idle_secs": IDLE_SECS}
    (RESULTS / "heal.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# healing and apply ({meta['machine']}; sim engines; medians of {KILLS} kills)",
        "",
        "On SSH test hosts the engine's own start is not measured apart (it is the same sim on the same",
        "machine): compare their kill -> back with the localhost rows.",
        "",
        "| where | decodes | engine's own start (s) | kill -9 -> back in rotation (s) | added by pdctl (s) "
        "| supervisors' idle CPU (cores, all) | apply: decodes added | apply (s) | per added engine (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        lines.append(
            f"| {r['where']} | {r['decodes']} | {secs(r['engine_start_s'])} | {r['kill_to_back_s']:.2f} "
            f"| {secs(r['added_by_pdctl_s'])} | {r['supervisors_idle_cores']:.4f} ({r['supervisors']}) "
            f"| {r['apply_added']} | {r['apply_s']:.1f} | {r['apply_per_engine_s']:.2f} |"
        )
    (RESULTS / "heal.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
