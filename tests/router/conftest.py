from __future__ import annotations

import pytest

from tests.helpers import RouterProcess, pd_router_args, sims


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A regular sim, one prefill and two decodes, all sim://tiny (same weights)."""
    tmp = tmp_path_factory.mktemp("fleet")
    specs = [
        (),
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-mode", "decode"),
        ("--disaggregation-mode", "decode"),
    ]
    with sims(tmp, *specs) as procs:
        yield procs


@pytest.fixture(scope="module")
def router(fleet, tmp_path_factory):
    _, prefill, d1, d2 = fleet
    proc = RouterProcess(
        tmp_path_factory.mktemp("router"), *pd_router_args([prefill], [d1, d2], "--policy", "round_robin")
    )
    yield proc.start("/readiness")
    proc.stop()
