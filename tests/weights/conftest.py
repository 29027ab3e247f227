"""A PD fleet of real sims behind pdctl's router: prefill tp 1, prefill tp 2, decode tp 2.

Each test process is trainer rank 0 of a real gloo group with them (world 1 + 1 + 2 + 2 = 6).
"""

from __future__ import annotations

import pytest

from tests.helpers import RouterProcess, pd_router_args, sims


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    specs = [
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "prefill", "--tp-size", "2"),
        # 2 ms a step: a long request stays in flight for seconds (the refit interrupt tests)
        ("--disaggregation-mode", "decode", "--tp-size", "2", "--sim-decode-ms-per-step", "2"),
    ]
    with sims(tmp, *specs) as procs:
        router = RouterProcess(
            tmp, *pd_router_args(procs[:2], procs[2:], "--policy", "round_robin", "--health-check-interval-secs", "1")
        ).start("/readiness")
        try:
            yield procs, router
        finally:
            router.stop()


def targets(procs):
    return [{"id": f"e{i}", "url": p.url, "gpus": 2 if "--tp-size" in p.args else 1} for i, p in enumerate(procs)]
