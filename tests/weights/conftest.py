"""A PD fleet of real sims behind pdctl's router: prefill tp 1, prefill tp 2, decode tp 2.

Each test process is trainer rank 0 of a real gloo group with them (world 1 + 1 + 2 + 2 = 6).
The weights tests' shared helpers: the fleet's engines as push targets, a trainer's model, and a
WeightSync to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.helpers import RouterProcess, free_port, pd_router_args, sims

if TYPE_CHECKING:
    from pdctl.sim.model import TinyLM
    from pdctl.weights import WeightSync


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
    """The sims ``procs`` as WeightSync targets: ids e0, e1, ... and their GPUs (2 when --tp-size is given)."""
    return [{"id": f"e{i}", "url": p.url, "gpus": 2 if "--tp-size" in p.args else 1} for i, p in enumerate(procs)]


def model(seed: int) -> TinyLM:
    """A trainer's model: the tiny sim preset with weights drawn from ``seed``."""
    from dataclasses import replace

    from pdctl.sim.model import PRESETS, TinyLM

    return TinyLM(replace(PRESETS["tiny"], seed=seed))


def sync_for(procs, router, **kw) -> WeightSync:
    """A WeightSync (gloo, a free master port, 60 s timeouts) to the sims ``procs`` behind ``router``."""
    from pdctl.weights import WeightSync

    return WeightSync(
        targets(procs),
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="gloo",
        router_url=router.url,
        timeout_secs=60,
        **kw,
    )
