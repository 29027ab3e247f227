"""The router as an attacker and a careless client meet it (hardening issue): keys per door,
refused bodies never buffered, memory bounded whatever the framing, holds that always end,
bodies and worker registrations validated. A real router process, null engines behind it."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import pytest

from tests.helpers import NullEngine, RouterProcess, eventually, get, http, pd_router_args, post

CLIENT, ADMIN, READER = "client-key", "admin-key", "reader-key"
KEYS = ["--api-key", CLIENT, "--control-plane-api-keys", f"a1:ops:admin:{ADMIN}", f"u1:dash:user:{READER}"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def fleet(tmp_path):
    prefill, decode = NullEngine(tmp_path, "prefill").start(), NullEngine(tmp_path, "decode").start()
    router = RouterProcess(
        tmp_path,
        *pd_router_args([prefill], [decode]),
        *KEYS,
        "--control-plane-audit-enabled",
    ).start("/readiness")
    try:
        yield router
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


def test_each_key_opens_its_own_door_only(fleet) -> None:
    url = fleet.url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    new_worker = {"url": "http://127.0.0.1:1", "worker_type": "decode"}
    # the data plane: the client key only
    assert post(url + "/generate", body, headers=bearer(CLIENT))[0] == 200
    for key in (ADMIN, READER, "wrong"):
        assert post(url + "/generate", body, headers=bearer(key))[0] == 401, key
    assert post(url + "/generate", body)[0] == 401
    # /health_generate runs a generation: the client key; probes stay open
    assert get(url + "/health_generate")[0] == 401
    assert get(url + "/health_generate", headers=bearer(CLIENT))[0] == 200
    for path in ("/health", "/liveness", "/readiness", "/metrics"):
        assert get(url + path)[0] == 200, path
    # the control plane: the inference key cannot add a worker; a reader reads; the admin changes
    assert post(url + "/workers", new_worker, headers=bearer(CLIENT))[0] == 401
    assert post(url + "/workers", new_worker, headers=bearer(READER))[0] == 403
    assert get(url + "/workers", headers=bearer(READER))[0] == 200
    assert get(url + "/pdctl/weights", headers=bearer(READER))[0] == 200
    assert post(url + "/pdctl/hold", {}, headers=bearer(READER))[0] == 403
    assert post(url + "/pdctl/hold", {}, headers=bearer(CLIENT))[0] == 401
    status, out = post(url + "/workers", {**new_worker, "api_key": "its-own"}, headers=bearer(ADMIN))
    assert status == 202, out
    status, listed = get(url + "/workers", headers=bearer(ADMIN))
    assert status == 200 and "its-own" not in str(listed), "a worker's key is never answered"
    audit = fleet.log.read_text()
    assert "principal=u1 method=POST path=/workers outcome=denied" in audit
    assert "principal=a1 method=POST path=/workers outcome=allowed" in audit
    assert ADMIN not in audit and READER not in audit and CLIENT not in audit, "keys are never logged"


def test_sglang_control_routes_are_the_control_planes(fleet) -> None:
    """SGLang's control routes, answered for the fleet (pdctl.router.facade), are admin routes:
    what pauses the fleet or changes its weights needs the admin key; reading the version, a
    reader's; the client key opens none of them. Each call is audited."""
    url = fleet.url
    for headers in ({}, bearer(CLIENT), bearer("wrong")):
        assert post(url + "/pause_generation", {}, headers=headers)[0] == 401, headers
        assert post(url + "/update_weights_from_distributed", {}, headers=headers)[0] == 401, headers
        assert get(url + "/flush_cache", headers=headers)[0] == 401, headers
    assert post(url + "/pause_generation", {}, headers=bearer(READER))[0] == 403
    assert post(url + "/init_weights_update_group", {}, headers=bearer(READER))[0] == 403
    assert get(url + "/get_weight_version", headers=bearer(READER))[0] not in (401, 403)
    assert post(url + "/pause_generation", {}, headers=bearer(ADMIN))[0] == 200
    assert post(url + "/continue_generation", {}, headers=bearer(ADMIN))[0] == 200
    audit = fleet.log.read_text()
    assert "principal=unauthenticated method=POST path=/pause_generation outcome=denied" in audit
    assert "principal=a1 method=POST path=/pause_generation outcome=allowed" in audit
    assert "sglang_control method=POST path=/continue_generation status=200" in audit


def test_the_bearer_scheme_is_matched_in_any_case(fleet) -> None:
    """RFC 7235: the scheme is case-insensitive (found by a probe: ``bearer KEY`` was refused)."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert post(fleet.url + "/generate", body, headers={"Authorization": f"{scheme} {CLIENT}"})[0] == 200
    assert post(fleet.url + "/generate", body, headers={"Authorization": f"Basic {CLIENT}"})[0] == 401
    assert post(fleet.url + "/generate", body, headers={"Authorization": f"bearer {CLIENT.upper()}"})[0] == 401


@pytest.mark.parametrize("network", ["127.0.0.1/32", "10.9.0.0/16"])
def test_control_open_from_admits_keyless_framework_calls_from_its_networks_only(tmp_path, network) -> None:
    """RL frameworks send no key: ``--control-plane-open-from`` admits their calls (SGLang's control
    routes, GET/POST /workers) from the networks it names, audited; a call that sends a key is
    checked as ever; pdctl's own control routes and the data plane are not opened."""
    prefill, decode = NullEngine(tmp_path, "prefill").start(), NullEngine(tmp_path, "decode").start()
    router = RouterProcess(
        tmp_path,
        *pd_router_args([prefill], [decode]),
        *KEYS,
        "--control-plane-open-from",
        network,
    ).start("/readiness")
    try:
        url = router.url
        opened = network.startswith("127.")
        assert post(url + "/pause_generation", {})[0] == (200 if opened else 401)
        assert post(url + "/continue_generation", {})[0] == (200 if opened else 401)
        assert get(url + "/workers")[0] == (200 if opened else 401)
        registered = post(url + "/workers", {"url": decode.url, "worker_type": "decode"})
        assert registered[0] == (202 if opened else 401), registered
        assert post(url + "/pause_generation", {}, headers=bearer("wrong"))[0] == 401  # a key sent is checked
        assert post(url + "/pdctl/hold", {})[0] == 401
        assert post(url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})[0] == 401
        if opened:
            assert "principal=network:127.0.0.1 method=POST path=/pause_generation outcome=allowed" in (
                router.log.read_text()
            )
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


def _vm_hwm_mb(pid: int) -> float:
    """The process's peak resident memory so far (MB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _send(port: int, head: bytes, body: bytes) -> bytes:
    """Send ``head`` then ``body``; the answer (empty if the router closed first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head)
        with contextlib.suppress(OSError):  # a router that refused at the head closes mid-send
            s.sendall(body)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
        return answer


def _one_byte_chunks(payload: bytes) -> bytes:
    return b"".join(b"1\r\n" + payload[i : i + 1] + b"\r\n" for i in range(len(payload))) + b"0\r\n\r\n"


def test_refused_and_trickled_bodies_cost_the_router_no_memory(fleet) -> None:
    pid = fleet.proc.pid
    before = _vm_hwm_mb(pid)
    # 10 MB in 1-byte chunks, no key: refused at the head, nothing of the body is kept
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = _send(fleet.port, head, _one_byte_chunks(b"a" * 10_000_000))
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    # 300 MB announced with Content-Length, no key: refused before a byte of it is read
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\n"
    answer = _send(fleet.port, head, b"b" * 300_000_000)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    # an authorized 5 MB body in 1-byte chunks is buffered in one buffer (it had cost ~90 bytes per
    # byte); a control-plane route reads it whole and answers without an engine (whose own limit is 1 MiB)
    payload = b'{"url": "http://nowhere:1", "reason": "' + b"c" * 5_000_000 + b'"}'
    head = (
        f"POST /pdctl/cordon HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = _send(fleet.port, head, _one_byte_chunks(payload))
    assert answer.startswith(b"HTTP/1.1 404") and b"no worker" in answer, answer[-400:]
    grown = _vm_hwm_mb(pid) - before
    assert grown < 50, f"the router's peak memory grew by {grown:.0f} MB"


def test_request_bodies_the_router_can_see_are_malformed_get_400(fleet) -> None:
    url, key = fleet.url, bearer(CLIENT)
    cases = [
        ("/generate", {"text": "a", "stream": "yes"}, "stream must be true or false"),
        ("/generate", {"text": "a", "stream": 1}, "stream must be true or false"),
        ("/generate", {"text": "a", "sampling_params": {"n": "2"}}, "sampling_params.n must be an integer"),
        ("/generate", {"text": "a", "sampling_params": {"n": 10**9}}, "at most 1024 samples"),
        ("/generate", {"text": ["a"] * 70, "sampling_params": {"n": 1000}}, "70000 sequences"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, "must be at least 0"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5.5}}, "must be an integer"),
        ("/generate", {"text": "a", "sampling_params": "x"}, "sampling_params must be an object"),
        ("/v1/completions", {"model": "m", "prompt": "a", "n": True}, "n must be an integer"),
        ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": "5"}, "max_tokens must be an integer"),
        ("/v1/chat/completions", {"model": "m", "messages": [], "stream": "on"}, "stream must be true"),
        ("/generate", [1, 2], "must be a JSON object"),
    ]
    for path, body, message in cases:
        status, out = post(url + path, body, headers=key)
        assert status == 400 and message in out["error"]["message"], (path, body, out)
    assert post(url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}, headers=key)[0] == 200


def test_holds_validate_their_body_and_always_end(fleet) -> None:
    url, admin = fleet.url, bearer(ADMIN)
    for raw, field in [
        (b"not json", "invalid JSON"),
        (b'{"lease_secs": "abc"}', "lease_secs"),
        (b'{"lease_secs": 1e300}', "lease_secs"),
        (b'{"timeout_secs": -1}', "timeout_secs"),
        (b'{"txn": {"a": 1}}', "txn"),
        (b'{"engines": "http://x"}', "engines"),
        (b'{"refit": ["drain"]}', "refit"),
        (b"[]", "JSON object"),
    ]:
        status, out = http("POST", url + "/pdctl/hold", raw=raw, headers=admin)
        assert status == 400 and field in out["error"]["message"], (raw, out)
    assert http("POST", url + "/pdctl/release", raw=b'{"complete": 5}', headers=admin)[0] == 400
    assert get(url + "/pdctl/weights", headers=admin)[1]["held"] is False, "no refused hold held the router"
    # a bare hold (no transaction) that nobody renews ends with its lease
    status, out = post(url + "/pdctl/hold", {"lease_secs": 0.5, "refit": "interrupt"}, headers=admin)
    assert status == 200 and out["held"], out
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
    status, _ = post(url + "/generate", body, headers=bearer(CLIENT))  # waits for the gate, then runs
    assert status == 200


def test_worker_registrations_are_validated(fleet) -> None:
    url, admin = fleet.url, bearer(ADMIN)
    bad = [
        ({"url": "http://"}, "must be http(s)://HOST"),
        ({"url": "ftp://example.com"}, "must be http(s)://HOST"),
        ({"url": "http://h:70000"}, "url"),
        ({"url": "http://u:p@h:1"}, "credentials"),
        ({"url": 5}, "url must be a string"),
        ({"url": "http://h:1", "bootstrap_port": 0}, "bootstrap_port"),
        ({"url": "http://h:1", "bootstrap_port": 70000}, "bootstrap_port"),
        ({"url": "http://h:1", "bootstrap_port": True}, "bootstrap_port"),
        ({"url": "http://h:1", "worker_type": "trainer"}, "worker_type must be one of"),
        ({"url": "http://h:1", "worker_type": 3}, "worker_type"),
        ({"url": "http://h:1", "api_key": "a\nb"}, "api_key"),
    ]
    for body, message in bad:
        status, out = post(url + "/workers", body, headers=admin)
        assert status == 400 and message in out["error"]["message"], (body, out)
    assert http("POST", url + "/workers", raw=b"{", headers=admin)[0] == 400
    assert len(get(url + "/workers", headers=admin)[1]["workers"]) == 2, "nothing was registered"


def test_a_health_round_of_one_worker_checks_that_worker_only(fleet) -> None:
    url, admin = fleet.url, bearer(ADMIN)
    workers = get(url + "/workers", headers=admin)[1]["workers"]
    one = workers[0]["url"]
    status, out = post(url + "/pdctl/refresh", {"url": one}, headers=admin)
    assert status == 200 and [w["url"] for w in out["workers"]] == [one], out
    assert post(url + "/pdctl/refresh", {"url": "http://127.0.0.1:1"}, headers=admin)[0] == 404
    assert post(url + "/pdctl/refresh", {"url": 5}, headers=admin)[0] == 400
    assert post(url + "/pdctl/refresh", {"url": one}, headers=bearer(READER))[0] == 403
    assert len(post(url + "/pdctl/refresh", None, headers=admin)[1]["workers"]) == 2  # all of them


def test_a_worker_url_that_cannot_be_requested_is_refused_and_could_not_stop_the_health_loop(fleet) -> None:
    """Found by a probe: a 64-character host label passed the checks, its health check raised
    UnicodeError, the health loop died and a release then failed, leaving the router held."""
    url, admin = fleet.url, bearer(ADMIN)
    for bad in ("http://" + "a" * 64 + ":9", "http://a..b:9", "http://127.0.0.1:9/\nINJECTED", "http://h:9/x"):
        status, out = post(url + "/workers", {"url": bad, "worker_type": "decode"}, headers=admin)
        assert status == 400, (bad, out)
    status, out = post(url + "/workers", {"url": "http://127.0.0.1:9", "worker_type": "regular"}, headers=admin)
    assert status == 400 and "prefill or decode" in out["error"]["message"], out
    # a hold and its release still work, and requests flow
    assert post(url + "/pdctl/hold", {"refit": "interrupt"}, headers=admin)[0] == 200
    assert post(url + "/pdctl/release", {}, headers=admin)[0] == 200
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
    assert post(url + "/generate", body, headers=bearer(CLIENT))[0] == 200


def test_one_workers_failing_check_stays_in_its_check() -> None:
    """Whatever a worker's check raises, check_all goes on with the others (in-process)."""
    import asyncio

    import aiohttp

    from pdctl.router.config import RouterConfig
    from pdctl.router.health import HealthChecks
    from pdctl.router.versions import VersionRule
    from pdctl.router.workers import WorkerRegistry

    async def run() -> list[bool]:
        config = RouterConfig()
        registry = WorkerRegistry(config)
        health = HealthChecks(config, registry, VersionRule(config, registry))
        bad = registry.add("http://" + "a" * 64 + ":9", "decode")  # bypasses POST /workers' checks
        bad.activated = bad.healthy = True
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                await health.check_all(session)  # raised UnicodeError before
        return [bad.healthy]

    assert asyncio.run(run()) == [False], "the bad worker failed its checks and left rotation"


def test_a_model_id_cannot_walk_to_another_engine_route(fleet) -> None:
    """Found by a probe: /v1/models/../../flush_cache reached the engine's /flush_cache with the
    engine key (a client-key holder running an admin route)."""
    for path in ("/v1/models/../../flush_cache", "/v1/models/%2e%2e/%2e%2e/flush_cache", "/v1/models/a/../.."):
        with socket.create_connection(("127.0.0.1", fleet.port), timeout=30) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n\r\n".encode())
            head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 404"), (path, head[:200])


def test_bodies_waiting_at_a_held_router_count_against_its_body_limit(tmp_path) -> None:
    """Found by a probe: whole bodies held at a held router were not counted (40 x 10 MB took it
    from 78 MB to 887 MB). Now a body counts until its answer: beyond the limit, 503."""
    import threading

    prefill, decode = NullEngine(tmp_path, "prefill").start(), NullEngine(tmp_path, "decode").start()
    router = RouterProcess(
        tmp_path, "--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode",
        decode.url, *KEYS, "--max-payload-size", "8000000", "--max-inflight-body-bytes", "20000000",
    ).start("/readiness")  # fmt: skip
    try:
        assert (
            post(router.url + "/pdctl/hold", {"refit": "interrupt", "lease_secs": 600}, headers=bearer(ADMIN))[0] == 200
        )
        body = {"text": "x" * 6_000_000, "sampling_params": {"max_new_tokens": 1}}
        answers: list[int] = []
        held = [
            threading.Thread(
                target=lambda: answers.append(post(router.url + "/generate", body, headers=bearer(CLIENT))[0])
            )
            for _ in range(3)
        ]
        for t in held:
            t.start()

        def held_bytes() -> float:
            text = get(router.url + "/metrics")[1]
            return float(
                next(
                    line.split()[-1]
                    for line in text.splitlines()
                    if line.startswith("pdctl_router_request_body_bytes ")
                )
            )

        # the three bodies are in, waiting at the held router
        eventually(lambda: held_bytes() >= 18_000_000, 60, what="the three bodies held")
        raw = json.dumps(body).encode()
        head = (
            f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT}\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n"
        ).encode()
        answer = _send(router.port, head, raw)  # refused mid-body: read what came back
        assert answer.startswith(b"HTTP/1.1 503") and b"retry later" in answer, answer[:300]
        assert post(router.url + "/pdctl/release", {}, headers=bearer(ADMIN))[0] == 200
        for t in held:
            t.join()
        assert len(answers) == 3 and 503 not in answers, answers  # answered (the null engine refuses 6 MB: 413)
        eventually(lambda: held_bytes() == 0, 30, what="every body let go once answered")
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


def test_the_planners_mailbox_takes_step_hints_and_decisions_from_the_control_plane_only(fleet) -> None:
    """``POST /pdctl/step`` and ``POST /pdctl/planner`` need an admin key, take only what they
    define (a caller cannot grow the metric's label sets), and are counted in ``/metrics``."""
    url = fleet.url
    step = {"prompt_tokens": 12000, "requests": 64}
    assert post(url + "/pdctl/step", step)[0] == 401
    assert post(url + "/pdctl/step", step, headers=bearer(CLIENT))[0] == 401
    assert post(url + "/pdctl/step", step, headers=bearer(READER))[0] == 403
    for bad in ({"prompt_tokens": -1}, {"requests": "64"}, {"prompt_tokens": True}, [1]):
        status, out = post(url + "/pdctl/step", bad, headers=bearer(ADMIN))
        assert status == 400, (bad, out)
    assert post(url + "/pdctl/step", step, headers=bearer(ADMIN)) == (200, {"success": True, "steps": 1})
    assert post(url + "/pdctl/step", None, headers=bearer(ADMIN))[1]["steps"] == 2  # nothing said: counted
    decision = {"action": "switch", "mode": "act", "outcome": "switched", "reason": "the decodes run full"}
    assert post(url + "/pdctl/planner", decision, headers=bearer(READER))[0] == 403
    for key, value in (("action", "x" * 10), ("outcome", "switched: decode-1 is prefill-4"), ("mode", None)):
        status, out = post(url + "/pdctl/planner", {**decision, key: value}, headers=bearer(ADMIN))
        assert status == 400 and key in out["error"]["message"], out
    assert post(url + "/pdctl/planner", decision, headers=bearer(ADMIN))[0] == 200
    status, shown = get(url + "/pdctl/planner", headers=bearer(READER))
    assert status == 200 and shown["last_step"]["prompt_tokens"] == 0 and shown["last_step"]["requests"] == 0
    assert shown["last_decision"]["reason"] == "the decodes run full"
    metrics = get(url + "/metrics")[1]
    assert "pdctl_router_step_boundaries_total 2.0" in metrics
    assert 'pdctl_planner_decisions_total{action="switch",mode="act",outcome="switched"} 1.0' in metrics
    assert metrics.count("pdctl_planner_decisions_total{") == 1  # the refused ones made no series


def test_a_trainer_announces_a_step_with_the_env_up_gives_it(fleet) -> None:
    from pdctl.cluster.sampling import RouterSample, parse_router_metrics
    from pdctl.errors import PdctlError
    from pdctl.step_hint import announce_step

    env = {"PDCTL_ROUTER_URL": fleet.url, "PDCTL_CONTROL_KEY": ADMIN}
    assert announce_step(4096, 64, env=env) == 1
    assert announce_step(env=env) == 2
    assert get(fleet.url + "/pdctl/planner", headers=bearer(ADMIN))[1]["last_step"]["prompt_tokens"] == 0
    announce_step(12000, 96, env=env)
    seen = RouterSample("up")  # as the planner's sampler reads the router
    parse_router_metrics(get(fleet.url + "/metrics")[1], seen)
    assert (seen.steps, seen.step_prompt_tokens, seen.step_requests) == (3, 12000, 96)
    with pytest.raises(PdctlError, match="refused the step boundary"):
        announce_step(1, env={**env, "PDCTL_CONTROL_KEY": READER})
    with pytest.raises(PdctlError, match="PDCTL_ROUTER_URL is not set"):
        announce_step(1, env={})
