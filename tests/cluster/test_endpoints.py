"""``pdctl endpoints``: engines, rank offsets and the settings frameworks take, from a cluster's
state; the offsets are the ones the router's facade gives the engines (pdctl.router.transaction.groups)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pdctl.cli import cli
from pdctl.cluster import StateStore
from pdctl.cluster.endpoints import endpoints
from pdctl.cluster.state import ClusterState, Phase
from pdctl.plan import make_plan
from pdctl.router.config import RouterConfig
from pdctl.router.transaction.groups import layout
from pdctl.router.workers import WorkerRegistry
from pdctl.sglang.control import InitGroup
from pdctl.topology import load_topology
from tests.conftest import REPO


def state_of(topology: str) -> ClusterState:
    top, _ = load_topology(REPO / "topologies" / topology)
    plan = make_plan(top)
    return ClusterState("rl-frameworks", "run", Phase.UP, [], plan.router.url if plan.router else None, plan=plan)


def test_rank_offsets_follow_the_facades_order_for_mixed_tp() -> None:
    found = endpoints(state_of("rl-frameworks-sim.yaml"))
    assert [(e.id, e.role, e.tp, e.rank_offset) for e in found.engines] == [
        ("p1-0", "prefill", 1, 1),
        ("p2-0", "prefill", 2, 2),
        ("decode-0", "decode", 2, 4),
    ]
    assert found.ranks == 5 and found.to_dict()["world_size"] == 6
    settings = found.settings()
    assert settings["areal"]["AREAL_LLM_SERVER_ADDRS"] == found.router_address
    assert settings["areal"]["rollout.backend"] == "sglang:d1t5"
    assert settings["slime"]["--rollout-external-engine-addrs"].split() == [e.address for e in found.engines]
    assert settings["skyrl-train"]["generator.inference_engine_tensor_parallel_size"] == "5"


def test_the_router_gives_the_same_offsets() -> None:
    """The router's facade, registering the plan's workers as ``pdctl up`` does, lays a group out
    exactly as ``pdctl endpoints`` prints it."""
    state = state_of("rl-frameworks-sim.yaml")
    registry = WorkerRegistry(RouterConfig(pd_disaggregation=True))
    decodes_first = sorted(state.plan.engines, key=lambda e: e.role != "decode")  # order given: decode first
    for e in decodes_first:
        registry.add(e.url, e.role.value, e.bootstrap_port)
    infos = {e.url: {"tp_size": e.tp} for e in state.plan.engines}
    spec = InitGroup(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=6)
    laid = {m.url: m.rank_offset for m in layout(spec, registry.workers.values(), infos)}
    assert laid == {e.url: e.rank_offset for e in endpoints(state).engines}


def test_the_command_prints_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDCTL_HOME", str(tmp_path))
    StateStore().save(state_of("rl-frameworks-sim.yaml"))
    result = CliRunner().invoke(cli, ["endpoints", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [e["rank_offset"] for e in out["engines"]] == [1, 2, 4]
    result = CliRunner().invoke(cli, ["endpoints", "rl-frameworks"])
    assert result.exit_code == 0, result.output
    assert "AREAL_LLM_SERVER_ADDRS=127.0.0.1:" in result.output and "sglang:d1t5" in result.output
    assert "world size 6" in result.output
