from __future__ import annotations

import pytest

from tests.helpers import sims


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """A regular sim, a PD prefill and a PD decode (same weights: sim://tiny)."""
    tmp = tmp_path_factory.mktemp("sims")
    with sims(tmp, (), ("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode")) as procs:
        yield procs
