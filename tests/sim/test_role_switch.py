"""The sim's ``/pd_role_switch`` as SGLang 0.5.23 answers it (sglang-protocol.md 7.3): its refusals
in SGLang's order and words, an engine switched both ways serving PD in its new role."""

from __future__ import annotations

import concurrent.futures as cf
import json

from pdctl.sglang import FAKE_BOOTSTRAP_HOST
from tests.helpers import eventually, get, pd_body, post, sims

SWITCH = "/pd_role_switch"
BODY = {"text": "switch me", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def _bootstrap_port(sim) -> int:
    return json.loads(sim.port_file.read_text())["bootstrap_port"]


def _mode(sim) -> tuple[str, str, str]:
    info = get(sim.url + "/server_info")[1]
    return (
        get(sim.url + "/model_info")[1]["disaggregation_mode"],
        info["disaggregation_mode"],
        info["internal_states"][0]["disaggregation_mode"],
    )


def test_refusals_come_in_sglangs_order_and_words(tmp_path) -> None:
    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill", "--enable-pd-role-switch", "--sim-prefill-ms-per-token", "30"),
        ("--disaggregation-mode", "prefill"),
        ("--enable-pd-role-switch",),
    ) as (switchable, plain, null):
        code, out = post(plain.url + SWITCH, {"new_role": "decode"})
        assert code == 400 and out["message"] == "--enable-pd-role-switch is not set on this server", out
        assert out["safe_to_restore"] is True and out["old_role"] == "prefill"
        code, out = post(null.url + SWITCH, {"new_role": "decode"})
        assert code == 400 and out["message"] == "instance is not running in PD disaggregation mode", out
        code, out = post(switchable.url + SWITCH, {"new_role": ""})
        assert code == 400 and out["message"] == "invalid new_role=''", out
        assert post(switchable.url + SWITCH, {"new_role": "both"})[0] == 400  # the body's Literal
        code, out = post(switchable.url + SWITCH, {"new_role": "prefill"})  # its own role: "ok"
        assert code == 200 and out == {
            "success": True,
            "message": "ok",
            "old_role": "prefill",
            "new_role": "prefill",
            "safe_to_restore": False,
        }
        code, out = post(switchable.url + SWITCH, {"new_role": "decode"})  # launched as prefill: no graphs
        assert (
            code == 400 and out["message"] == "decode_cuda_graph_memory_gb is required before capturing decode graphs"
        )
        code, out = post(switchable.url + SWITCH, {"new_role": "decode", "decode_cuda_graph_memory_gb": -1})
        assert code == 400 and out["message"] == "decode_cuda_graph_memory_gb must be non-negative"
        ready = {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.5, "prepare_only": True}
        code, out = post(switchable.url + SWITCH, ready)
        assert code == 200 and out["message"] == "ready" and _mode(switchable)[0] == "prefill"

        busy = {**BODY, "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 1, "text": "busy " * 40}
        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, switchable.url + "/generate", busy)

            def prefilling() -> bool:
                assert not running.done(), running.result()
                return get(switchable.url + "/server_info")[1]["internal_states"][0]["num_running_reqs"] >= 1

            eventually(prefilling, 60, interval=0.01, what="the prompt prefilling")
            code, out = post(switchable.url + SWITCH, {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.5})
            assert code == 400 and out["message"] == "instance is not idle; drain all requests before switching"
            assert out["safe_to_restore"] is True and running.result()[0] == 200
        assert _mode(switchable) == ("prefill", "prefill", "prefill")


def test_engines_switched_both_ways_serve_pd_in_their_new_roles(tmp_path) -> None:
    """A prefill becomes a decode and a decode a prefill (its bootstrap server runs from the start
    with the flag); a PD request through the pair gives what the pair in their first roles gave."""
    flags = ("--enable-pd-role-switch", "--disaggregation-bootstrap-port", "0")
    with sims(
        tmp_path,
        ("--disaggregation-mode", "prefill", *flags),
        ("--disaggregation-mode", "decode", *flags),
    ) as (first, second):

        def pd(prefill, decode, room: int) -> dict:
            body = pd_body(BODY, prefill, room=room)
            body["bootstrap_port"] = _bootstrap_port(prefill)
            with cf.ThreadPoolExecutor(1) as pool:
                leg = pool.submit(post, prefill.url + "/generate", body)
                code, out = post(decode.url + "/generate", body)
                assert leg.result()[0] == 200
            assert code == 200, out
            return out

        before = pd(first, second, room=11)
        code, out = post(first.url + SWITCH, {"new_role": "decode", "decode_cuda_graph_memory_gb": 0})
        assert code == 200 and out["message"] == "ok" and out["old_role"] == "prefill", out
        code, out = post(second.url + SWITCH, {"new_role": "prefill"})  # started as decode: graphs exist
        assert code == 200 and out["message"] == "ok", out
        # /server_info's top level is the start-up configuration; internal_states the live role
        assert _mode(first) == ("decode", "prefill", "decode")
        assert _mode(second) == ("prefill", "decode", "prefill")
        after = pd(second, first, room=12)
        assert after["text"] == before["text"] and after["meta_info"]["completion_tokens"] == 6
