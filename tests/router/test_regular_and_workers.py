"""Regular (non-PD) mode and runtime worker registration."""

from __future__ import annotations

from tests.helpers import RouterProcess, eventually, get, http, pd_router_args, post, wait_metric


def greedy(text, n=6):
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def test_regular_mode_routes_to_regular_workers(fleet, tmp_path) -> None:
    regular = fleet[0]
    proc = RouterProcess(tmp_path, "--worker-urls", regular.url, "--policy", "power_of_two").start("/readiness")
    try:
        status, out = post(proc.url + "/generate", greedy("plain"))
        assert status == 200 and out["output_ids"] == post(regular.url + "/generate", greedy("plain"))[1]["output_ids"]
        events = __import__("tests.helpers", fromlist=["sse"]).sse(
            proc.url + "/generate", {**greedy("s"), "stream": True}
        )
        assert events[-1] == "[DONE]"
    finally:
        proc.stop()


def test_workers_can_join_and_leave_at_runtime(fleet, tmp_path) -> None:
    _, prefill, d1, _ = fleet
    proc = RouterProcess(tmp_path, "--pd-disaggregation", "--health-check-interval-secs", "0.5").start()
    try:
        status, out = post(proc.url + "/generate", greedy("nobody"))
        assert status == 503 and out["error"]["code"] == "no_prefill_servers"
        status, added = post(
            proc.url + "/workers",
            {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": prefill.bootstrap_port},
        )
        assert status == 202 and added["status"] == "accepted"
        assert post(proc.url + "/workers", {"url": d1.url, "worker_type": "decode"})[0] == 202
        # Registered again (slime registers the engines it is given): a success, no duplicate; as
        # another role: refused, naming the role it has.
        status, again = post(proc.url + "/workers", {"url": d1.url, "worker_type": "decode"})
        assert status == 202 and again["message"] == "already registered", again
        status, other = post(proc.url + "/workers", {"url": d1.url, "worker_type": "prefill", "bootstrap_port": 1})
        assert status == 409 and "registered already as decode" in other["error"]["message"], other
        assert post(proc.url + "/workers", {"url": "ftp://x", "worker_type": "decode"})[0] == 400
        listed = get(proc.url + "/workers")[1]
        assert listed["stats"] == {"prefill_count": 1, "decode_count": 1, "regular_count": 0}
        assert post(proc.url + "/generate", greedy("joined"))[0] == 200
        assert http("DELETE", proc.url + "/workers/" + added["worker_id"])[0] == 202
        status, out = post(proc.url + "/generate", greedy("gone"))
        assert status == 503 and out["error"]["code"] == "no_prefill_servers"
        assert http("DELETE", proc.url + "/workers/nope")[0] == 404
    finally:
        proc.stop()


def test_cli_rejects_bad_worker_specs(tmp_path) -> None:
    import subprocess
    import sys

    for args, needle in [
        (["--prefill", "http://a:1", "8998"], "--prefill/--decode need --pd-disaggregation"),
        (["--pd-disaggregation", "--prefill", "http://a:1", "x"], "bootstrap port must be a number"),
        (["--pd-disaggregation", "--decode", "a:1"], "must start with http://"),
        (["--api-key-env", "NOPE_UNSET_VAR"], "is unset or empty"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", "pdctl", "router", *args], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 2 and needle in res.stderr, (args, res.stderr)


def test_request_timeout_is_a_504_and_not_retried(tmp_path) -> None:
    import time

    from tests.helpers import sims

    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--sim-decode-ms-per-step", "100"),
    ]
    with sims(tmp_path, *specs) as (prefill, decode):
        args = pd_router_args([prefill], [decode], "--request-timeout-secs", "1")
        proc = RouterProcess(tmp_path, *args).start("/readiness")
        try:
            started = time.monotonic()
            status, out = post(proc.url + "/generate", greedy("slow", 40))  # 40 steps x 100 ms > 1 s
            assert status == 504 and out["error"]["code"] == "request_timeout"
            assert time.monotonic() - started < 5  # one timeout, no retries
            assert post(proc.url + "/generate", greedy("quick", 2))[0] == 200
        finally:
            proc.stop()


def test_a_worker_that_never_answers_is_a_504_streamed_or_not(tmp_path) -> None:
    import socket
    import time

    with socket.socket() as black_hole:  # listens, never accepts: connections open, nothing comes back
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(64)
        url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
        args = ["--worker-urls", url, "--disable-health-check", "--request-timeout-secs", "1"]
        proc = RouterProcess(tmp_path, *args).start()
        try:
            for body in (greedy("x"), {**greedy("x"), "stream": True}):
                started = time.monotonic()
                status, out = post(proc.url + "/generate", body)
                assert status == 504 and out["error"]["code"] == "request_timeout", out
                assert time.monotonic() - started < 5  # one timeout, no retries
        finally:
            proc.stop()


def test_busy_port_or_bad_host_is_one_clear_line(tmp_path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for flags, where in [
            (["--port", port], f"127.0.0.1:{port}"),
            (["--port", "0", "--prometheus-port", port], f"127.0.0.1:{port}"),
            (["--host", "no-such-host.invalid", "--port", "0"], "no-such-host.invalid:0"),
        ]:
            argv = [sys.executable, "-m", "pdctl", "router", *flags, "--worker-urls", "http://127.0.0.1:1"]
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert result.returncode == 1 and f"cannot listen on {where}" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr  # all given back


def test_a_drain_longer_than_the_lease_does_not_expire_the_push(tmp_path) -> None:
    """The trainer cannot renew its lease while it waits in /pdctl/hold for in-flight requests
    (found under bench_serving load: a 30 s lease expired during a longer drain and took every
    engine out of rotation before anything was pushed). The lease starts when the hold answers."""
    import concurrent.futures as cf

    from tests.helpers import SimProcess

    slow = SimProcess(tmp_path, "--sim-decode-ms-per-step", "50", name="slow").start()
    proc = RouterProcess(tmp_path, "--worker-urls", slow.url).start("/readiness")
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, proc.url + "/generate", greedy("long", 40))  # about 2 s of decode steps
            wait_metric(proc, "pdctl_router_in_flight_requests 1.0", running, interval=0.02)
            status, held = post(
                proc.url + "/pdctl/hold", {"txn": "t1", "engines": [slow.url], "lease_secs": 0.5, "timeout_secs": 60}
            )
            assert status == 200 and held["drained"]
            assert running.result()[0] == 200
        workers = get(proc.url + "/workers")[1]["workers"]
        assert [w["quarantined"] for w in workers] == [None]  # no lease ran out while it drained
        assert post(proc.url + "/pdctl/release", {"txn": "t1", "complete": [slow.url], "failed": {}})[0] == 200
    finally:
        proc.stop()
        slow.stop()


def kill_until_out_of_rotation(engine, proc: RouterProcess) -> None:
    """``kill -9`` the router's only engine and wait until the router has taken it out."""
    import os
    import signal

    assert engine.proc is not None
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait()
    eventually(
        lambda: not get(proc.url + "/workers")[1]["workers"][0]["is_healthy"],
        30,
        what="the killed engine out of rotation",
    )


def test_a_request_waits_for_its_only_engine_to_come_back_rather_than_failing(tmp_path) -> None:
    """The only engine is killed: a request that comes while it is out of rotation waits
    (--worker-wait-secs) and is answered once the engine listens again, as it
    does when its supervisor restarts it; before, it got a 503 at once."""
    import concurrent.futures

    from tests.helpers import SimProcess

    engine = SimProcess(tmp_path).start()
    # a wait longer than the test's own timeout: a slow engine start on a loaded machine is no failure
    proc = RouterProcess(tmp_path, "--worker-urls", engine.url, "--worker-wait-secs", "600")
    proc.start("/readiness")
    waiting = "pdctl_router_requests_waiting_for_workers 1.0"
    try:
        kill_until_out_of_rotation(engine, proc)
        info = get(proc.url + "/server_info")[1]  # the engine is listed, saying it does not answer
        assert [w["url"] for w in info["regular"]] == [engine.url] and "no answer" in info["regular"][0]["error"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, proc.url + "/generate", greedy("wait for me"))
            wait_metric(proc, waiting, answer)
            again = SimProcess(tmp_path, port=engine.port).start()
            try:
                status, out = answer.result()
                assert status == 200 and out["text"], out
            finally:
                again.stop()
    finally:
        proc.stop()
        engine.stop()


def test_a_worker_whose_process_is_gone_leaves_rotation_without_waiting_for_health_checks(tmp_path) -> None:
    """With health checks 10 minutes apart, only the 1 s liveness probe (a refused TCP connect)
    can take a killed engine out of rotation within this test; once it listens again on its port
    it is checked at the fast startup interval and comes back."""
    from tests.helpers import SimProcess

    engine = SimProcess(tmp_path).start()
    proc = RouterProcess(
        tmp_path, "--worker-urls", engine.url, "--health-check-interval-secs", "600", "--worker-wait-secs", "0"
    )
    proc.start("/readiness")
    try:
        kill_until_out_of_rotation(engine, proc)
        status, out = post(proc.url + "/generate", greedy("nobody home"))
        assert status == 503 and out["error"]["code"] == "no_healthy_workers", out
        again = SimProcess(tmp_path, port=engine.port).start()
        try:
            eventually(
                lambda: get(proc.url + "/workers")[1]["workers"][0]["is_healthy"],
                30,
                what="the engine back in rotation",
            )
            assert post(proc.url + "/generate", greedy("back"))[0] == 200
        finally:
            again.stop()
    finally:
        proc.stop()
        engine.stop()
    assert "its port refuses connections" in proc.log.read_text()
