"""slime's external-engine mode against a pdctl cluster, byte for byte as slime main (624b824a) sends
it with ``requests`` (slime's own code is on GitHub only, so its calls are replayed here from
``slime/backends/sglang_utils/{external,sglang_engine}.py``, ``update_weight_from_distributed.py``
and ``server_control.py``): it reaches the engines themselves, with no key, so the topology says
``engine_auth: none``; with the default the same first call is refused (what slime met before).
Its discovery, its checks of each engine's ``/server_info``, its registration with the router, its
weight group, rollouts through the router and its abort-until-idle (``/v1/loads``) all work; its
weight update is refused for want of SGLang 0.5.21+'s weight-update session, as SGLang 0.5.23
itself refuses it (slime's image pins SGLang 0.5.15)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import requests
import yaml

from pdctl.sglang.control import OUTSIDE_SESSION
from pdctl.sglang.group import destroy_group, init_custom_process_group
from pdctl.sim.model import PRESETS, TinyLM
from tests.helpers import free_port_base

SEED = 91


def pdctl(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def topology(tmp_path, name: str, **extra) -> str:
    topo = tmp_path / f"{name}.yaml"
    body = {
        "name": name,
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [{"name": "me", "host": "127.0.0.1", "gpus": 5, "workdir": str(tmp_path / "runs")}],
        "ports": {"base": free_port_base()},
        "prefill": [{"name": "p1", "tp": 1}, {"name": "p2", "tp": 2}],
        "decode": {"tp": 2},
        "router": {"control_open_from": ["127.0.0.1/32"]},  # slime's POST /workers sends no key either
        "weights": {"backend": "gloo"},
        **extra,
    }
    topo.write_text(yaml.safe_dump(body))
    return str(topo)


def server_info(url: str) -> dict:
    """slime's ``get_server_info``: /server_info, else /get_server_info."""
    for endpoint in ("/server_info", "/get_server_info"):
        try:
            response = requests.get(f"{url}{endpoint}", timeout=30.0)
            response.raise_for_status()
            return response.json()
        except Exception:
            continue
    raise RuntimeError(f"no server info from {url}")


def test_slime_external_engines_drive_a_fleet_with_engine_auth_none(tmp_path) -> None:
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    topo = topology(tmp_path, "slime", engine_auth="none")
    checked = pdctl("validate", topo, env=env)
    assert checked.returncode == 0 and "answer every caller that reaches their ports" in checked.stdout + checked.stderr
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        found = json.loads(pdctl("endpoints", "slime", "--json", env=env).stdout)
        addrs = found["settings"]["slime"]["--rollout-external-engine-addrs"].split()
        router = found["router"]
        # -- discovery (external.py): tp/pp/num_gpus and the worker type, from each engine ------------------
        infos = [server_info(f"http://{a}" if "://" not in a else a) for a in addrs]
        gpus = [int(i.get("num_gpus") or (i.get("tp_size") or 1) * (i.get("pp_size") or 1)) for i in infos]
        kinds = [i["disaggregation_mode"] if i.get("disaggregation_mode") in ("prefill", "decode") else "regular"
                 for i in infos]  # fmt: skip
        assert gpus == [1, 2, 2] and kinds == ["prefill", "prefill", "decode"]
        # -- the actor's checks (_sanity_check_server_args): the fields slime sets itself -------------------
        for info, kind in zip(infos, kinds, strict=True):
            assert info.get("enable_memory_saver") is False  # == --offload-rollout
            assert info.get("disaggregation_mode") == kind
            if kind == "prefill":
                assert info.get("load_balance_method") == "follow_bootstrap_room"
                assert isinstance(info.get("disaggregation_bootstrap_port"), int)
        # -- registration with the router (_register_to_router) ----------------------------------------------
        for addr, info, kind in zip(addrs, infos, kinds, strict=True):
            payload = {"url": f"http://{addr.removeprefix('http://')}", "worker_type": kind}
            if kind == "prefill":
                payload["bootstrap_port"] = info["disaggregation_bootstrap_port"]
            response = requests.post(f"{router}/workers", json=payload)
            response.raise_for_status()
        # -- a weight update from distributed (update_weight_from_distributed.py) ---------------------------
        urls = [f"http://{a.removeprefix('http://')}" for a in addrs]
        cumulative = [0, 1, 3]
        world_size = sum(gpus) + 1
        with socket.socket() as sock:
            sock.bind(("", 0))
            master_port = sock.getsockname()[1]
        pool = cf.ThreadPoolExecutor(8)

        def call(url: str, path: str, payload: dict | None = None) -> dict:
            response = requests.post(f"{url}{path}", json=payload or {})
            response.raise_for_status()
            return response.json()

        refs = [
            pool.submit(
                call,
                url,
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": master_port,
                    "rank_offset": cumulative[i] + 1,
                    "world_size": world_size,
                    "group_name": "slime-pp_0",
                    "backend": "gloo",
                },
            )
            for i, url in enumerate(urls)
        ]
        group = init_custom_process_group(
            backend="gloo", master_address="127.0.0.1", master_port=master_port, world_size=world_size, rank=0,
            group_name="slime-pp_0",
        )  # fmt: skip
        assert all(r.result()["success"] for r in refs)
        model = TinyLM(replace(PRESETS["tiny"], seed=SEED))
        params = list(model.named_parameters())
        try:
            for url in urls:
                requests.post(f"{url}/pause_generation", json={}).raise_for_status()
            for url in urls:  # slime retries a GET until 200
                assert requests.get(f"{url}/flush_cache").status_code == 200
            bucket = params[:8]
            payload = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": "slime-pp_0",
                "flush_cache": False,
                "weight_version": "1",
            }
            # slime main sends no /begin_weight_update: SGLang 0.5.21+ (the sim speaks 0.5.23) refuses the
            # update before its receive, and slime's raise_for_status raises. slime's image pins SGLang
            # 0.5.15; docs/frameworks.md says so. (Through the router the session is opened for it.)
            refused = [requests.post(f"{url}/update_weights_from_distributed", json=payload) for url in urls]
            assert all(r.status_code == 400 and OUTSIDE_SESSION in r.json()["message"] for r in refused)
            for url in urls:
                requests.post(f"{url}/continue_generation", json={}).raise_for_status()
        finally:
            destroy_group(group)
        for url in urls:  # nothing moved
            assert requests.get(f"{url}/model_info").json()["weight_version"] == "default"
        # -- a rollout through the router, then slime's abort-until-idle (server_control.py) -------------------
        answer = requests.post(
            f"{router}/generate",
            json={"sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True,
                  "input_ids": list(b"slime rollout")},
        )  # fmt: skip
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 8, answer.text
        workers = requests.get(f"{router}/workers").json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(urls)
        for w in workers:
            requests.post(f"{w['url']}/abort_request", json={"abort_all": True}).raise_for_status()
            load = requests.get(f"{w['url']}/v1/loads?include=core").json()
            assert sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in load["loads"]) == 0, load
        pool.shutdown()
    finally:
        down = pdctl("down", "slime", env=env)
        assert down.returncode == 0, down.stderr


def test_with_the_default_engine_key_slime_is_refused_and_a_frameworks_pause_is_named_everywhere(tmp_path) -> None:
    """Default engine_auth: slime's first call gets 401. And a framework's pause (keyless, from
    control_open_from) that nothing continues: `pdctl status` names the hold and shows the engines
    paused, not down, and exits 1; so does `pdctl weights status`; both are fine again after the
    framework's continue."""
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home")}
    # (one tp-1 engine per role: the key and the pause are the subject, not mixed tp, which the
    # keyless test drives; a tp-2 sim starts a helper process that imports torch again)
    topo = topology(tmp_path, "keyed", prefill={"tp": 1}, decode={"tp": 1})
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    try:
        found = json.loads(pdctl("endpoints", "keyed", "--json", env=env).stdout)
        addr = found["settings"]["slime"]["--rollout-external-engine-addrs"].split()[0]
        response = requests.get(f"http://{addr.removeprefix('http://')}/server_info", timeout=30.0)
        assert response.status_code == 401
        router = found["router"]
        assert requests.post(f"{router}/pause_generation", json={}).status_code == 200
        status = pdctl("status", "keyed", "--json", env=env)
        assert status.returncode == 1, status.stdout
        st = json.loads(status.stdout)
        assert "held by a framework's pause" in st["hold"]["reason"] and st["ok"] is False, st["hold"]
        assert all(e["up"] and e["rotation"].startswith("paused:") for e in st["engines"]), st["engines"]
        text = pdctl("status", "keyed", env=env)
        assert "requests wait: the router is held by a framework's pause" in text.stdout and "DOWN" not in text.stdout
        weights = pdctl("weights", "status", "keyed", env=env)
        assert weights.returncode == 1 and "held by a framework's pause" in weights.stdout, weights.stdout
        assert requests.post(f"{router}/continue_generation", json={}).status_code == 200
        assert pdctl("status", "keyed", env=env).returncode == 0
        assert pdctl("weights", "status", "keyed", env=env).returncode == 0
    finally:
        assert pdctl("down", "keyed", env=env).returncode == 0
