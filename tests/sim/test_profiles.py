"""GPU cost profiles (``--sim-profile``): each reproduces the published figures it cites, and a
real profile engine waits what its profile says, reports its prefix cache as SGLang does and
queues requests its KV pool cannot hold."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from pdctl.gpu_profiles import PROFILES, Metric, SimProfile
from pdctl.topology import load_topology_text
from tests.helpers import RouterProcess, SimProcess, eventually, eventually_async, get, pd_router_args, post, sims

TOLERANCE = 0.15


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_each_profile_reproduces_its_published_figures(profile: SimProfile) -> None:
    """At least two published figures per profile, every one within 15% (the cost model's
    arithmetic, no clock: a figure the constants drift away from fails here)."""
    assert len(profile.figures) >= 2, profile.name
    assert any(f.metric in (Metric.DECODE_STEP_MS, Metric.DECODE_TOKENS_PER_S) for f in profile.figures)
    for figure in profile.figures:
        predicted = profile.predict(figure)
        assert abs(predicted - figure.value) <= TOLERANCE * figure.value, (figure.conditions, predicted)
        assert figure.source and figure.conditions


def test_the_cost_model_grows_as_a_gpu_does() -> None:
    p = PROFILES["llama3-8b-h100"]
    assert p.decode_step_ms(64, 64 * 2048) > p.decode_step_ms(64, 64 * 128) > p.decode_step_ms(1, 128)
    assert p.prefill_ms([(4096, 0)]) > 2 * p.prefill_ms([(2048, 0)]) * 0.99  # attention: more than linear
    assert p.prefill_ms([(100, 4000)]) < p.prefill_ms([(4100, 0)]) / 10  # a cached prefix is not recomputed
    assert p.prefill_ms([(20_000, 0)]) > p.prefill_ms([(8192, 0)])  # several chunks, several forwards
    assert p.transfer_ms(2048) == pytest.approx(2048 * 131072 / 24e9 * 1000)


def test_list_profiles_and_an_unknown_profile() -> None:
    listed = subprocess.run([sys.executable, "-m", "pdctl.sim", "--list-profiles"], capture_output=True, text=True)
    assert listed.returncode == 0 and all(name in listed.stdout for name in PROFILES)
    bad = subprocess.run(
        [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--sim-profile", "gpt-9"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown sim profile 'gpt-9'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_topology_names_a_profile_and_validate_refuses_an_unknown_one() -> None:
    base = "name: t\nengine: sim\nmodel: {path: 'sim://tiny'}\nnodes: [{name: n, host: 127.0.0.1, gpus: 2}]\n"
    top, _ = load_topology_text(base + "prefill: {args: {sim-profile: llama3-8b-h100}}\ndecode: {}\n")
    assert top.groups[0].args["sim-profile"] == "llama3-8b-h100"
    with pytest.raises(Exception, match="unknown sim profile 'gpt-9'"):
        load_topology_text(base + "prefill: {args: {sim-profile: gpt-9}}\ndecode: {}\n")


def generate(url: str, ids: list[int], new: int) -> tuple[float, dict]:
    started = time.monotonic()
    status, body = post(url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": new}})
    assert status == 200, body
    return time.monotonic() - started, body


def test_a_profile_engine_waits_its_costs_and_reports_its_prefix_cache(tmp_path) -> None:
    """Time only from below (a wait is never shorter than asked; a loaded machine only adds):
    a 4,000-token prompt takes at least its modelled prefill, its repeat is served from the
    prefix cache (``cached_tokens`` as SGLang reports it), and every output runs to
    ``max_new_tokens`` at no less than a decode step per token."""
    profile = PROFILES["llama3-8b-h100"]
    sim = SimProcess(tmp_path, "--sim-profile", profile.name, "--enable-metrics").start()
    try:
        prompt = [i % 250 for i in range(4000)]
        secs, body = generate(sim.url, prompt, 1)
        assert secs >= profile.prefill_ms([(3990, 0)]) / 1000
        _, again = generate(sim.url, prompt, 1)
        assert again["meta_info"]["cached_tokens"] == 3999  # all but the last token, as SGLang
        assert again["meta_info"]["prompt_tokens"] == 4000
        secs, body = generate(sim.url, [7, 8, 9], 50)
        assert body["meta_info"]["completion_tokens"] == 50 and body["meta_info"]["cached_tokens"] == 0
        assert secs >= 49 * profile.decode_step_ms(1, 3) / 1000
        info = get(sim.url + "/server_info")[1]
        assert info["max_total_num_tokens"] == profile.kv_pool_tokens
        load = get(sim.url + "/v1/loads")[1]["loads"][0]
        assert load["max_running_requests"] == profile.max_running_requests
        assert load["num_used_tokens"] > 4000 and load["cache_hit_rate"] > 0.4, load
    finally:
        sim.stop()


def test_flush_cache_is_refused_while_a_request_is_still_prefilled(tmp_path) -> None:
    """SGLang refuses a cache flush while any request is in the engine: one still in its
    prefill counts (it is in ``num_running_reqs``), not only one that decodes."""
    sim = SimProcess(tmp_path, "--sim-profile", "llama3-70b-h100-tp4").start()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(generate, sim.url, [i % 250 for i in range(30_000)], 1)  # 2.5 s of prefill

            def prefilling() -> bool:
                assert not fut.done(), fut.result()
                return get(sim.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 1

            eventually(prefilling, 60, interval=0.01, what="the long prompt in its prefill")
            status, _ = post(sim.url + "/flush_cache")
            assert not fut.done()  # (still in its prefill at the flush: the check above means something)
            assert status == 400
            assert fut.result()[1]["meta_info"]["completion_tokens"] == 1
        assert post(sim.url + "/flush_cache")[0] == 200
    finally:
        sim.stop()


def test_a_full_kv_pool_queues_requests_and_says_so(tmp_path) -> None:
    """A pool of 1,500 tokens holds two requests of 100 + 600 tokens, not three: the third
    waits in the queue (num_queue_reqs, /v1/loads), starts when one ends, and all finish."""
    sim = SimProcess(
        tmp_path, "--sim-profile", "llama3-8b-h100", "--max-total-tokens", "1500", "--disable-radix-cache"
    ).start()
    try:

        async def three() -> list[int]:
            async with aiohttp.ClientSession() as session:

                async def one(i: int) -> int:
                    body = {"input_ids": [i + 1] * 100, "sampling_params": {"max_new_tokens": 600}}
                    async with session.post(sim.url + "/generate", json=body) as r:
                        return (await r.json())["meta_info"]["completion_tokens"]

                tasks = [asyncio.ensure_future(one(i)) for i in range(3)]

                def queued() -> dict | None:
                    load = get(sim.url + "/v1/loads")[1]["loads"][0]
                    return load if load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 1 else None

                load = await eventually_async(queued, 60, interval=0.02, what="two running, one queued")
                assert load["token_usage"] > 0.9, load
                return await asyncio.gather(*tasks)

        assert asyncio.run(three()) == [600, 600, 600]
        eventually(lambda: get(sim.url + "/v1/loads")[1]["loads"][0]["num_used_tokens"] == 0, 30)
    finally:
        sim.stop()


def test_a_pd_pair_of_profile_engines_serves_through_the_router_and_costs_the_transfer(tmp_path) -> None:
    """A profile prefill and decode behind pdctl's router: the decode waits the KV's modelled
    transfer (its bytes over the link, shown by SGLang's transfer metrics), the answer runs to
    max_new_tokens, and the prefill caches the prompt for the next request that shares it."""
    profile = PROFILES["llama3-70b-h100-tp4"]
    args = ("--sim-profile", profile.name, "--enable-metrics")
    with sims(tmp_path, ("--disaggregation-mode", "prefill", *args), ("--disaggregation-mode", "decode", *args)) as (
        prefill,
        decode,
    ):
        router = RouterProcess(tmp_path, *pd_router_args([prefill], [decode])).start("/readiness")
        try:
            prompt = [i % 250 for i in range(3000)]
            secs, body = generate(router.url, prompt, 20)
            assert body["meta_info"]["completion_tokens"] == 20
            modelled = (
                profile.prefill_ms([(3000, 0)]) + profile.transfer_ms(3000) + 19 * profile.decode_step_ms(1, 3000)
            )
            assert secs >= modelled / 1000, (secs, modelled)
            with urllib.request.urlopen(decode.url + "/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
            speed = next(line for line in metrics.splitlines() if line.startswith("sglang:kv_transfer_speed_gb_s{"))
            assert 0 < float(speed.split()[-1]) <= profile.link_gbytes_per_s  # the modelled bytes, never faster
            _, again = generate(router.url, prompt[:2000] + [7] * 10, 2)
            assert again["meta_info"]["completion_tokens"] == 2
            assert get(prefill.url + "/v1/loads")[1]["loads"][0]["cache_hit_rate"] > 0.3
        finally:
            router.stop()


def test_a_profile_engines_graph_capture_can_be_set_and_only_a_profile_engine_takes_it(capsys) -> None:
    """``--sim-graph-capture-secs`` replaces the profile's capture time (tests and what-ifs: a GPU
    whose capture is shorter); without a profile, or below 0, it is refused as a bad flag (exit 2)."""
    import pytest

    from pdctl.sim.__main__ import config_from_argv

    base = ["--model-path", "sim://tiny", "--sim-profile", "llama3-8b-h100"]
    profile = config_from_argv(base).profile
    assert profile is not None and profile.graph_capture_secs == PROFILES["llama3-8b-h100"].graph_capture_secs
    changed = config_from_argv([*base, "--sim-graph-capture-secs", "1.5"]).profile
    assert changed is not None and changed.graph_capture_secs == 1.5
    assert changed.kv_pool_tokens == profile.kv_pool_tokens
    for argv, said in (
        (["--model-path", "sim://tiny", "--sim-graph-capture-secs", "1"], "only a --sim-profile engine"),
        ([*base, "--sim-graph-capture-secs", "-1"], "must be >= 0"),
    ):
        with pytest.raises(SystemExit) as exited:
            config_from_argv(argv)
        assert exited.value.code == 2 and said in capsys.readouterr().err
