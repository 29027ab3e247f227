"""PD output equals non-PD output token for token: single, batch, stream, concurrent."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random

from tests.helpers import free_port, pd_body, post, sse

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time",
    "1 2 3 4",
    "pdctl",
    "a" * 100,
    "Hello, world! " * 5,
    "zebra",
    "SELECT * FROM",
    '{"key":',
]


def pd_generate(trio, body, room, batch=None):
    _, prefill, decode = trio
    wire = pd_body(body, prefill, room=room, batch=batch)
    with cf.ThreadPoolExecutor(2) as pool:
        d = pool.submit(post, f"{decode.url}/generate", wire)
        p = pool.submit(post, f"{prefill.url}/generate", wire)
        assert p.result()[0] == 200, p.result()
        return d.result()


def greedy(prompt, n=24, **extra):
    return {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}, **extra}


def test_single_requests_match(trio) -> None:
    regular = trio[0]
    for i, prompt in enumerate(PROMPTS):
        status, ref = post(f"{regular.url}/generate", greedy(prompt))
        assert status == 200
        status, out = pd_generate(trio, greedy(prompt), room=1000 + i)
        assert status == 200, out
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_many_concurrent_requests_match(trio) -> None:
    regular = trio[0]
    rng = random.Random(7)
    prompts = ["".join(rng.choice("abcdefgh xyz") for _ in range(rng.randint(1, 60))) for _ in range(48)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        refs = list(pool.map(lambda a: post(f"{regular.url}/generate", greedy(*a)), zip(prompts, lengths, strict=True)))
        outs = list(
            pool.map(lambda i: pd_generate(trio, greedy(prompts[i], lengths[i]), room=5000 + i), range(len(prompts)))
        )
    for (s1, ref), (s2, out) in zip(refs, outs, strict=True):
        assert s1 == s2 == 200
        assert out["output_ids"] == ref["output_ids"]


def test_input_ids_and_text_batches_match(trio) -> None:
    regular = trio[0]
    ids = [[72, 101, 108], [100, 101, 102, 103], [65] * 30]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    _, ref = post(f"{regular.url}/generate", body)
    status, out = pd_generate(trio, body, room=9000, batch=3)
    assert status == 200 and [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    text = {"text": PROMPTS[:4], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    _, ref = post(f"{regular.url}/generate", text)
    status, out = pd_generate(trio, text, room=9100, batch=4)
    assert status == 200 and [o["text"] for o in out] == [r["text"] for r in ref]


def test_scalar_room_on_a_batch_becomes_room_plus_i(trio) -> None:
    regular, prefill, decode = trio
    body = {
        "input_ids": [[1, 2, 3], [4, 5, 6]],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": 777,
    }
    with cf.ThreadPoolExecutor(2) as pool:
        d = pool.submit(post, f"{decode.url}/generate", body)
        post(f"{prefill.url}/generate", body)
        status, out = d.result()
    _, ref = post(f"{regular.url}/generate", {k: body[k] for k in ("input_ids", "sampling_params")})
    assert status == 200 and [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]


def test_streams_match(trio) -> None:
    regular, prefill, decode = trio
    body = greedy("streaming works", 16, stream=True)
    ref = sse(f"{regular.url}/generate", body)
    wire = pd_body(body, prefill, room=4242)
    with cf.ThreadPoolExecutor(2) as pool:
        d = pool.submit(sse, f"{decode.url}/generate", wire)
        pool.submit(sse, f"{prefill.url}/generate", wire).result()
        out = d.result()
    assert out[-1] == ref[-1] == "[DONE]"
    assert out[-2]["output_ids"] == ref[-2]["output_ids"]
    assert out[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert all(e["text"] for e in out[:-1])  # cumulative text in every chunk, like SGLang


def test_logprobs_merge_to_the_non_pd_ones(trio) -> None:
    regular, prefill, decode = trio
    body = greedy("logprobs", 6, return_logprob=True)
    _, ref = post(f"{regular.url}/generate", body)
    wire = pd_body(body, prefill, room=31337)
    with cf.ThreadPoolExecutor(2) as pool:
        d = pool.submit(post, f"{decode.url}/generate", wire)
        _, p = pool.submit(post, f"{prefill.url}/generate", wire).result()
        _, out = d.result()
    merged = p["meta_info"]["input_token_logprobs"] + out["meta_info"]["input_token_logprobs"]
    assert merged == ref["meta_info"]["input_token_logprobs"]
    assert out["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]


def test_fake_bootstrap_host_needs_no_prefill(trio) -> None:
    decode = trio[2]
    body = greedy("warm", 4, bootstrap_host="2.2.2.2", bootstrap_room=0)
    status, out = post(f"{decode.url}/generate", body)
    assert status == 200 and len(out["output_ids"]) == 4


def test_seeded_sampling_through_pd_equals_without(trio) -> None:
    """SGLang draws a seeded token from a hash of (sampling_seed, position), so which engine drew
    the earlier tokens does not matter: PD output equals non-PD output for the same seed (the sim
    once kept one generator per request, so the decode's draws started over)."""
    regular = trio[0]
    for i, seed in enumerate((7, 1234, 99991)):
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "temperature": 1.0,
                                                                "sampling_seed": seed}}  # fmt: skip
        status, ref = post(f"{regular.url}/generate", body)
        assert status == 200
        status, out = pd_generate(trio, body, room=5000 + i)
        assert status == 200 and out["output_ids"] == ref["output_ids"], seed
    body["sampling_params"]["sampling_seed"] = 8  # and the seed still matters
    assert post(f"{regular.url}/generate", body)[1]["output_ids"] != ref["output_ids"]


def test_decode_gives_up_on_a_dead_prefill_after_its_heartbeats(trio) -> None:
    """SGLang's decode heartbeats each prefill's bootstrap server and fails the rooms of one that
    stops answering (2 checks 5 s apart): a decode whose prefill died answers 500 in seconds
    instead of holding the request (and a router draining for a weight push) for 300 s."""
    decode = trio[2]
    dead = free_port()  # nothing listens here: a prefill that was killed
    body = greedy("orphan", 4, bootstrap_host="127.0.0.1", bootstrap_port=dead, bootstrap_room=77)
    status, out = post(f"{decode.url}/generate", body, timeout=120)
    assert status == 500, out
    assert "Lost connection with prefill instance" in json.dumps(out) and f"127.0.0.1:{dead}" in json.dumps(out)
    # the reserved slot went back: a healthy PD request still runs
    status, out = pd_generate(trio, greedy("after", 4), room=78)
    assert status == 200 and len(out["output_ids"]) == 4
    # the verdict is per prefill, as SGLang's: every other room of the lost server fails after
    # one failed check (rooms queued behind a dead prefill each held a decode slot for a
    # heartbeat period: a kill -9 under bench_serving stalled the decode for minutes)
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda room: post(f"{decode.url}/generate", {**body, "bootstrap_room": room}, timeout=120),
                range(100, 108),
            )
        )
    for status, out in answers:
        assert status == 500, out
        assert "the server was lost earlier" in json.dumps(out) and f"127.0.0.1:{dead}" in json.dumps(out)


def test_batches_that_together_exceed_the_decode_slots_all_finish(tmp_path) -> None:
    """Three batches of 4 items on a decode with 4 slots: each item runs as soon as its KV came,
    so no batch holds slots while it waits for more (before, they could each hold some and wait
    for the rest for ever: a weight update that aborted and resent several large batches wedged
    the decode)."""
    from tests.helpers import sims

    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--max-running-requests", "4", "--sim-decode-ms-per-step", "5"),
    ) as (prefill, decode):
        trio = (None, prefill, decode)
        body = {"text": PROMPTS[:4], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        with cf.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda i: pd_generate(trio, body, room=9000 + 10 * i, batch=4), range(3)))
        assert all(status == 200 and len(items) == 4 for status, items in outs), outs
        status, info = post(decode.url + "/flush_cache")  # nothing left running or reserved
        assert status == 200, info


def test_an_abort_pause_aborts_a_decode_request_still_waiting_for_its_kv(tmp_path) -> None:
    """SGLang's abort of all requests (a ``/pause_generation`` in abort mode: a weight update's)
    aborts its decode prealloc and transfer queues too (scheduler.py ``abort_request``): a request
    whose KV is still on its way, computed on the weights before the update, must not run on
    after the pause. Found by AReaL's client, once under load: a rollout on the new version whose
    first token came from the old weights."""
    from tests.helpers import eventually, sims

    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill", "--sim-prefill-ms-per-token", "20"),
        ("--disaggregation-mode", "decode", "--enable-pd-role-switch"),  # its idle check shows the wait
    ) as (prefill, decode):
        wire = pd_body({"text": "x" * 200, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, prefill,
                       room=777)  # fmt: skip
        with cf.ThreadPoolExecutor(2) as pool:
            d = pool.submit(post, f"{decode.url}/generate", wire)
            probe = {"new_role": "prefill", "prepare_only": True}  # SGLang's idle check, no switch

            def waiting() -> bool:
                return "not idle" in str(post(decode.url + "/pd_role_switch", probe)[1])

            eventually(waiting, 30, what="the decode request waiting for its KV")
            p = pool.submit(post, f"{prefill.url}/generate", wire)
            assert post(decode.url + "/pause_generation", {"mode": "abort"})[0] == 200
            assert post(decode.url + "/continue_generation", {})[0] == 200
            assert p.result()[0] == 200, p.result()
            _, out = d.result()
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out
        assert out["meta_info"]["completion_tokens"] == 0, out


def test_a_health_probe_on_a_decode_whose_slots_all_wait_for_kv_blocks_nothing(tmp_path) -> None:
    """SGLang's decode takes every request through its prealloc queue, the health probe's (fake
    bootstrap host) too: a probe that arrives while every slot is reserved for KV on its way
    waits for a slot like any other. The sim used to queue the probe without a slot, ahead of
    the reserved requests, which then could not be admitted behind it: the decode ran nothing
    until the probe timed out (503). Found by the planner benchmark: decodes of a long-prompt
    phase stood still for seconds at a time, 17 queued and 0 running, while the prefills idled."""
    from tests.helpers import eventually, get, sims

    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--max-running-requests", "2"),
    ) as (prefill, decode):
        trio = (None, prefill, decode)
        # 2 running slots and 4 for KV on its way: 6 rooms take them all
        wires = [pd_body(greedy(p, 8), prefill, room=4100 + i) for i, p in enumerate(PROMPTS[:6])]

        def state() -> dict:
            return get(decode.url + "/server_info")[1]["internal_states"][0]

        with cf.ThreadPoolExecutor(8) as pool:
            decodes = [pool.submit(post, f"{decode.url}/generate", w) for w in wires]  # every slot waits for KV
            eventually(lambda: state()["num_reserved_decode_slots"] == 6, 30, what="every slot reserved")
            health = pool.submit(get, decode.url + "/health")
            eventually(lambda: state()["num_decode_prealloc_queue_reqs"] + state()["num_queue_reqs"] >= 1, 30,
                       what="the probe waiting at the decode")  # fmt: skip
            for w in wires:
                assert post(f"{prefill.url}/generate", w)[0] == 200
            outs = [d.result() for d in decodes]
            assert health.result()[0] == 200, health.result()
        assert all(s == 200 and o["meta_info"]["completion_tokens"] == 8 for s, o in outs), outs
        assert pd_generate(trio, greedy(PROMPTS[2], 8), room=4102)[0] == 200


def test_a_prefill_starts_a_room_only_once_its_decode_has_a_slot_for_it(tmp_path) -> None:
    """SGLang's prefill keeps a request in its bootstrap queue until the decode has preallocated
    for it; the sim's prefill waits for the decode's first ask for the room's KV, which comes
    once the decode holds the room's slot. A prefill leg alone waits, counted in
    ``sglang:num_prefill_prealloc_queue_reqs``, and runs as soon as the decode leg comes; one
    whose decode never comes fails after SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, naming it."""
    from tests.helpers import eventually, get, sims

    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill", "--enable-metrics"),
        ("--disaggregation-mode", "decode"),
    ) as (prefill, decode):
        wire = pd_body(greedy(PROMPTS[0], 8), prefill, room=5100)

        def waiting() -> int:
            return get(prefill.url + "/server_info")[1]["internal_states"][0]["num_prefill_prealloc_queue_reqs"]

        with cf.ThreadPoolExecutor(2) as pool:
            p = pool.submit(post, f"{prefill.url}/generate", wire)
            eventually(lambda: waiting() == 1, 30, what="the prefill leg in the bootstrap queue")
            metrics = get(prefill.url + "/metrics")[1]
            assert "sglang:num_prefill_prealloc_queue_reqs" in metrics, metrics
            assert not p.done()
            d = pool.submit(post, f"{decode.url}/generate", wire)
            assert p.result()[0] == 200 and d.result()[0] == 200, (p.result(), d.result())
        assert d.result()[1]["meta_info"]["completion_tokens"] == 8
        assert waiting() == 0


def test_a_prefill_leg_whose_decode_never_asks_fails_after_the_bootstrap_timeout(tmp_path) -> None:
    from tests.helpers import SimProcess

    prefill = SimProcess(
        tmp_path, "--disaggregation-mode", "prefill", env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"}
    ).start()
    try:
        status, out = post(f"{prefill.url}/generate", pd_body(greedy(PROMPTS[0], 8), prefill, room=5200))
        assert status == 500, (status, out)
        assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in out["error"]["message"], out
        assert "bootstrap_room 5200" in out["error"]["message"], out
    finally:
        prefill.stop()


def test_a_decode_holds_twice_its_running_slots_more_for_kv_on_its_way(tmp_path) -> None:
    """SGLang's decode pool holds ``2 x --max-running-requests`` requests whose KV is on its way
    beyond the running ones (up to 32 running): with 2 running slots, 6 rooms reserve at once and
    the 7th waits in the prealloc queue; all 7 then run, 2 at a time. (The sim used to share the
    running slots with the transfers: a decode whose prefills were slow ran half empty.)"""
    from tests.helpers import eventually, get, sims

    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--max-running-requests", "2"),
    ) as (prefill, decode):
        wires = [pd_body(greedy(PROMPTS[i % len(PROMPTS)], 8), prefill, room=5300 + i) for i in range(7)]

        def state() -> dict:
            return get(decode.url + "/server_info")[1]["internal_states"][0]

        with cf.ThreadPoolExecutor(14) as pool:
            decodes = [pool.submit(post, f"{decode.url}/generate", w) for w in wires]
            seen = eventually(
                lambda: (
                    (s := state())["num_reserved_decode_slots"] == 6 and s["num_decode_prealloc_queue_reqs"] == 1 and s
                ),
                30,
                what=lambda: f"6 reserved and 1 in the prealloc queue: {state()}",
            )
            assert seen["free_slots"] == 0 and seen["num_running_reqs"] == 0, seen
            prefills = [pool.submit(post, f"{prefill.url}/generate", w) for w in wires]
            outs = [d.result() for d in decodes]
            assert all(p.result()[0] == 200 for p in prefills)
        assert all(s == 200 and o["meta_info"]["completion_tokens"] == 8 for s, o in outs), outs
        assert state()["num_reserved_decode_slots"] == 0
