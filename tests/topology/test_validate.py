"""Schema and semantic validation: each rule has a test that fails without it."""

from __future__ import annotations

import pytest

from pdctl.errors import TopologyError
from pdctl.plan import load_plan
from tests.conftest import TOPOLOGIES, yaml_text
from tests.helpers import checked, errors_of, one_error

BASE = """\
name: t
model: {path: /m}
nodes:
  - {name: n0, host: 10.0.0.1, gpus: 8}
  - {name: n1, host: 10.0.0.2, gpus: 8}
"""


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_every_example_validates(path) -> None:
    top = load_plan(path).topology
    assert top.groups


def test_error_format_points_at_line_and_column() -> None:
    err = one_error(BASE + "prefill: {tp: 2, tpp: 3}\ndecode: {}\n", "unknown key 'tpp'")
    assert err.startswith("f.yaml:6:18: prefill.tpp: unknown key 'tpp'")
    assert "did you mean 'tp'" in err


def test_yaml_syntax_error_has_position() -> None:
    err = one_error("name: x\nmodel: {path: m\nnodes: []\n", "YAML syntax error")
    assert err.startswith("f.yaml:3:")


def test_duplicate_yaml_keys_are_errors() -> None:
    one_error(BASE + "prefill: {}\ndecode: {}\nprefill: {tp: 2}\n", "duplicate key")


def test_schema_types_and_enums() -> None:
    one_error(BASE + "engine: vllm\nprefill: {}\ndecode: {}\n", "engine", "not one of")
    one_error(BASE + "prefill: {tp: two}\ndecode: {}\n", "prefill.tp", "not of type 'integer'")
    one_error(BASE.replace("name: t", "name: 'has space'") + "regular: {}\n", "not a safe name")
    one_error(BASE + "regular: [{tp: 1}]\n", "regular[0]", "'name' is a required property")


def test_unknown_node_references() -> None:
    one_error(BASE + "prefill: {nodes: [n7]}\ndecode: {}\n", "prefill.nodes[0]", "unknown node 'n7'")
    one_error(BASE + "regular: {}\nrouter: {node: zz}\n", "router.node", "unknown node")
    one_error(BASE + "regular: {}\ntrainer: {command: [x], nodes: [q]}\n", "trainer.nodes[0]", "unknown node")


def test_late_pairing_with_a_sticky_policy_is_refused_at_its_room() -> None:
    router = "router: {policy: prefix_hash, admission: {prefill_room: 2}}\n"
    one_error(BASE + "prefill: {}\ndecode: {}\n" + router, "router.admission.prefill_room", "prefix_hash policy")
    negative = "router: {admission: {decode_room: -1}}\n"
    one_error(BASE + "prefill: {}\ndecode: {}\n" + negative, "router.admission.decode_room", ">= 0")


def test_duplicate_node_names_and_hosts() -> None:
    text = "name: t\nmodel: {path: /m}\nnodes:\n  - {name: a, host: h1}\n  - {name: a, host: h1}\nregular: {}\n"
    errs = errors_of(text)
    assert any("nodes[1].name: duplicate node name 'a'" in e for e in errs)
    assert any("nodes[1].host: duplicate node host 'h1'" in e for e in errs)


def test_gpu_overcommit_names_the_groups() -> None:
    err = one_error(
        BASE + "prefill: {replicas: 3, tp: 4}\ndecode: {replicas: 2, tp: 4}\n", "no room for engine decode-1"
    )
    assert "taken by prefill" in err and "decode" in err


def test_engine_larger_than_node_must_take_whole_nodes() -> None:
    one_error(BASE + "prefill: {tp: 12}\ndecode: {}\n", "prefill.tp", "must take whole nodes")
    top, _ = checked(yaml_text(BASE + "regular: {tp: 16}\n"))
    assert top.groups[0].gpus_per_engine == 16


def test_prefill_and_decode_come_in_pairs() -> None:
    one_error(BASE + "prefill: {}\n", "prefill without decode" if False else "prefill engines without decode")
    one_error(BASE + "decode: {}\n", "decode engines without prefill")
    one_error(BASE + "prefill: {}\ndecode: {}\nregular: {}\n", "regular engines cannot share")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ("{port: 5}", "--port is set by pdctl"),
        ("{tp-size: 2}", "--tp-size is set by pdctl"),
        ("{tensor-parallel-size: 2}", "--tp-size is set by pdctl"),
        ("{base-gpu-id: 1}", "--base-gpu-id is set by pdctl"),
        ("{nccl-port: 1}", "--nccl-port is set by pdctl"),
        ("{config: keys.yaml}", "--config is set by pdctl"),
        ("{api-key: k}", "--api-key is set by pdctl"),
        ("{admin-api-key: k}", "--admin-api-key is set by pdctl"),
        ("{dist-init-addr: 'a:1'}", "--dist-init-addr is set by pdctl"),
        ("{nnodes: 2}", "--nnodes is set by pdctl"),
        ("{node-rank: 1}", "--node-rank is set by pdctl"),
        ("{host: 0.0.0.0}", "--host is set by pdctl"),
        ("{disaggregation-mode: decode}", "--disaggregation-mode is set by pdctl"),
        ("{disaggregation-bootstrap-port: 9}", "--disaggregation-bootstrap-port is set by pdctl"),
        ("{chunked-prefil-size: 8}", "unknown SGLang 0.5.23 flag --chunked-prefil-size"),
        ("{disaggregation-decode-tp: 2}", "not an SGLang 0.5.23 flag"),
        ("{enable-metrics: 3}", "bare flag"),
        ("{load-format: bogus}", "invalid choice 'bogus'"),
        ("{mem-fraction-static: lots}", "takes an float"),
        ("{model: x}", "is set by pdctl"),
        ("{context-bucket: 5}", "is an alias"),
    ],
)
def test_extra_args_checked_against_sglang_flags(args: str, needle: str) -> None:
    err = one_error(BASE + f"prefill: {{args: {args}}}\ndecode: {{}}\n", needle)
    assert "prefill.args." in err


def test_good_extra_args_pass() -> None:
    checked(yaml_text(BASE + "prefill: {args: {chunked-prefill-size: 8192, enable-metrics: true}}\ndecode: {}\n"))


def test_sim_flags_only_for_sim_engine() -> None:
    one_error(BASE + "prefill: {args: {sim-decode-ms-per-step: 3}}\ndecode: {}\n", "unknown SGLang")
    checked(yaml_text(BASE + "engine: sim\nprefill: {args: {sim-decode-ms-per-step: 3}}\ndecode: {}\n"))


def test_port_overflow_and_ephemeral_warning() -> None:
    one_error(BASE + "ports: {base: 65534}\nprefill: {}\ndecode: {}\n", "ports.base", "past 65535")
    _, warnings = checked(yaml_text(BASE + "ports: {base: 32765}\nprefill: {}\ndecode: {}\n"))
    assert any("ephemeral" in w.message for w in warnings)
    _, warnings = checked(yaml_text(BASE + "ports: {base: 20000}\nprefill: {}\ndecode: {}\n"))
    assert not any("ephemeral" in w.message for w in warnings)


def test_weight_push_refuses_dp() -> None:
    trainer = "trainer: {command: [python, t.py], nodes: [n1], nproc_per_node: 2}\n"
    one_error(BASE + "prefill: {dp: 2}\ndecode: {}\n" + trainer, "prefill.dp", "dp_size must be 1")
    one_error(BASE + "prefill: {pp: 2}\ndecode: {}\n" + trainer, "prefill.pp")
    checked(yaml_text(BASE + "prefill: {dp: 2}\ndecode: {}\n"))  # no trainer: fine


def test_colocate_budget_and_pairing() -> None:
    head = "name: c\nmodel: {path: /m}\nnodes: [{name: n0, host: h, gpus: 8}]\n"
    groups = "prefill: {replicas: 2, tp: 2}\ndecode: {tp: 4}\n"
    trainer = "trainer: {command: [python, t.py], nodes: [n0], nproc_per_node: 8}\n"
    ok = "placement: {mode: colocate, train_frac: 0.45, infer_frac: 0.45}\n"
    top, _ = checked(yaml_text(head + groups + trainer + ok))
    assert top.placement.colocate
    one_error(head + groups + trainer + ok.replace("0.45}", "0.5}"), "headroom > 1")
    one_error(head + groups + trainer.replace("8}", "4}") + ok, "trainer world size 4 != engine count x TP = 8")
    one_error(head + groups + "placement: colocate\n", "add a trainer section")


def test_trainer_gpu_counts() -> None:
    one_error(BASE + "regular: {}\ntrainer: {command: [x], nodes: [n1], nproc_per_node: 9}\n", "9 > node n1's 8")
    one_error(
        BASE + "prefill: {tp: 8}\ndecode: {tp: 8}\ntrainer: {command: [x], nodes: [n1], nproc_per_node: 1}\n",
        "trainer needs 1 GPUs on node n1",
    )


def test_attn_dp_divides_tp() -> None:
    one_error(BASE + "prefill: {tp: 4, attn_dp: 3}\ndecode: {}\n", "attn_dp 3 must divide tp 4")


def test_local_and_remote_nodes_do_not_mix() -> None:
    text = "name: t\nmodel: {path: /m}\nnodes: [{name: a, host: 127.0.0.1}, {name: b, host: 10.0.0.2}]\nregular: {}\n"
    one_error(text, "loopback address")


def test_allocation_builds_groups() -> None:
    top, _ = checked(
        yaml_text(
            BASE + 'allocation: "sglang[prefill]:d2t2 + sglang[decode]:d1t4 + fsdp[trainer]:d8"\n'
            "router: {host: 0.0.0.0, api_key_env: K}\ntrainer: {command: [python, t.py], nodes: [n1]}\n"
        )
    )
    assert [(g.name, g.role.value, g.replicas, g.tp) for g in top.groups] == [
        ("prefill", "prefill", 2, 2),
        ("decode", "decode", 1, 4),
    ]
    assert top.trainer is not None and top.trainer.nproc_per_node == 8


def test_allocation_must_agree_with_explicit_groups() -> None:
    text = BASE + 'allocation: "sglang[prefill]:d2t2 + sglang[decode]:d1t4"\nprefill: {replicas: 2, tp: 2}\n'
    one_error(text + "decode: {tp: 2}\n", "decode.tp", "tp 2 disagrees with allocation (t4")
    checked(yaml_text(text + "decode: {tp: 4}\n"))
    one_error(text + "decode: {tp: 4}\nregular: {name: extra}\n", "group 'extra' is missing from allocation")


def test_allocation_error_points_into_the_string() -> None:
    err = one_error(BASE + 'allocation: "sglang[prefill]:d2t0"\n', "positive number")
    # The quote is at column 13, so character 20 of the string (the 0) is column 33.
    assert err.startswith("f.yaml:6:33:")


def test_allocation_needs_trainer_section_for_training_component() -> None:
    one_error(BASE + 'allocation: "sglang[prefill]:d1 + sglang[decode]:d1 + fsdp[t]:d2"\n', "no trainer section")


def test_all_errors_are_collected() -> None:
    errs = errors_of(BASE + "prefill: {tp: 4, attn_dp: 3, args: {port: 1, nope-flag: 2}}\n")
    assert len(errs) >= 4


def test_router_on_loopback_of_a_remote_node_warns() -> None:
    _, warnings = checked(yaml_text(BASE + "prefill: {}\ndecode: {}\n"))
    assert any("binds 127.0.0.1 on remote node n0" in w.message for w in warnings)
    _, warnings = checked(yaml_text(BASE + "prefill: {}\ndecode: {}\nrouter: {host: 0.0.0.0, api_key_env: K}\n"))
    assert not any("binds 127.0.0.1" in w.message for w in warnings)


def test_a_router_open_to_the_network_needs_a_client_key_or_says_it_does_not() -> None:
    with pytest.raises(TopologyError) as info:
        checked(yaml_text(BASE + "prefill: {}\ndecode: {}\nrouter: {host: 0.0.0.0}\n"))
    assert "router.host" in str(info.value) and "no client key" in str(info.value)
    for router in (
        "{host: 0.0.0.0, api_key_env: K}",
        "{host: 0.0.0.0, allow_unauthenticated: true}",
        "{host: 127.0.0.1}",
    ):
        checked(yaml_text(BASE + f"prefill: {{}}\ndecode: {{}}\nrouter: {router}\n"))


def test_colocate_rules_each_have_a_failing_case() -> None:
    head = "name: c\nmodel: {path: /m}\nnodes: [{name: n0, host: h, gpus: 4}, {name: n1, host: h2, gpus: 4}]\n"
    groups = "prefill: {tp: 2, nodes: [n0]}\ndecode: {tp: 2, nodes: [n1]}\n"
    trainer = "trainer: {command: [python, t.py]}\n"

    def colo(train="0.45", infer="0.45", extra="") -> str:
        return f"placement: {{mode: colocate, train_frac: {train}, infer_frac: {infer}{extra}}}\n"

    top, _ = checked(yaml_text(head + groups + trainer + colo()))
    assert top.placement.uses_mps
    # each fraction in (0, 1) (the schema), and the two with headroom
    one_error(head + groups + trainer + colo(train="0"), "placement.train_frac: 0 is less than or equal to")
    one_error(head + groups + trainer + colo(infer="1"), "placement.infer_frac: 1 is greater than or equal to")
    one_error(head + groups + trainer + colo(infer="0.5"), "headroom > 1")
    # engine GPUs == trainer world size, and rank i on engine GPU i (the same count per node, the engines' nodes)
    one_error(head + groups + trainer.replace("]}", "], nproc_per_node: 1}") + colo(), "nproc_per_node 1 != 2")
    uneven = "prefill: {tp: 2, nodes: [n0]}\ndecode: {tp: 4, nodes: [n1]}\n"
    one_error(head + uneven + trainer + colo(), "different GPU counts per node (n0: 2, n1: 4)")
    swapped = trainer.replace("]}", "], nodes: [n1, n0]}")
    one_error(head + groups + swapped + colo(), "trainer.nodes", "(n0, n1), not n1, n0")
    # MPS thread percentages: in 1..100 (the schema), for roles that exist
    one_error(
        head + groups + trainer + colo(extra=", mps_active_thread_percentage: {trainer: 0}"),
        "trainer: 0 is less than the minimum of 1",
    )
    one_error(
        head + groups + trainer + colo(extra=", mps_active_thread_percentage: {regular: 50}"), "no regular processes"
    )
    # no colocate keys when placement is separate
    for key in ("train_frac: 0.4", "mps: false", "mps_active_thread_percentage: {trainer: 50}"):
        one_error(head + groups + f"placement: {{mode: separate, {key}}}\n", "only applies to mode colocate")


def test_data_plane_rules_each_have_a_failing_case() -> None:
    head = "name: c\nmodel: {path: /m}\nnodes: [{name: n0, host: h, gpus: 4}]\n"
    trainer = "trainer: {command: [python, t.py]}\n"

    def colo(data_plane: str, mode: str = "colocate") -> str:
        fracs = ", train_frac: 0.4, infer_frac: 0.4" if mode == "colocate" else ""
        return f"placement: {{mode: {mode}{fracs}, data_plane: {data_plane}}}\n"

    top, _ = checked(yaml_text(head + "regular: {replicas: 2, tp: 2}\n" + trainer + colo("{batch_size: 4}")))
    assert top.placement.data_plane is not None and top.placement.data_plane.batch_size == 4
    one_error(head + "regular: {tp: 4}\n" + colo("{}", mode="separate"), "only applies to mode colocate")
    one_error(
        head + "prefill: {tp: 2}\ndecode: {tp: 2}\n" + trainer + colo("{}"),
        "f.yaml:5:1: decode:",
        "a decode engine computes no prompt hidden states",
    )
    one_error(head + "regular: {tp: 4}\n" + trainer + colo("{batch_size: 6}"), "not a multiple of regular's tp 4")
    one_error(head + "regular: {tp: 2, dp: 2}\n" + trainer + colo("{}"), "regular.dp", "needs dp 1")
    one_error(head + "regular: {tp: 2, pp: 2}\n" + trainer + colo("{}"), "regular.pp", "needs pp 1")
    sim = head.replace("model: {path: /m}", "model: {path: sim://tiny}\nengine: sim")
    sim_ipc = sim + "regular: {tp: 4}\n" + trainer + colo("{backend: cuda_ipc}")
    one_error(sim_ipc, "data_plane.backend: the sim runs on CPU")
    one_error(head + "regular: {tp: 4}\n" + trainer + colo("{backend: nccl}"), "data_plane.backend: NCCL refuses")
    # the schema: types and ranges, with the line of the value
    one_error(head + "regular: {tp: 4}\n" + trainer + colo("{batch_size: 0}"), "batch_size: 0 is less than")
    int8 = head + "regular: {tp: 4}\n" + trainer + colo("{dtype: int8}")
    one_error(int8, "data_plane.dtype: 'int8' is not one of", "float16, null")  # YAML's words, not Python's
    one_error(head + "regular: {tp: 4}\n" + trainer + colo("{aux_layers: [1, 1]}"), "has non-unique elements")
    unknown = colo("{timeout: 3}")
    one_error(head + "regular: {tp: 4}\n" + trainer + unknown, "unknown key 'timeout'", "did you mean 'timeout_secs'")


SWITCHING = BASE + "prefill: {role_switch: true}\ndecode: {role_switch: true}\n"


def test_role_switch_groups_follow_sglangs_rules() -> None:
    checked(yaml_text(SWITCHING))  # a prefill and a decode group that both allow it
    one_error(BASE + "regular: {role_switch: true}\n", "only prefill and decode engines switch roles")
    one_error(BASE + "prefill: {role_switch: true}\ndecode: {}\n", "no decode group with role_switch and tp 1")
    one_error(BASE + "prefill: {role_switch: true, tp: 2}\ndecode: {role_switch: true}\n", "no decode group")
    one_error(BASE + "prefill: {role_switch: true, pp: 2}\ndecode: {role_switch: true}\n", "pure TP (pp 1)")
    one_error(BASE + "prefill: {role_switch: true, tp: 16}\ndecode: {role_switch: true, tp: 16}\n", "on one node")
    one_error(
        BASE + "prefill: {role_switch: true, transfer_backend: nixl}\ndecode: {role_switch: true}\n",
        "transfer backend 'nixl' does not support a runtime role switch",
    )
    one_error(
        BASE + "prefill: {role_switch: true, args: {speculative-algorithm: EAGLE}}\ndecode: {role_switch: true}\n",
        "refuses speculative decoding (--speculative-algorithm) with --enable-pd-role-switch",
    )
    decode = "decode: {role_switch: true, %s}\n"
    policy = "args: {disaggregation-decode-allocation-policy: prefill_complete}"
    one_error(
        BASE + "prefill: {role_switch: true}\n" + decode % policy,
        "refuses runtime PD role switching with prefill_complete allocation",
    )
    one_error(
        BASE + "prefill: {role_switch: true}\n" + decode % "args: {disaggregation-decode-host-receive-threshold: 0.5}",
        "decode host receive does not support role switching",
    )
    one_error(
        BASE + "prefill: {role_switch: true}\n" + decode % "env: {SGLANG_DISAGG_STAGING_BUFFER: '1'}",
        "refuses the staging buffer with a runtime role switch",
    )
    checked(yaml_text(BASE + "prefill: {role_switch: true}\n" + decode % "env: {SGLANG_DISAGG_STAGING_BUFFER: '0'}"))


def test_planner_minimums_must_leave_something_to_move() -> None:
    """Minimums set, or left to the reserve (a quarter of the PD engines, one at least), that sum
    past the fleet are refused; the message says when the reserve took part."""
    pd = BASE + "prefill: {role_switch: true, replicas: 2}\ndecode: {role_switch: true, replicas: 2}\n"
    checked(yaml_text(pd + "planner: {mode: act}\n"))
    checked(yaml_text(pd + "planner: {mode: act, min_prefill: 3}\n"))  # 3 + the reserve's 1 = 4
    one_error(pd + "planner: {mode: act, min_prefill: 4}\n", "min_prefill 4 + min_decode 1 is more than the fleet's 4")
    one_error(pd + "planner: {mode: act, min_prefill: 4}\n", "(unset: a quarter of them)")
    one_error(pd + "planner: {mode: act, min_prefill: 2, min_decode: 3}\n", "min_prefill 2 + min_decode 3")


def test_the_graph_capture_at_up_is_on_where_the_planner_acts_unless_set() -> None:
    """``planner.capture_graphs_at_up`` unset follows the mode (act: on); set, it wins; a value
    that is no boolean is refused, saying where."""
    pd = BASE + "prefill: {role_switch: true, replicas: 2}\ndecode: {role_switch: true, replicas: 2}\n"

    def captures(planner: str) -> bool:
        top, _ = checked(yaml_text(pd + f"planner: {planner}\n"))
        assert top.planner is not None
        return top.planner.captures_at_up()

    assert captures("{mode: act}") and not captures("{mode: advise}") and not captures("{mode: 'off'}")
    assert not captures("{mode: act, capture_graphs_at_up: false}")
    assert captures("{mode: advise, capture_graphs_at_up: true}")
    one_error(pd + "planner: {mode: act, capture_graphs_at_up: sometimes}\n", "capture_graphs_at_up")


def test_a_fleet_whose_planner_acts_routes_power_of_two_unless_the_file_says() -> None:
    """round_robin by default; power_of_two where the planner acts (new prompts go to the prefills
    a move just made); a policy the file names wins."""
    pd = BASE + "prefill: {role_switch: true, replicas: 2}\ndecode: {role_switch: true, replicas: 2}\n"

    def policy(extra: str) -> str:
        top, _ = checked(yaml_text(pd + extra))
        return top.router.policy

    assert policy("") == "round_robin" and policy("planner: {mode: advise}\n") == "round_robin"
    assert policy("planner: {mode: act}\n") == "power_of_two"
    assert policy("planner: {mode: act}\nrouter: {policy: round_robin}\n") == "round_robin"
