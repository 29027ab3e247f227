"""The planner: GPUs, port cursors, argv, weight-group ranks, invariants."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from pdctl.errors import PlanError
from pdctl.plan import make_plan
from pdctl.plan.load import load_plan
from pdctl.plan.planner import check_invariants
from pdctl.topology import load_topology, load_topology_text
from tests.conftest import REPO, yaml_text


def plan_of(name: str):
    top, _ = load_topology(REPO / "topologies" / name)
    return make_plan(top)


def flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_plan_is_deterministic() -> None:
    a = json.dumps(plan_of("2node-hetero-tp.yaml").to_dict(), sort_keys=True)
    b = json.dumps(plan_of("2node-hetero-tp.yaml").to_dict(), sort_keys=True)
    assert a == b


def test_port_cursor_relays_across_groups_per_node() -> None:
    plan = plan_of("2node-hetero-tp.yaml")
    p0, p1, d0 = (plan.process(i) for i in ("prefill-0", "prefill-1", "decode-0"))
    # The seed ports of weights from a peer come after every other port: none of those moves.
    seed = {"seed_relay": 20010, "seed.0": 20011, "seed.1": 20012}
    assert dict(p0.ports) == {"http": 20000, "nccl": 20001, "bootstrap": 20002, **seed}
    seed = {"seed_relay": 20013, "seed.0": 20014, "seed.1": 20015}
    assert dict(p1.ports) == {"http": 20003, "nccl": 20004, "bootstrap": 20005, **seed}
    seed = {"seed_relay": 20016, "seed.0": 20017, "seed.1": 20018, "seed.2": 20019, "seed.3": 20020}
    assert dict(d0.ports) == {"http": 20006, "nccl": 20007, **seed}
    assert dict(plan.process("router").ports) == {"http": 20008, "metrics": 20009}
    # trainer node n1 has its own cursor: master port then the weight-group rendezvous.
    trainer = plan.process("trainer.n1")
    assert dict(trainer.ports) == {"master": 20000, "weight_group": 20001}
    assert plan.weight_group is not None and plan.weight_group.master_port == 20001


def test_peers_of_weights_from_a_peer_are_the_engines_of_the_same_tp() -> None:
    plan = plan_of("2node-hetero-tp.yaml")
    peers = {i: [p["engine_id"] for p in plan.process(i).peer_weights["peers"]] for i in ("prefill-0", "prefill-1")}
    assert peers == {"prefill-0": ["prefill-1"], "prefill-1": ["prefill-0"]}  # tp 2 both
    lone = plan.process("decode-0").peer_weights
    assert lone["peers"] == [] and lone["me"]["ports"] == [20017, 20018, 20019, 20020]  # one port per TP rank
    assert plan.process("prefill-1").peer_weights["me"] == {
        "engine_id": "prefill-1", "url": "http://10.0.0.10:20003", "host": "10.0.0.10", "relay_port": 20013,
        "ports": [20014, 20015],
    }  # fmt: skip


def test_weights_from_a_peer_can_be_turned_off_and_skip_multi_node_and_dp_engines() -> None:
    top, _ = load_topology(REPO / "topologies" / "2node-hetero-tp.yaml")
    off = make_plan(replace(top, weights=replace(top.weights, from_peer=False)))
    assert all(p.peer_weights is None and "seed_relay" not in p.ports for p in off.processes)
    multi = plan_of("sim-multinode-decode.yaml")
    assert all(p.peer_weights is None for p in multi.processes if p.engine_id and p.engine_id.startswith("decode"))


def test_heterogeneous_tp_weight_group() -> None:
    plan = plan_of("2node-hetero-tp.yaml")
    offsets = {e.id: (e.rank_offset, e.gpus) for e in plan.engines}
    assert offsets == {"prefill-0": (1, 2), "prefill-1": (3, 2), "decode-0": (5, 4)}
    assert plan.weight_group.world_size == 9
    env = dict(plan.process("trainer.n1").env)
    group = json.loads(env["PDCTL_WEIGHT_GROUP"])
    assert [e["rank_offset"] for e in group["engines"]] == [1, 3, 5]
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_gpus_are_contiguous_blocks_with_base_gpu_id() -> None:
    plan = plan_of("2node-hetero-tp.yaml")
    assert [plan.process(i).gpu_ids for i in ("prefill-0", "prefill-1", "decode-0")] == [(0, 1), (2, 3), (4, 5, 6, 7)]
    assert flag(plan.process("decode-0").argv, "--base-gpu-id") == "4"
    assert flag(plan.process("decode-0").argv, "--tp-size") == "4"


def test_tp16_engine_spans_two_nodes() -> None:
    plan = plan_of("tp16-two-nodes.yaml")
    heads = [p for p in plan.processes if p.engine_id == "decode-0"]
    assert [p.id for p in heads] == ["decode-0.n1", "decode-0.n2"]
    assert [p.entrypoint for p in heads] == [True, False]
    for rank, proc in enumerate(heads):
        assert flag(proc.argv, "--nnodes") == "2"
        assert flag(proc.argv, "--node-rank") == str(rank)
        assert flag(proc.argv, "--dist-init-addr") == "10.0.0.11:20002"
    assert heads[0].dist_init_block == 30 + 8  # attn_dp 8
    engine = next(e for e in plan.engines if e.id == "decode-0")
    assert engine.url == "http://10.0.0.11:20000" and engine.gpus == 16
    router = plan.router
    assert router.argv.count("--decode") == 1  # only node rank 0 is registered


def test_sglang_argv_has_full_flags_and_extra_args() -> None:
    plan = plan_of("1node-1p1d.yaml")
    argv = plan.process("prefill-0").argv
    assert argv[:3] == ("/opt/venvs/serve/bin/python", "-m", "sglang.launch_server")
    assert flag(argv, "--disaggregation-mode") == "prefill"
    assert flag(argv, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(argv, "--chunked-prefill-size") == "8192"
    assert flag(argv, "--host") == "10.0.0.10"
    assert "--tp" not in argv and "--dp" not in argv
    assert plan.process("prefill-0").log_path == "/scratch/pdctl/one-node/logs/prefill-0.log"


def test_router_argv_carries_workers_and_api_key_env_only() -> None:
    plan = plan_of("1node-1p1d.yaml")
    argv = plan.router.argv
    assert flag(argv, "--port") == "8000"
    i = argv.index("--prefill")
    assert argv[i + 1 : i + 3] == ("http://10.0.0.10:20000", "20002")
    assert flag(argv, "--api-key-env") == "PDCTL_API_KEY"
    assert "--api-key" not in argv
    assert plan.router_url == "http://10.0.0.10:8000"  # 0.0.0.0 -> the node's address


def test_sim_engine_gets_the_same_flags() -> None:
    top, _ = load_topology(REPO / "topologies" / "1node-1p1d.yaml")
    sglang_argv = make_plan(top).process("decode-0").argv
    sim_argv = make_plan(replace(top, engine="sim")).process("decode-0").argv
    assert sim_argv[2] == "pdctl.sim" and sglang_argv[3:] == sim_argv[3:]


def test_colocate_pairs_trainer_with_engine_gpus_and_mps_env() -> None:
    plan = plan_of("colocate.yaml")
    trainer = plan.process("trainer.n0")
    assert trainer.gpu_ids == tuple(range(8))
    assert trainer.argv[-3:] == ("-m", "--", "my_rl.train")
    assert "CUDA_MPS_PIPE_DIRECTORY" in trainer.env and "CUDA_MPS_PIPE_DIRECTORY" in plan.process("decode-0").env
    assert flag(plan.process("decode-0").argv, "--mem-fraction-static") == "0.45"
    assert trainer.env["PDCTL_TRAIN_FRAC"] == "0.45" and trainer.env["PDCTL_READY_TIMEOUT_SECS"] == "900"
    assert trainer.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert plan.process("router").env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") is None
    assert plan.trainer_first and [d.to_dict() for d in plan.mps] == [
        {"node": "n0", "pipe_dir": "~/.pdctl/runs/colo/mps/pipe", "log_dir": "~/.pdctl/runs/colo/mps/log"}
    ]
    separate = plan_of("2node-hetero-tp.yaml")
    assert separate.mps == () and not separate.trainer_first


def test_invariant_trainer_rank_i_shares_engine_gpu_i() -> None:
    plan = plan_of("colocate.yaml")
    check_invariants(plan, colocate=True)
    trainer = plan.process("trainer.n0")
    swapped = replace(trainer, gpu_ids=(1, 0, *trainer.gpu_ids[2:]))  # still every GPU once, paired wrongly
    bad = replace(plan, processes=tuple(swapped if p.id == trainer.id else p for p in plan.processes))
    with pytest.raises(PlanError, match="trainer rank i shares engine GPU i"):
        check_invariants(bad, colocate=True)


def test_trainer_command_forms() -> None:
    base = "name: t\nmodel: {path: m}\nnodes: [{name: n0, host: h, gpus: 2}]\nregular: {}\n"
    for command, tail in [
        ("[python, train.py, --x]", ("--master-port", "20004", "--", "train.py", "--x")),
        ("[python, -m, pkg.train]", ("-m", "--", "pkg.train")),
        # a trainer flag that abbreviates torchrun's own (--log: --log-dir, --log-specs) stays the trainer's
        ("[python, -m, pkg.train, --log, out.jsonl]", ("-m", "--", "pkg.train", "--log", "out.jsonl")),
        ("[./run.sh, a]", ("--no-python", "--", "./run.sh", "a")),
        ("[python, -c, 'print(1)']", ("--no-python", "--", "python3", "-c", "print(1)")),
    ]:
        top, _ = load_topology_text(yaml_text(base + f"trainer: {{command: {command}, nproc_per_node: 1}}\n"))
        argv = make_plan(top).process("trainer.n0").argv
        assert argv[1:3] == ("-m", "torch.distributed.run")
        assert argv[-len(tail) :] == tail


def test_explicit_router_port_is_skipped_by_the_cursor() -> None:
    text = "name: t\nmodel: {path: m}\nnodes: [{name: n0, host: h}]\nports: {base: 20000}\n"
    top, _ = load_topology_text(yaml_text(text + "router: {port: 20001}\nprefill: {}\ndecode: {}\n"))
    plan = make_plan(top)
    ports = dict(plan.process("prefill-0").ports)
    assert {k: ports[k] for k in ("http", "nccl", "bootstrap")} == {"http": 20000, "nccl": 20002, "bootstrap": 20003}


def test_invariants_catch_a_port_or_gpu_used_twice() -> None:
    plan = plan_of("1node-1p1d.yaml")
    p, d = plan.process("prefill-0"), plan.process("decode-0")
    clash = replace(d, ports={"http": p.ports["http"]})
    bad = replace(plan, processes=tuple(clash if x.id == d.id else x for x in plan.processes))
    with pytest.raises(PlanError, match="no port twice"):
        check_invariants(bad, colocate=False)
    gpu_clash = replace(d, gpu_ids=p.gpu_ids)
    bad = replace(plan, processes=tuple(gpu_clash if x.id == d.id else x for x in plan.processes))
    with pytest.raises(PlanError, match="no GPU twice"):
        check_invariants(bad, colocate=False)
    no_entry = replace(d, entrypoint=False)
    bad = replace(plan, processes=tuple(no_entry if x.id == d.id else x for x in plan.processes))
    with pytest.raises(PlanError, match="one entrypoint per engine"):
        check_invariants(bad, colocate=False)


def test_invariant_weight_ranks_cover_each_gpu_once() -> None:
    plan = plan_of("2node-hetero-tp.yaml")
    shifted = tuple(replace(e, rank_offset=1) for e in plan.engines)
    with pytest.raises(PlanError, match="weight ranks"):
        check_invariants(replace(plan, engines=shifted), colocate=False)


def test_sim_multinode_example_plans_one_engine_over_two_nodes() -> None:
    plan = plan_of("sim-multinode-decode.yaml")
    procs = {p.id: p for p in plan.processes}
    head, peer = procs["decode-0.h1"], procs["decode-0.h2"]
    assert head.entrypoint and not peer.entrypoint and peer.health_path is None
    assert flag(head.argv, "--dist-init-addr") == flag(peer.argv, "--dist-init-addr") == "10.77.0.3:22002"
    assert [flag(p.argv, "--node-rank") for p in (head, peer)] == ["0", "1"]
    assert {flag(p.argv, "--tp-size") for p in (head, peer)} == {"4"}
    decode = next(e for e in plan.engines if e.id == "decode-0")
    assert decode.process_ids == ("decode-0.h1", "decode-0.h2") and decode.gpus == 4
    assert plan.weight_group is not None and plan.weight_group.world_size == 1 + 1 + 4


def test_the_router_parses_its_planned_argv_into_the_topologys_settings() -> None:
    """The planner writes the router's flags from the router's own settings table: the real
    parser reads them back into the values the topology asked for."""
    from pdctl.router.cli import build_parser, config_from_args

    plan = plan_of("1node-1p1d.yaml")
    top, _ = load_topology(REPO / "topologies" / "1node-1p1d.yaml")
    argv = list(plan.router.argv)
    args = argv[argv.index("router") + 1 :]
    parser = build_parser()
    # the router reads its keys from the variables the plan names (`up` sets them at launch)
    given = {
        flag(plan.router.argv, "--api-key-env"): "test-key",
        flag(plan.router.argv, "--engine-api-key-env"): "engine-key",
        flag(plan.router.argv, "--control-plane-api-keys-env"): "pdctl:pdctl:admin:control-key",
    }
    os.environ.update(given)
    try:
        config = config_from_args(parser.parse_args(args), parser)
    finally:
        for name in given:
            del os.environ[name]
    r = top.router
    for group, values in r.settings.items():  # what the file sets, the router reads back
        for name, value in values.items():
            assert getattr(getattr(config, group), name) == value, (group, name)
    assert config.policy == r.policy and config.api_key == "test-key"
    assert config.engine_api_key == "engine-key" and [k.role.value for k in config.control_keys] == ["admin"]
    assert "engine-key" not in " ".join(plan.router.argv), "no key itself is on a planned command line"
    assert len(config.workers) == len(plan.engines)


def test_local_nodes_keep_their_runs_under_pdctl_home(monkeypatch, tmp_path) -> None:
    """Two homes with a cluster of the same name must not share (and rotate) each other's logs:
    a local node without a workdir runs under $PDCTL_HOME/runs; a remote one under ~/.pdctl/runs
    (its home on its own machine)."""
    from pdctl.plan import make_plan
    from pdctl.topology import load_topology_text

    text = """
name: same
model: {path: "sim://tiny"}
engine: sim
nodes:
  - {name: here, host: HOST, gpus: 2}
"""
    logs = {}
    for home in ("a", "b"):
        monkeypatch.setenv("PDCTL_HOME", str(tmp_path / home))
        for host in ("127.0.0.1", "10.0.0.2"):
            plan = make_plan(load_topology_text(text.replace("HOST", host) + "prefill: {}\ndecode: {}\n")[0])
            logs[home, host] = plan.process("prefill-0").log_path
    assert logs["a", "127.0.0.1"] == str(tmp_path / "a" / "runs" / "same" / "logs" / "prefill-0.log")
    assert logs["a", "127.0.0.1"] != logs["b", "127.0.0.1"]
    assert logs["a", "10.0.0.2"] == logs["b", "10.0.0.2"] == "~/.pdctl/runs/same/logs/prefill-0.log"


def test_router_settings_nest_in_the_topology_and_plan_exactly_their_flags(tmp_path) -> None:
    """router.retry / breaker / admission / health / cache take the router's own settings: the
    plan carries exactly the flags the file sets, and a bad value is refused at its line."""
    from pdctl.errors import TopologyError

    head = "name: r\nmodel: {path: m}\nnodes: [{name: n0, host: 127.0.0.1, gpus: 2}]\nprefill: {}\ndecode: {}\n"
    text = head + (
        "router:\n"
        "  retry: {max_retries: 2, initial_backoff_ms: 10}\n"
        "  breaker: {failure_threshold: 4, disabled: true}\n"
        "  admission: {max_concurrent_requests: 32}\n"
    )
    path = tmp_path / "r.yaml"
    path.write_text(text)
    planned = load_plan(path)
    argv = list(planned.plan.router.argv)
    flags = [a for a in argv if a.startswith("--retry") or a.startswith("--cb-") or a.startswith("--disable-")]
    flags += [a for a in argv if a in ("--max-concurrent-requests", "--health-check-interval-secs")]
    assert sorted(flags) == sorted(
        ["--retry-max-retries", "--retry-initial-backoff-ms", "--cb-failure-threshold", "--disable-circuit-breaker",
         "--max-concurrent-requests"]
    ), argv  # fmt: skip
    assert flag(argv, "--retry-max-retries") == "2" and flag(argv, "--cb-failure-threshold") == "4"
    assert flag(argv, "--max-concurrent-requests") == "32"
    for bad, where, needle in [
        ("  retry: {max_retries: -1}\n", ":7:", "router.retry.max_retries: must be >= 0"),
        ("  breaker: {failure_threshold: 0}\n", ":7:", "router.breaker.failure_threshold: must be >= 1"),
        ("  retry: {max_retries: two}\n", ":7:", "router.retry.max_retries"),
        ("  retry: {maximum_retries: 2}\n", ":7:", "maximum_retries"),
    ]:
        path.write_text(head + "router:\n" + bad)
        with pytest.raises(TopologyError) as info:
            load_plan(path)
        assert f"r.yaml{where}" in str(info.value) and needle in str(info.value), str(info.value)


def test_data_plane_union_world_ports_env_and_hooks() -> None:
    """Trainer ranks 0..7, then engine TP ranks 8..15 in engine order (GPU i's engine rank is 8 + i);
    the store's port comes from the trainer node's cursor; trainer and engines get the same spec,
    engines the hooks that load pdctl.colocate by import path."""
    from pdctl.colocate.env import DATA_PLANE_ENV, DataPlaneSpec

    plan = plan_of("colocate-draft.yaml")
    dp = plan.data_plane
    assert dp is not None and dp.world_size == 16 and dp.trainer_ranks == 8
    assert [(e.id, e.tp, e.first_rank) for e in dp.engines] == [(f"regular-{i}", 2, 8 + 2 * i) for i in range(4)]
    assert (dp.backend, dp.batch_size, dp.aux_layers, dp.dtype) == ("cuda_ipc", 16, (1, 17, 32), "bfloat16")
    assert [dp.pair_of_trainer(i)[0].id for i in range(8)] == [f"regular-{i // 2}" for i in range(8)]
    assert [dp.pair_of_trainer(i)[1] for i in range(8)] == [0, 1] * 4
    trainer = plan.process("trainer.n0")
    assert trainer.ports["data_plane"] == dp.master_port and dp.master_address == "10.0.0.10"
    assert DataPlaneSpec.from_json(trainer.env[DATA_PLANE_ENV]) == dp
    for i in range(4):
        engine = plan.process(f"regular-{i}")
        assert DataPlaneSpec.from_json(engine.env[DATA_PLANE_ENV]) == dp
        hooks = json.loads(flag(engine.argv, "--forward-hooks"))
        assert [(h["config"]["tap"], h["target_modules"]) for h in hooks] == [
            ("input_ids", ["model.embed_tokens"]),
            ("positions", ["model.layers.0.self_attn.rotary_emb"]),
            ("aux", ["model.layers.1", "model.layers.17", "model.layers.32"]),
            ("final", ["model.norm"]),
        ]
        assert {h["hook_factory"] for h in hooks} == {"pdctl.colocate.engine:hook_factory"}
        assert {h["config"]["engine"] for h in hooks} == {f"regular-{i}"}
        assert "--disable-radix-cache" in engine.argv and "--skip-server-warmup" in engine.argv
        assert "--disable-prefill-cuda-graph" in engine.argv  # (a CUDA graph replay runs no hooks)
    assert DATA_PLANE_ENV not in plan.process("router").env
    assert plan.to_dict()["data_plane"]["world_size"] == 16
    # The sim: its own positions module, gloo by default.
    sim = plan_of("colocate-draft-sim.yaml")
    assert sim.data_plane is not None and sim.data_plane.backend == "gloo"
    sim_hooks = json.loads(flag(sim.process("regular-0").argv, "--forward-hooks"))
    assert sim_hooks[1]["target_modules"] == ["model.embed_positions"]
    assert plan_of("colocate.yaml").data_plane is None


def test_the_data_plane_flags_parse_as_sglang_parses_them() -> None:
    """The engine argv of a data-plane plan is accepted by SGLang 0.5.23's own flag table (the sim's
    parser is built from it): --forward-hooks is one JSON argument."""
    from pdctl.sim.__main__ import config_from_argv

    argv = plan_of("colocate-draft-sim.yaml").process("regular-0").argv
    config = config_from_argv(list(argv[3:]))
    assert [s["name"] for s in config.forward_hooks] == [
        "pdctl-data-plane-input_ids",
        "pdctl-data-plane-positions",
        "pdctl-data-plane-aux",
        "pdctl-data-plane-final",
    ]


def test_a_switchable_engine_has_a_bootstrap_port_in_either_role() -> None:
    plan = plan_of("role-switch-sim.yaml")
    for engine in plan.engines:
        proc = plan.process(engine.id)
        assert "--enable-pd-role-switch" in proc.argv and engine.role_switch
        assert flag(proc.argv, "--disaggregation-bootstrap-port") == str(proc.ports["bootstrap"])
        assert engine.switch_group == ("decode" if engine.role.value == "prefill" else "prefill")
    # the router is told a prefill's bootstrap port only
    decode = next(e for e in plan.engines if e.role.value == "decode")
    assert decode.prefill_bootstrap_port is None and decode.bootstrap_port is not None


def test_running_engines_keep_their_gpus_when_the_file_changes() -> None:
    """``pdctl apply``: one prefill fewer moves no decode (first fit alone would move both)."""
    top, _ = load_topology(REPO / "topologies" / "role-switch-sim.yaml")
    running = make_plan(top)
    keep = {e.id: ((running.process(e.id).node, running.process(e.id).gpu_ids),) for e in running.engines}
    smaller = replace(top, groups=tuple(replace(g, replicas=1) if g.name == "prefill" else g for g in top.groups))
    assert [make_plan(smaller).process(d).gpu_ids for d in ("decode-0", "decode-1")] == [(1,), (2,)]
    kept = make_plan(smaller, keep_gpus=keep)
    assert [kept.process(d).gpu_ids for d in ("decode-0", "decode-1")] == [(2,), (3,)]


def test_peers_of_weights_from_a_peer_hold_the_same_tensors_and_skip_speculative_engines() -> None:
    head = "name: t\nmodel: {path: m}\nnodes: [{name: n0, host: h, gpus: 8}]\n"
    top, _ = load_topology_text(yaml_text(head + "prefill: {args: {quantization: fp8}}\ndecode: {replicas: 2}\n"))
    plan = make_plan(top)
    peers = {i: [p["engine_id"] for p in plan.process(i).peer_weights["peers"]] for i in ("prefill-0", "decode-0")}
    assert peers == {"prefill-0": [], "decode-0": ["decode-1"]}  # another quantization: other tensors, no peer
    spec = "decode: {replicas: 2, args: {speculative-algorithm: EAGLE, speculative-draft-model-path: d}}\n"
    top, _ = load_topology_text(yaml_text(head + "prefill: {}\n" + spec))
    plan = make_plan(top)
    assert plan.process("decode-0").peer_weights is None  # its draft would load remote_instance too
    assert [p["engine_id"] for p in plan.process("prefill-0").peer_weights["peers"]] == []
