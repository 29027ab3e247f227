"""The trainer's environment contract (pdctl.weights.env): what the planner writes is what
``WeightSync.from_env`` reads, and the defaults agree between the topology and the trainer."""

from __future__ import annotations

import pytest

from pdctl.plan import make_plan
from pdctl.refit import RefitMode
from pdctl.topology import load_topology, load_topology_text
from pdctl.topology.model import WeightsConfig
from pdctl.weights.env import DEFAULT_BUCKET_MB, WEIGHT_GROUP_ENV, WeightGroupEnv
from tests.conftest import REPO


def _trainer_env(text: str) -> dict[str, str]:
    top, _ = load_topology_text(text, "t.yaml")
    plan = make_plan(top)
    return next(p.env for p in plan.processes if p.role.value == "trainer")


RL = (REPO / "topologies" / "rl-sim.yaml").read_text()


def test_the_planned_group_reads_back_with_the_topologys_refit() -> None:
    env = _trainer_env(
        RL.replace(
            "weights: {backend: gloo, bucket_mb: 64}",
            "weights: {backend: gloo, bucket_mb: 64, refit: interrupt, max_staleness: 3}",
        )
    )
    group = WeightGroupEnv.from_json(env[WEIGHT_GROUP_ENV])
    assert group.refit is RefitMode.INTERRUPT and group.max_staleness == 3 and group.bucket_mb == 64
    assert [e["rank_offset"] for e in group.engines] == [1, 2]
    default = WeightGroupEnv.from_json(_trainer_env(RL)[WEIGHT_GROUP_ENV])
    assert default.refit is RefitMode.DRAIN and default.max_staleness is None


def test_bucket_mb_has_one_default() -> None:
    """Written once (pdctl.topology.model): the schema `pdctl schema` prints and the trainer read it."""
    from pdctl.topology.schema import topology_schema

    assert topology_schema()["properties"]["weights"]["properties"]["bucket_mb"]["default"] == DEFAULT_BUCKET_MB
    assert (
        WeightsConfig().bucket_mb
        == DEFAULT_BUCKET_MB
        == WeightGroupEnv.from_json('{"master_address": "h", "master_port": 1, "engines": []}').bucket_mb
    )


@pytest.mark.parametrize("bad", ['"sometimes"', "-1", "1.5"])
def test_bad_refit_settings_are_named_at_their_line(bad: str, tmp_path) -> None:
    key = "refit" if bad.startswith('"') else "max_staleness"
    path = tmp_path / "t.yaml"
    path.write_text(RL.replace("bucket_mb: 64}", f"bucket_mb: 64, {key}: {bad}}}"))
    from pdctl.errors import TopologyError

    with pytest.raises(TopologyError) as err:
        load_topology(path)
    assert f"weights.{key}" in str(err.value) and "t.yaml:" in str(err.value)
