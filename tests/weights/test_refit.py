"""Refit ``interrupt`` (pdctl.refit): an update stops in-flight requests at a token boundary and the
router continues them on the new weights, with real sims (PD; a bare regular sim is the reference),
a real router, real ``Fleet`` transactions (``/update_weights_from_disk`` of a second checkpoint)
and real trainer pushes over gloo.

Greedy exactness is checked against bare reference sims: an interrupted answer whose spans are
``[[A, k], [B, m]]`` must equal A's greedy output for k tokens followed by B's greedy
continuation of prompt + those k tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from pathlib import Path

import pytest

from pdctl.sim.model import encode, resolve_model, save_checkpoint
from pdctl.weights.fleet import Fleet
from tests.helpers import RouterProcess, eventually, get, pd_router_args, post, sims, sse

TOKENS = 160
PROMPTS = ["The interrupted rollout", "Another prompt, longer than the first one"]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "b"
    save_checkpoint(resolve_model("sim://tiny?seed=9", "auto", None), path)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A PD fleet (prefill, decode at 10 ms a step, so that rollouts are in flight for a while)
    behind the router, and a bare reference sim (A's weights; B loaded into it on demand)."""
    tmp = tmp_path_factory.mktemp("refit")
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--sim-decode-ms-per-step", "10"),
        (),
    ]
    with sims(tmp, *specs) as procs:
        router = RouterProcess(tmp, *pd_router_args(procs[:1], procs[1:2], "--health-check-interval-secs", "1"))
        router.start("/readiness")
        try:
            yield procs[0], procs[1], procs[2], router
        finally:
            router.stop()


def _greedy(url: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    status, out = post(
        url + "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert status == 200, out
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _running(url: str) -> int:
    return sum(s.get("num_running_reqs", 0) for s in get(url + "/server_info")[1]["internal_states"])


def _wait_running(url: str, count: int) -> None:
    """Wait until the engine runs ``count`` requests (their first tokens are out)."""
    eventually(lambda: _running(url) >= count, 60, interval=0.02, what=f"{count} requests running on {url}")


def _request(prompt: str, as_ids: bool, stream: bool) -> dict:
    body = {
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": stream,
    }
    body["input_ids" if as_ids else "text"] = encode(prompt) if as_ids else prompt
    return body


def _final_of_stream(url: str, body: dict) -> dict:
    """The last data event of a stream, checked to be cumulative and uninterrupted."""
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
            elif line == b"data: [DONE]":
                break
    assert not [e for e in events if "error" in e], events[-1]
    counts = [len(e["output_ids"]) for e in events]
    assert counts == sorted(counts), "a continued stream goes on where it stopped"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    return events[-1]


def test_an_interrupted_request_is_as_greedy_as_two_bare_engines(fleet, checkpoint_b) -> None:
    prefill, decode, reference, router = fleet
    cases = [(p, as_ids, stream) for p in PROMPTS for as_ids in (False, True) for stream in (False, True)]
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        futures = [
            pool.submit(
                _final_of_stream if stream else lambda u, b: post(u, b, timeout=120)[1],
                router.url + "/generate",
                _request(prompt, as_ids, stream),
            )
            for prompt, as_ids, stream in cases
        ]
        _wait_running(decode.url, len(cases))
        fleet_ = Fleet([prefill.url, decode.url], router_url=router.url, refit="interrupt")
        try:
            report = fleet_.load_from_disk(str(checkpoint_b), "B")
        finally:
            fleet_.close()
        answers = [f.result() for f in futures]
    assert report.refit == "interrupt" and sorted(report.engines) == ["engine-0", "engine-1"]

    ref_a = {p: _greedy(reference.url, encode(p), TOKENS) for p in PROMPTS}
    status, out = post(reference.url + "/update_weights_from_disk", {"model_path": str(checkpoint_b)})
    assert status == 200, out
    interrupted = 0
    for (prompt, _, _), answer in zip(cases, answers, strict=True):
        meta = answer["meta_info"]
        ids = answer["output_ids"]
        assert len(ids) == TOKENS and meta["completion_tokens"] == TOKENS
        assert len(meta["output_token_logprobs"]) == TOKENS
        spans = meta.get("weight_version_spans") or [
            [s["version"], s["end"] - s["start"]] for s in meta["weight_versions"]
        ]
        assert sum(n for _, n in spans) == TOKENS, spans
        assert meta["weight_version"] == spans[-1][0]
        a_ids, a_lps = ref_a[prompt]
        if len(spans) == 1:  # finished before the update or started after it
            continue
        interrupted += 1
        assert [v for v, _ in spans] == ["default", "B"], spans
        k = spans[0][1]
        assert ids[:k] == a_ids[:k]
        b_ids, b_lps = _greedy(reference.url, encode(prompt) + ids[:k], TOKENS - k)
        assert ids[k:] == b_ids
        lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert lps[:k] == pytest.approx(a_lps[:k], abs=1e-3)
        assert lps[k:] == pytest.approx(b_lps, abs=1e-3)
        assert meta["finish_reason"] == {"type": "length", "length": TOKENS}  # the client's budget, not the rest
        assert meta["pdctl_interruptions"] == 1
    assert interrupted == len(cases), "every request was in flight when the update began"


def _answers_of_stream(url: str, body: dict) -> tuple[int, list[dict]]:
    """A batch's stream as its answers (the final event of each index), checked to be one
    well-formed SGLang batch stream: cumulative per index, nothing after an index's final event,
    no error, one [DONE] at the end."""
    events = sse(url, body, timeout=120)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
    finals: dict[int, dict] = {}
    counts: dict[int, int] = {}
    for event in events[:-1]:
        assert "error" not in event, event
        index = event["index"]
        assert index not in finals, f"answer {index} went on after its final event"
        assert len(event["output_ids"]) >= counts.get(index, 0), "a continued answer goes on where it stopped"
        counts[index] = len(event["output_ids"])
        if event["meta_info"]["finish_reason"] is not None:
            finals[index] = event
    return 200, [finals[k] for k in sorted(finals)]


def test_batches_and_n_are_continued_item_by_item(fleet, checkpoint_b, tmp_path) -> None:
    """A batch of two prompts, and one prompt with n=2, both interrupted, streamed and not:
    every answer is whole."""
    prefill, decode, _, router = fleet
    # Back to A's weights under another name, so that this update changes the weights again.
    save_checkpoint(resolve_model("sim://tiny", "auto", None), tmp_path / "a")
    sampling = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    bodies = [
        {"text": PROMPTS, "sampling_params": sampling},
        {"input_ids": encode(PROMPTS[0]), "sampling_params": {**sampling, "n": 2}},
        {"input_ids": [encode(p) for p in PROMPTS], "sampling_params": sampling, "stream": True},
        {"text": PROMPTS[1], "sampling_params": {**sampling, "n": 2}, "stream": True},
    ]
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [
            pool.submit(_answers_of_stream, router.url + "/generate", b)
            if b.get("stream")
            else pool.submit(post, router.url + "/generate", b, timeout=120)
            for b in bodies
        ]
        _wait_running(decode.url, 2 * len(bodies))
        fleet_ = Fleet([prefill.url, decode.url], router_url=router.url, refit="interrupt")
        try:
            fleet_.load_from_disk(str(tmp_path / "a"), "A2")
        finally:
            fleet_.close()
        results = [f.result() for f in futures]
    for status, items in results:
        assert status == 200 and isinstance(items, list) and len(items) == 2, items
        for item in items:
            spans = item["meta_info"]["weight_version_spans"]
            assert [v for v, _ in spans][-1] == "A2" and len(spans) == 2, spans
            assert sum(n for _, n in spans) == len(item["output_ids"]) == TOKENS
    # Two greedy samples stopped after the same number of tokens continue alike (stopped at
    # different points, each continues B's greedy path from its own prefix).
    for _, (first, second) in (results[1], results[3]):
        if first["meta_info"]["weight_version_spans"] == second["meta_info"]["weight_version_spans"]:
            assert first["output_ids"] == second["output_ids"]


def test_max_staleness_zero_finishes_an_interrupted_request_with_its_tokens(fleet, checkpoint_b) -> None:
    prefill, decode, _, router = fleet
    body = _request(PROMPTS[0], True, False)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(answer=post(router.url + "/generate", body, timeout=120)))
    worker.start()
    _wait_running(decode.url, 1)
    fleet_ = Fleet([prefill.url, decode.url], router_url=router.url, refit="interrupt", max_staleness=0)
    try:
        fleet_.load_from_disk(str(checkpoint_b), "B-stale")
    finally:
        fleet_.close()
    worker.join()
    status, answer = box["answer"]
    assert status == 200
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "stale" and meta["finish_reason"]["max_staleness"] == 0
    assert 0 < len(answer["output_ids"]) < TOKENS == body["sampling_params"]["max_new_tokens"]
    assert len(meta["weight_version_spans"]) == 1 and meta["weight_version_spans"][0][0] != "B-stale"


def test_under_load_several_updates_in_a_row_fail_no_request(fleet, checkpoint_b, tmp_path) -> None:
    """Clients keep sending (streamed and not) while four interrupt updates run back to back, two
    of them trainer pushes over a real gloo group and two loads from disk, with max_staleness 1."""
    from pdctl.weights import WeightSync

    prefill, decode, _, router = fleet
    save_checkpoint(resolve_model("sim://tiny", "auto", None), tmp_path / "a")
    models = {"A": resolve_model("sim://tiny", "auto", None), "B": resolve_model("sim://tiny?seed=9", "auto", None)}
    stop = threading.Event()
    answers: list[tuple[bool, int, dict]] = []

    def client(i: int) -> None:
        while not stop.is_set():
            body = _request(PROMPTS[i % 2], True, i % 2 == 0)
            body["sampling_params"]["max_new_tokens"] = 60
            if body["stream"]:
                answers.append((True, 200, _final_of_stream(router.url + "/generate", body)))
            else:
                status, out = post(router.url + "/generate", body, timeout=120)
                answers.append((False, status, out))

    sync = WeightSync(
        [{"id": "p", "url": prefill.url}, {"id": "d", "url": decode.url}],
        master_address="127.0.0.1",
        master_port=_free_port(),
        router_url=router.url,
        refit="interrupt",
        max_staleness=1,
        bucket_mb=1,
    )
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        sync.connect()
        _wait_running(decode.url, 4)
        sync.push(list(models["B"].named_parameters()), version="push-B")
        sync.load_from_disk(str(tmp_path / "a"), "disk-A")
        sync.push(list(models["B"].named_parameters()), version="push-B2")
        sync.load_from_disk(str(tmp_path / "a"), "disk-A2")
    finally:
        stop.set()
        for t in threads:
            t.join()
        sync.close()
    assert len(answers) >= 8
    interrupted = 0
    for streamed, status, answer in answers:
        assert status == 200, answer
        meta = answer["meta_info"]
        spans = meta.get("weight_version_spans") or [
            [s["version"], s["end"] - s["start"]] for s in meta["weight_versions"]
        ]
        assert sum(n for _, n in spans) == len(answer["output_ids"]), (streamed, spans)
        assert len(spans) <= 2, spans  # max_staleness 1: at most two versions
        if meta["finish_reason"]["type"] == "stale":
            assert meta["pdctl_interruptions"] >= 2
        else:
            assert len(answer["output_ids"]) == 60 and meta["finish_reason"]["type"] == "length", (streamed, meta)
        interrupted += len(spans) > 1
    assert interrupted > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_decode_killed_during_a_continuation_hands_it_to_another_decode(tmp_path, checkpoint_b) -> None:
    """The decode-death rule inside an interrupted request: its continuation on B moves to the other
    decode on B, and the client still gets one exact stream."""
    import os
    import signal

    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode", "--sim-decode-ms-per-step", "10"),
        ("--disaggregation-mode", "decode", "--sim-decode-ms-per-step", "10"),
        (),
    ]
    with sims(tmp_path, *specs) as procs:
        prefill, decodes, reference = procs[0], procs[1:3], procs[3]
        router = RouterProcess(tmp_path, *pd_router_args([prefill], decodes, "--health-check-interval-secs", "1"))
        router.start("/readiness")
        try:
            body = _request(PROMPTS[1], True, True)
            with cf.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(_final_of_stream, router.url + "/generate", body)
                eventually(
                    lambda: sum(_running(d.url) for d in decodes) >= 1, 60, interval=0.02, what="a decode running"
                )
                fleet_ = Fleet([prefill.url, *(d.url for d in decodes)], router_url=router.url, refit="interrupt")
                try:
                    fleet_.load_from_disk(str(checkpoint_b), "B")
                finally:
                    fleet_.close()
                serving = eventually(
                    lambda: [d for d in decodes if _running(d.url)], 60, interval=0.02, what="a decode serving"
                )
                assert serving[0].proc is not None
                os.killpg(serving[0].proc.pid, signal.SIGKILL)
                final = answer.result()
            metrics = get(router.url + "/metrics")[1]
        finally:
            router.stop()
        assert 'reason="stream_resumed"' in metrics, "the decode died mid-continuation"
        meta = final["meta_info"]
        assert [v for v, _ in meta["weight_version_spans"]] == ["default", "B"], meta["weight_version_spans"]
        k = meta["weight_version_spans"][0][1]
        ids = final["output_ids"]
        assert len(ids) == TOKENS and meta["finish_reason"]["type"] == "length"
        assert ids[:k] == _greedy(reference.url, encode(PROMPTS[1]), k)[0]
        post(reference.url + "/update_weights_from_disk", {"model_path": str(checkpoint_b)})
        assert ids[k:] == _greedy(reference.url, encode(PROMPTS[1]) + ids[:k], TOKENS - k)[0]


def test_an_interrupted_openai_completion_is_redone_whole_on_the_new_weights(fleet, tmp_path) -> None:
    """The OpenAI routes are not continued token by token; a non-streamed completion has reached
    no client when it is interrupted, so it is sent again whole and comes from one version."""
    prefill, decode, _, router = fleet
    save_checkpoint(resolve_model("sim://tiny?seed=4", "auto", None), tmp_path / "c")
    body = {"model": "sim-tiny", "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0}
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(answer=post(router.url + "/v1/completions", body, timeout=120)))
    worker.start()
    _wait_running(decode.url, 1)
    fleet_ = Fleet([prefill.url, decode.url], router_url=router.url, refit="interrupt")
    try:
        fleet_.load_from_disk(str(tmp_path / "c"), "C")
    finally:
        fleet_.close()
    worker.join()
    status, answer = box["answer"]
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] == TOKENS
    assert answer["metadata"]["weight_version"] == "C" and len(answer["metadata"]["weight_versions"]) == 1


def test_regular_engines_continue_streams_and_batches_exactly(tmp_path, checkpoint_b) -> None:
    """Without PD the router continues interrupted answers on the regular engines too: a single
    stream, a streamed batch and a non-streamed batch, each exactly A's greedy tokens then B's
    greedy continuation of its prefix (a bare sim is the reference)."""
    with sims(tmp_path, ("--sim-decode-ms-per-step", "10"), ()) as (engine, reference):
        router = RouterProcess(tmp_path, "--worker-urls", engine.url, "--health-check-interval-secs", "1")
        router.start("/readiness")
        try:
            ids = [encode(p) for p in PROMPTS]
            sampling = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            jobs = [
                (_final_of_stream, {"input_ids": ids[0], "sampling_params": sampling, "stream": True}),
                (_answers_of_stream, {"input_ids": ids, "sampling_params": sampling, "stream": True}),
                (lambda u, b: post(u, b, timeout=120), {"input_ids": ids, "sampling_params": sampling}),
            ]
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                futures = [pool.submit(call, router.url + "/generate", body) for call, body in jobs]
                _wait_running(engine.url, 5)
                fleet_ = Fleet([engine.url], router_url=router.url, refit="interrupt")
                try:
                    fleet_.load_from_disk(str(checkpoint_b), "B")
                finally:
                    fleet_.close()
                single = futures[0].result()
                streamed = futures[1].result()[1]
                status, whole = futures[2].result()
        finally:
            router.stop()
        assert status == 200, whole
        answers = [(ids[0], single), *zip(ids, streamed, strict=True), *zip(ids, whole, strict=True)]
        ref_a = {tuple(p): _greedy(reference.url, p, TOKENS)[0] for p in ids}
        post(reference.url + "/update_weights_from_disk", {"model_path": str(checkpoint_b)})
        for prompt, answer in answers:
            spans = answer["meta_info"]["weight_version_spans"]
            assert [v for v, _ in spans] == ["default", "B"], spans
            k, out = spans[0][1], answer["output_ids"]
            assert len(out) == TOKENS and answer["meta_info"]["completion_tokens"] == TOKENS
            assert out[:k] == ref_a[tuple(prompt)][:k]
            assert out[k:] == _greedy(reference.url, prompt + out[:k], TOKENS - k)[0]


def test_an_engine_back_after_a_push_waits_out_of_rotation_for_the_next_push(tmp_path) -> None:
    """The version rule after a trainer's push: a decode that comes back (killed, started again
    on its port, as its node's supervisor does) holds the model's initial weights; the router
    keeps it out of rotation, no answer comes from it, and the next push (whose group is rebuilt
    for the restarted engine) brings it back."""
    import os
    import signal

    from pdctl.weights import WeightSync
    from tests.helpers import SimProcess

    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode"),
        ("--disaggregation-mode", "decode"),
    ]
    with sims(tmp_path, *specs) as (prefill, d1, d2):
        router = RouterProcess(tmp_path, *pd_router_args([prefill], [d1, d2], "--health-check-interval-secs", "1"))
        router.start("/readiness")
        engines = [{"id": "p", "url": prefill.url}, {"id": "d1", "url": d1.url}, {"id": "d2", "url": d2.url}]
        sync = WeightSync(engines, master_address="127.0.0.1", master_port=_free_port(), router_url=router.url)
        model = resolve_model("sim://tiny?seed=9", "auto", None)
        again = None
        try:
            sync.connect()
            sync.push(list(model.named_parameters()), version="push-1")
            assert d2.proc is not None
            os.killpg(d2.proc.pid, signal.SIGKILL)
            d2.proc.wait()
            again = SimProcess(tmp_path, "--disaggregation-mode", "decode", port=d2.port).start()

            def kept_out() -> dict | None:  # the router sees it back, on the initial weights, and keeps it out
                worker = next(w for w in get(router.url + "/workers")[1]["workers"] if w["url"] == d2.url)
                return worker if worker["quarantined"] else None

            worker = eventually(kept_out, 30, what="the restarted decode quarantined")
            assert "next weight push" in worker["quarantined"] and worker["weight_version"] == "default"
            for i in range(12):
                status, out = post(
                    router.url + "/generate", {"text": f"r{i}", "sampling_params": {"max_new_tokens": 4}}
                )
                assert status == 200 and out["meta_info"]["weight_version"] == "push-1", out
            sync.push(list(model.named_parameters()), version="push-2")
            worker = next(w for w in get(router.url + "/workers")[1]["workers"] if w["url"] == d2.url)
            assert worker["quarantined"] is None and worker["weight_version"] == "push-2", worker
        finally:
            sync.close()
            router.stop()
            if again is not None:
                again.stop()


def test_a_trainer_following_the_router_pushes_to_engines_added_and_not_to_removed_ones(tmp_path) -> None:
    """`pdctl apply` adds and removes engines through the router; the trainer (WeightSync.from_env
    follows the router) learns the new set at its next push: the group is rebuilt over it."""
    from urllib.parse import quote

    from pdctl.weights import WeightSync
    from tests.helpers import http

    specs = [("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")]
    with sims(tmp_path, *specs, ("--disaggregation-mode", "decode", "--tp-size", "2")) as (prefill, d1, d2):
        router = RouterProcess(tmp_path, *pd_router_args([prefill], [d1], "--health-check-interval-secs", "1"))
        router.start("/readiness")
        sync = WeightSync(
            [{"id": "p", "url": prefill.url}, {"id": "d1", "url": d1.url}],
            master_address="127.0.0.1",
            master_port=_free_port(),
            router_url=router.url,
            follow_router=True,
        )
        model = resolve_model("sim://tiny?seed=9", "auto", None)
        try:
            sync.connect()
            assert post(router.url + "/workers", {"url": d2.url, "worker_type": "decode"})[0] == 202
            report = sync.push(list(model.named_parameters()), version="v-added")
            added = d2.url.split("://")[1]
            assert sorted(report.engines) == sorted(["p", "d1", added]), report.engines
            assert sync.group.members[-1].rank_offset == 3 and len(sync.fleet.engines) == 3  # p 1, d1 2, d2 3..4
            worker = next(w for w in get(router.url + "/workers")[1]["workers"] if w["url"] == d2.url)
            assert worker["weight_version"] == "v-added" and not worker["quarantined"]
            assert http("DELETE", router.url + "/workers/" + quote(d1.url, safe=""))[0] == 202
            report = sync.push(list(model.named_parameters()), version="v-removed")
            assert sorted(report.engines) == sorted(["p", added])
            assert get(d1.url + "/model_info")[1]["weight_version"] == "v-added", "a removed engine is left alone"
        finally:
            sync.close()
            router.stop()
