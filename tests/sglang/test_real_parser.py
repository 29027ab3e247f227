"""Every SGLang argv pdctl generates is accepted by SGLang 0.5.23's real ServerArgs parser,
and the committed flag table matches that parser. Install per sglang-protocol.md 1.1."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings

from pdctl.errors import PdctlError
from pdctl.plan import load_plan_text, make_plan
from pdctl.sglang import server_flags
from pdctl.topology import load_topology
from tests.conftest import TOPOLOGIES
from tests.helpers import topologies, triton_stub

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def parser() -> Iterator[argparse.ArgumentParser]:
    with triton_stub():
        server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang not installed (see README)")
        p = argparse.ArgumentParser(exit_on_error=False)
        server_args.ServerArgs.add_cli_args(p)
        yield p


def full_names(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def check_argv(parser: argparse.ArgumentParser, argv: tuple[str, ...]) -> argparse.Namespace:
    assert argv[1:3] == ("-m", "sglang.launch_server")
    args = list(argv[3:])
    names = full_names(parser)
    for a in args:
        if a.startswith("--"):
            assert a in names, f"{a} is not a full SGLang flag name (abbreviations are accepted by argparse)"
    ns, unknown = parser.parse_known_args(args)
    assert not unknown, unknown
    return ns


@pytest.mark.parametrize("path", [p for p in TOPOLOGIES if "sim" not in p.name], ids=lambda p: p.name)
def test_example_argv_parses(parser, path) -> None:
    top, _ = load_topology(path)
    plan = make_plan(top)
    for proc in plan.processes:
        if proc.role.is_engine:
            ns = check_argv(parser, proc.argv)
            assert ns.port == proc.ports["http"]
            assert ns.model_path == top.model.path
            if proc.role.value in ("prefill", "decode"):
                assert ns.disaggregation_mode == proc.role.value


@settings(max_examples=40, deadline=None)
@given(topologies())
def test_generated_argv_parses(parser, data) -> None:
    data["engine"] = "sglang"
    try:
        plan = load_plan_text(yaml.safe_dump(data)).plan
    except PdctlError:
        return  # over-committed draws are refused cleanly (tests/plan/test_properties.py)
    for proc in plan.processes:
        if proc.role.is_engine:
            ns = check_argv(parser, proc.argv)
            assert ns.tp_size == int(proc.argv[proc.argv.index("--tp-size") + 1])


def test_committed_flag_table_matches_the_parser(parser) -> None:
    table = server_flags()
    committed = {s for f in table.flags for s in (f.name, *f.aliases)}
    assert committed == full_names(parser) - {"-h", "--help"}


def test_the_sims_config_file_merges_as_sglangs(parser, tmp_path) -> None:
    """``pdctl up`` hands an engine its key in a ``--config`` file; the sim reads the file as
    SGLang's ConfigArgumentMerger does: the same argv out of the same file and command line."""
    merger_module = pytest.importorskip("sglang.srt.utils.server_args_config_parser")
    from pdctl.sim.args import build_parser, merge_config_file

    config = tmp_path / "engine.config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "api-key": "k3y",
                "enable-metrics": True,  # a bare flag: set
                "skip-server-warmup": False,  # a bare flag: left out
                "context-length": 512,
            }
        )
    )
    argv = ["--model-path", "m", "--config", str(config), "--port", "30001", "--context-length", "256"]
    ours = merge_config_file(argv, build_parser())
    assert ours == merger_module.ConfigArgumentMerger(parser).merge_config_with_args(argv)
    ns = build_parser().parse_args(ours)
    assert (ns.api_key, ns.enable_metrics, bool(ns.skip_server_warmup)) == ("k3y", True, False)
    assert ns.context_length == 256, "the command line wins over the file"
    # A list in the file becomes one word per item (each a Python repr), which SGLang's
    # json_list_type refuses: the sim refuses it too, with SGLang's words.
    hooks = tmp_path / "hooks.config.yaml"
    hooks.write_text(yaml.safe_dump({"forward-hooks": [{"name": "h", "target_modules": ["m"], "hook_factory": "a:b"}]}))
    argv = ["--model-path", "m", "--config", str(hooks)]
    ours = merge_config_file(argv, build_parser())
    assert ours == merger_module.ConfigArgumentMerger(parser).merge_config_with_args(argv)
    with pytest.raises(argparse.ArgumentError, match="Invalid JSON list"):
        parser.parse_args(ours)
    sim_parser = build_parser()
    sim_parser.exit_on_error = False
    with pytest.raises(argparse.ArgumentError, match=r"Invalid JSON list: .*Please provide a valid JSON list"):
        sim_parser.parse_args(ours)


def test_the_sim_refuses_the_config_keys_sglang_refuses(parser, tmp_path) -> None:
    """A --x/--no-x flag cannot be set from SGLang's config file: the sim refuses it as SGLang
    does, with the same message; a flag that takes one value, next to it, still can be."""
    merger_module = pytest.importorskip("sglang.srt.utils.server_args_config_parser")
    from pdctl.sim.args import build_parser, merge_config_file

    refused = [a for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)]
    assert refused, "SGLang 0.5.23 has --x/--no-x flags"
    flag = refused[0].option_strings[0][2:]
    config = tmp_path / "engine.config.yaml"
    config.write_text(yaml.safe_dump({"api-key": "k3y", flag: True}))
    argv = ["--model-path", "m", "--config", str(config)]
    with pytest.raises(ValueError, match="Unsupported config option") as theirs:
        merger_module.ConfigArgumentMerger(parser).merge_config_with_args(argv)
    with pytest.raises(ValueError, match="Unsupported config option") as ours:
        merge_config_file(argv, build_parser())
    assert str(ours.value) == str(theirs.value)


def test_a_key_that_begins_with_a_dash_cannot_go_in_sglangs_config_file(parser, tmp_path) -> None:
    """Why pdctl's keys are hex (pdctl/cluster/keys.py): SGLang makes ``--api-key -k`` of it."""
    merger_module = pytest.importorskip("sglang.srt.utils.server_args_config_parser")
    from pdctl.cluster.keys import ClusterKeys

    config = tmp_path / "engine.config.yaml"
    config.write_text(yaml.safe_dump({"api-key": "-k"}))
    argv = merger_module.ConfigArgumentMerger(parser).merge_config_with_args(
        ["--model-path", "m", "--config", str(config)]
    )
    with pytest.raises(argparse.ArgumentError, match="expected one argument"):
        parser.parse_args(argv)
    keys = [ClusterKeys.generate() for _ in range(200)]
    assert not [k for k in keys if k.engine.startswith("-") or k.control.startswith("-")]


def test_a_switchable_engines_argv_parses(parser) -> None:
    """``role_switch: true``: SGLang's parser reads the flag and a decode's bootstrap port."""
    top, _ = load_topology(Path(__file__).resolve().parents[2] / "topologies" / "role-switch-sim.yaml")
    plan = make_plan(replace(top, engine="sglang"))
    for proc in plan.processes:
        if proc.role.value in ("prefill", "decode"):
            ns = check_argv(parser, proc.argv)
            assert ns.enable_pd_role_switch is True
            assert ns.disaggregation_bootstrap_port == proc.ports["bootstrap"]


def test_a_receivers_argv_parses_as_a_complete_remote_instance_load(parser) -> None:
    """The command an engine's supervisor starts a receiver with (pdctl.node.peer_weights): SGLang's
    parser reads a remote_instance load with every setting its loader needs (an incomplete one
    would silently load from disk), the seed relay as the service port, and the pending version."""
    from pdctl.node.peer_weights import PENDING, Armed, PeerPlan, PeerSource, SeedSide

    top, _ = load_topology(next(p for p in TOPOLOGIES if p.name == "2node-hetero-tp.yaml"))
    plan = make_plan(top)
    spec = plan.process("prefill-1")
    peers = PeerPlan.from_dict(dict(spec.peer_weights))
    seed: SeedSide = peers.peers[0]
    argv = PeerSource(peers, None).command([*spec.argv, "--weight-version", "v0"], Armed(seed, "B"))
    ns = check_argv(parser, tuple(argv))
    assert ns.load_format == "remote_instance" and ns.remote_instance_weight_loader_backend == "nccl"
    assert ns.remote_instance_weight_loader_seed_instance_ip == seed.host
    assert ns.remote_instance_weight_loader_seed_instance_service_port == seed.relay_port
    assert ns.remote_instance_weight_loader_send_weights_group_ports == list(seed.ports)
    assert len(seed.ports) == 2 == ns.tp_size  # one port per TP rank, or SGLang's seed ends
    assert ns.weight_version == PENDING and argv.count("--weight-version") == 1
