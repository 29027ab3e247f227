"""`pdctl bench` against real servers: the sim's latency model measured back, pdctl's router
and sglang-router 0.3.2 in front of PD sims, a pdctl cluster with its server view and weight
reloads, sweeps, plots, compare, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdctl.bench import BenchConfig, LoadPoint, run_bench
from pdctl.bench.workloads import fixed_workload
from pdctl.sim.model import PRESETS, TinyLM, save_checkpoint
from tests.helpers import (
    RouterProcess,
    free_port,
    free_port_base,
    local_topology,
    pd_router_args,
    pdctl,
    sglang_router,
    sims,
)

PREFILL_MS_PER_TOKEN = 1.0
DECODE_MS_PER_STEP = 30.0
INPUT_LEN, OUTPUT_LEN = 100, 12


def bench_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory):
    flags = ("--sim-prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN), "--sim-decode-ms-per-step",
             str(DECODE_MS_PER_STEP), "--enable-metrics")  # fmt: skip
    with sims(tmp_path_factory.mktemp("slow"), flags) as (sim,):
        yield sim


@pytest.mark.parametrize("api", ["generate", "completions", "chat"])
def test_measured_ttft_and_itl_match_the_sim_latency_model(slow_sim, api) -> None:
    config = BenchConfig(
        url=slow_sim.url,
        requests=tuple(fixed_workload(6, INPUT_LEN, OUTPUT_LEN, seed=3)),
        points=(LoadPoint(max_concurrency=1),),
        api=api,
        warmup=1,
    )
    run = run_bench(config)["runs"][0]
    assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
    assert run["output_token_mismatches"] == 0 and run["total_output_tokens"] == 6 * OUTPUT_LEN
    prefill_ms = INPUT_LEN * PREFILL_MS_PER_TOKEN
    if api == "chat":  # the chat template adds the role markers to the prompt
        prefill_ms = run["total_input_tokens"] / 6 * PREFILL_MS_PER_TOKEN
    else:
        assert run["input_token_mismatches"] == 0 and run["total_input_tokens"] == 6 * INPUT_LEN
    # The sim cannot answer faster than its latency model, so the bench's figures have hard floors;
    # no ceilings: a loaded machine only adds time (no timed assertions). A bench that measured
    # the wrong span (TTFT from the first byte, ITL across requests) falls below a floor or
    # breaks the spans' order.
    assert prefill_ms <= run["median_ttft_ms"] < run["median_e2e_latency_ms"], run
    assert run["median_itl_ms"] >= DECODE_MS_PER_STEP, run
    assert run["mean_tpot_ms"] >= DECODE_MS_PER_STEP, run
    expected_e2e = prefill_ms + (OUTPUT_LEN - 1) * DECODE_MS_PER_STEP
    assert expected_e2e <= run["median_e2e_latency_ms"], run
    assert run["median_e2e_latency_ms"] >= run["median_ttft_ms"] + (OUTPUT_LEN - 1) * DECODE_MS_PER_STEP, run
    assert abs(run["concurrency"] - 1.0) < 0.1  # closed loop of one


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    with sims(tmp, ("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")) as (p, d):
        yield tmp, p, d


def test_through_pdctl_router_and_sglang_router(pd_pair) -> None:
    tmp, prefill, decode = pd_pair
    router = RouterProcess(tmp, *pd_router_args([prefill], [decode])).start()
    try:
        urls = {"pdctl": router.url}
        with sglang_router(tmp, [prefill], [decode], expect_workers=2) as sg_url:
            urls["sglang-router"] = sg_url
            for name, url in urls.items():
                out = tmp / f"{name}.json"
                res = bench_cli("--url", url, "--num-prompts", "24", "--input-len", "32", "--output-len", "8",
                                "--max-concurrency", "8", "--json-out", str(out))  # fmt: skip
                assert res.returncode == 0, (name, res.stdout, res.stderr)
                run = json.loads(out.read_text())["runs"][0]
                assert run["completed"] == 24 and run["output_token_mismatches"] == 0, (name, run)
                assert run["weight_versions"] == {"default": 24}
    finally:
        router.stop()


def test_sweep_plot_and_compare(slow_sim, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    reports = []
    for seed in ("1", "2"):
        out = tmp_path / f"sweep-{seed}.json"
        res = bench_cli("--url", slow_sim.url, "--dataset", "random", "--input-len", "16", "--output-len", "4",
                        "--num-prompts", "6", "--sweep", "concurrency=1,3", "--seed", seed, "--slo-ttft-ms", "1000",
                        "--json-out", str(out), "--plot", str(tmp_path / f"sweep-{seed}.png"))  # fmt: skip
        assert res.returncode == 0, res.stderr
        report = json.loads(out.read_text())
        assert [r["max_concurrency"] for r in report["runs"]] == [1, 3]
        assert all(r["request_goodput"] > 0 and "p99_ttft_ms" in r for r in report["runs"])
        assert (tmp_path / f"sweep-{seed}.png").stat().st_size > 10_000
        reports.append(out)
    cmp = bench_cli("compare", *map(str, reports))
    assert cmp.returncode == 0 and "B/A" in cmp.stdout and "requests/s" in cmp.stdout, cmp.stderr


def test_bad_input_is_a_clear_error(tmp_path, pd_pair) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    res = bench_cli("--url", dead, "--num-prompts", "2")
    assert res.returncode == 1 and f"cannot reach {dead}" in res.stderr and "Traceback" not in res.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "output_len": 2}\n{"prompt": oops}\n')
    res = bench_cli("--url", dead, "--dataset", "jsonl", "--dataset-path", str(bad))
    assert res.returncode == 1 and f"{bad}:2: not JSON" in res.stderr and "Traceback" not in res.stderr
    res = bench_cli("--url", dead, "--dataset", "sharegpt", "--dataset-path", str(bad))
    assert res.returncode == 1 and "not JSON" in res.stderr and "Traceback" not in res.stderr

    res = bench_cli("--url", dead, "--num-prompts", "0")
    assert res.returncode == 2 and "--num-prompts" in res.stderr and "Traceback" not in res.stderr
    res = bench_cli("--url", dead, "--sweep", "speed=1,2")
    assert res.returncode == 2 and "rate=R1,R2" in res.stderr

    # a server that answers 500: every failure counted by kind, exit 1 past --max-error-rate
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "tests.router.echo_worker", "--port", str(port), "--fail"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        from tests.helpers import wait_http

        wait_http(f"http://127.0.0.1:{port}/health", proc=worker)
        out = tmp_path / "fail.json"
        res = bench_cli("--url", f"http://127.0.0.1:{port}", "--num-prompts", "5", "--json-out", str(out))
        assert res.returncode == 1 and "100.0% of a run's requests failed" in res.stderr and "http_500: 5" in res.stderr
        assert json.loads(out.read_text())["runs"][0]["errors"] == {"http_500": 5}
        res = bench_cli("--url", f"http://127.0.0.1:{port}", "--num-prompts", "5", "--max-error-rate", "1")
        assert res.returncode == 0, res.stderr
    finally:
        worker.terminate()
        worker.wait(timeout=10)


def test_cluster_server_view_and_weight_reloads(tmp_path) -> None:
    topo = local_topology(tmp_path, "bn", free_port_base())
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    save_checkpoint(TinyLM(replace(PRESETS["tiny"], seed=5)), tmp_path / "ckpt")
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        out = tmp_path / "cluster.json"
        # a closed loop keeps requests in flight the whole run, so every reload overlaps some
        res = bench_cli("bn", "--num-prompts", "300", "--dataset", "fixed", "--input-len", "32", "--output-len", "16",
                        "--max-concurrency", "4", "--weights-reload-every", "0.25", "--weights-path",
                        str(tmp_path / "ckpt"), "--weights-refit", "interrupt", "--json-out", str(out),
                        env={"PDCTL_HOME": str(tmp_path / "home")})  # fmt: skip
        assert res.returncode == 0, res.stdout + res.stderr
        run = json.loads(out.read_text())["runs"][0]
        assert run["completed"] == 300, run["errors"]
        assert run["weight_reloads"]["count"] >= 1 and not run["weight_reloads"]["errors"]
        assert any(v.startswith("bench-reload-") for v in run["weight_versions"]), run["weight_versions"]
        windows = run["push_windows"]
        assert windows["inside"]["requests"] + windows["outside"]["requests"] == 300
        assert windows["inside"]["requests"] > 0
        stall = run["refit_stall"]  # updates that interrupt and continue rather than drain
        assert stall["refit"] == "interrupt" and stall["updates"] == run["weight_reloads"]["count"]
        assert len(stall["transfer_s"]) == stall["updates"] and stall["max_stream_gap_ms"] > 0
        assert stall["failed_arrived_during_update"] == 0
        assert "weight updates (refit)" in res.stdout
        server = run["server"]
        assert {"router", "prefill", "decode"} <= set(server) and "unreachable" not in server, server
        # the engines count what the client counted, give or take a token per request (a PD decode may
        # leave the first to the prefill) and the one-token /health probes of the router
        assert abs(server["decode"]["generation_tokens_delta"] - run["total_output_tokens"]) <= 300, server
        assert "max_running_reqs" in server["decode"] and "max_in_flight" in server["router"]
        assert "inside pushes" in res.stdout
    finally:
        pdctl("down", "bn", env=env)


def test_library_rejects_empty_and_bad_points() -> None:
    from pdctl.bench import BenchError

    with pytest.raises(BenchError, match="no requests"):
        run_bench(BenchConfig(url="http://127.0.0.1:1", requests=()))
    with pytest.raises(BenchError, match="bad load point"):
        run_bench(BenchConfig(url="http://127.0.0.1:1", requests=tuple(fixed_workload(1, 2, 2, 0)),
                              points=(LoadPoint(request_rate=0),)))  # fmt: skip


def test_workload_files(tmp_path: Path) -> None:
    from pdctl.bench.workloads import WorkloadError, jsonl_workload, random_workload, sharegpt_workload

    a = random_workload(50, 100, 20, 0.5, seed=7)
    assert a == random_workload(50, 100, 20, 0.5, seed=7)  # seeded
    assert all(50 <= r.input_len <= 100 and len(r.prompt) == r.input_len and 10 <= r.output_len <= 20 for r in a)
    share = tmp_path / "sg.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "abc"}]},
                                 {"conversations": [{"from": "human", "value": "solo"}]}]))  # fmt: skip
    reqs = sharegpt_workload(share, 3, None, seed=1)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hi", 3)] * 3
    lines = tmp_path / "w.jsonl"
    lines.write_text('{"prompt": "x", "output_len": 4}\n\n{"prompt": "yy"}\n')
    assert [(r.prompt, r.output_len) for r in jsonl_workload(lines, None, 9)] == [("x", 4), ("yy", 9)]
    with pytest.raises(WorkloadError, match="output_len must be a positive integer"):
        jsonl_workload(lines, None, None)


def _abort_server_events(api: str, status: int | None) -> list[dict]:
    """Two tokens, then the request's end as SGLang 0.5.23 streams an abort."""
    if api == "generate":
        meta = {"prompt_tokens": 3, "weight_version": "default"}
        reason = {"type": "abort", "message": "Lost connection with prefill instance", "status_code": status}
        return [{"text": "ab", "meta_info": {**meta, "completion_tokens": 2, "finish_reason": None}},
                {"text": "ab", "meta_info": {**meta, "completion_tokens": 2, "finish_reason": reason}}]  # fmt: skip
    return [{"choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}]  # fmt: skip


@pytest.mark.parametrize(("api", "status"), [("generate", 500), ("generate", None), ("completions", None)])
def test_a_stream_that_ends_in_an_abort_is_a_failed_request(api, status) -> None:
    """SGLang answers a request it aborts (a decode that lost its prefill, a pause) with a 200
    stream that ends in an abort; the tokens before it are not the answer asked for, so the
    load tester counts the request as failed ('aborted'), not as a short success."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from pdctl.bench.client import send
    from pdctl.bench.workloads import BenchRequest

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in _abort_server_events(api, status):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/generate", handler)
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                return await send(session, f"http://127.0.0.1:{port}", api, BenchRequest("hi", 8, 2))
        finally:
            await runner.cleanup()

    result = asyncio.run(main())
    assert not result.ok and result.error == "aborted", result
    if status:
        assert "status 500" in result.detail


def test_plot_without_matplotlib_fails_before_sending_anything(monkeypatch, tmp_path) -> None:
    """`--plot` where matplotlib is not installed: a clear error at once, not after the whole run."""
    import importlib.util

    from click.testing import CliRunner

    from pdctl.cli.app import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(cli, ["bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code != 0 and "--plot needs matplotlib" in result.output and "nothing was sent" in result.output


def test_compare_pairs_runs_by_their_load_not_their_position() -> None:
    from rich.console import Console

    from pdctl.bench.report import compare

    def run(rate: float, ttft: float) -> dict:
        return {"request_rate": rate, "max_concurrency": None, "completed": 10, "mean_ttft_ms": ttft}

    a = {"runs": [run(1.0, 10.0), run(4.0, 40.0)]}
    b = {"runs": [run(4.0, 20.0), run(8.0, 80.0)]}  # a sweep in another order, one rate only here
    console = Console(width=200, record=True)
    console.print(compare(a, b, ("a.json", "b.json")))
    text = console.export_text()
    assert "1: rate 4.0" in text and "0.50x" in text, text  # 4.0 beside 4.0: 20 / 40
    assert "rate 1.0" in text.split("not compared")[-1] and "B rate 8.0" in text, text


def test_bench_is_a_group_whose_default_command_is_run(tmp_path) -> None:
    """`pdctl bench run ...`, `pdctl bench compare A B`, and `pdctl bench [NAME] [options]` as before."""
    from click.testing import CliRunner

    from pdctl.cli.app import cli

    runner = CliRunner()
    listed = runner.invoke(cli, ["bench", "--help"])
    assert listed.exit_code == 0 and "compare" in listed.output and "run" in listed.output
    for argv in (
        ["bench", "--url", "http://127.0.0.1:1", "--num-prompts", "0"],
        ["bench", "run", "--num-prompts", "0"],
    ):
        out = runner.invoke(cli, argv)
        assert out.exit_code == 2 and "--num-prompts" in out.output, out.output  # parsed by `run`
    missing = runner.invoke(cli, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
