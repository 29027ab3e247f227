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

    python benchmarks/heal.py   # writes benchmarks/results/heal.{json,md}
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
APPLY_MAX = 4
"""At most this many decodes added by the apply (a sim holds ~0.5 GB; 2 x 17 would not fit in 24 GiB)."""


def pdctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run([PY, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"pdctl {' '.join(args)}: {res.stderr[-2000:]}")
    return res


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def in_rotation(router: str, url: str) -> bool:
    try:
        workers = get(router + "/workers")["workers"]
    except OSError:
        return False
    return any(w["url"] == url and w["is_healthy"] and not w["quarantined"] for w in workers)


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
    procs = [p for p in psutil.process_iter(["cmdline"]) if "pdctl.supervise" in " ".join(p.info["cmdline"] or [])]
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


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="heal-bench-"))
    rows = []
    for i, n in enumerate(SIZES):
        row = one_size(tmp, n, 27000 + 1000 * i)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if SSH_HOSTS:
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
