"""A client that sends a large batch and goes away (found by a probe: a 20,000-prompt batch kept
the sim computing and /health silent for 13 s): SGLang aborts a disconnected client's requests and
its HTTP server answers /health while the scheduler works; so does the sim."""

from __future__ import annotations

import json
import socket

from tests.helpers import SimProcess, eventually, get, post


def running(sim: SimProcess) -> int:
    states = get(sim.url + "/server_info", timeout=60)[1]["internal_states"]
    return sum(s["num_running_reqs"] + s["num_queue_reqs"] for s in states)


def test_a_batch_whose_client_left_is_aborted_and_health_answers(tmp_path) -> None:
    sim = SimProcess(tmp_path).start()
    try:
        prompts = [f"prompt {i}" for i in range(20000)]
        body = json.dumps({"text": prompts, "sampling_params": {"max_new_tokens": 64}}).encode()
        head = (
            "POST /generate HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", sim.port)) as client:
            client.sendall(head.encode() + body)
            eventually(lambda: running(sim), 120, what="the batch in the engine")
        # The client is gone: /health answers (it did not wait for the batch), the next request is
        # served, and nothing of the batch is left in the engine.
        assert get(sim.url + "/health", timeout=60)[0] == 200
        status, out = post(sim.url + "/generate", {"text": "after", "sampling_params": {"max_new_tokens": 8}})
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
        assert running(sim) == 0
    finally:
        sim.stop()
