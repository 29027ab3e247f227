"""`pdctl weights status` and `pdctl weights load` against a cluster started with `pdctl up`:
a trainer (the RL example) pushes through a router that wants an API key, then checkpoints are
loaded from disk, one good and one missing."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from pdctl.sim.model import PRESETS, TinyLM, save_checkpoint
from pdctl.weights.buckets import tensor_checksum
from tests.helpers import engine_auth, eventually, free_port_base, local_topology, pdctl, post

KEY_ENV = "PDCTL_TEST_ROUTER_KEY"


def _status(env: dict) -> tuple[int, dict]:
    out = pdctl("weights", "status", "--json", env=env)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def test_weights_status_and_load(tmp_path) -> None:
    trainer = {
        "command": ["python", "-m", "pdctl.examples.rl_sim", "--steps", "1", "--push-every", "1", "--group", "2"],
        "nproc_per_node": 1,
    }
    topo = local_topology(
        tmp_path,
        "wcli",
        free_port_base(),
        router={"policy": "round_robin", "api_key_env": KEY_ENV},
        trainer=trainer,
        weights={"backend": "gloo", "bucket_mb": 1},
        nodes=[{"name": "me", "host": "127.0.0.1", "gpus": 3, "workdir": str(tmp_path / "runs")}],
    )
    key = "k-" + os.urandom(8).hex()
    env = {**os.environ, "PDCTL_HOME": str(tmp_path / "home"), KEY_ENV: key}
    up = pdctl("up", topo, env=env)
    assert up.returncode == 0, up.stderr
    url = next(line.split()[-1] for line in up.stdout.splitlines() if line.startswith("router:"))
    try:
        # The trainer got the router's key (its push needs /pdctl/hold) and pushes once.
        def pushed() -> tuple[int, dict] | None:
            code, st = _status(env)
            return (code, st) if (st["last_push"] or {}).get("state") == "complete" else None

        code, st = eventually(pushed, 120, interval=0.5, what="the trainer's push complete")
        pushed = st["last_push"]["version"]
        assert code == 0 and st["ok"], st
        assert [e["version"] for e in st["engines"]] == [pushed, pushed]
        planned = [e["planned_ranks"] for e in st["engines"]]
        assert [e["group_ranks"] for e in st["engines"]] == planned == [[1, 1], [2, 2]]
        assert st["group"]["world_size"] == 3 and st["last_push"]["failed"] == {}

        # A checkpoint from disk: every engine holds exactly its tensors, under the given version.
        model = TinyLM(replace(PRESETS["tiny"], seed=99))
        save_checkpoint(model, tmp_path / "ckpt-99")
        load = pdctl("weights", "load", str(tmp_path / "ckpt-99"), env=env)
        assert load.returncode == 0 and "as version ckpt-99 into 2 engine(s)" in load.stdout, load.stderr
        code, st = _status(env)
        assert code == 0 and [e["version"] for e in st["engines"]] == ["ckpt-99", "ckpt-99"]
        want = {n: tensor_checksum(n, t, "full") for n, t in model.named_parameters()}
        for engine in st["engines"]:
            status, sums = post(
                engine["url"] + "/weights_checker",
                {"names": list(want), "mode": "full"},
                headers=engine_auth("wcli", env["PDCTL_HOME"]),
            )
            assert status == 200 and sums["checksums"] == want

        # A missing checkpoint: every engine refuses and keeps what it had; the fleet serves on.
        bad = pdctl("weights", "load", str(tmp_path / "missing"), "--version", "nope", env=env)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
        assert "error: loading" in bad.stderr and "kept their previous weights" in bad.stderr, bad.stderr
        code, st = _status(env)
        assert code == 0 and [e["version"] for e in st["engines"]] == ["ckpt-99", "ckpt-99"]
        assert all(e["out_of_rotation"] is None for e in st["engines"])
        status, out = post(
            url + "/generate",
            {"text": "after", "sampling_params": {"max_new_tokens": 3}},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert status == 200 and out["meta_info"]["weight_version"] == "ckpt-99"

        # bench through the router with the client key (the cluster's own, from the state), engine
        # metrics read alongside: the whole lifecycle works with every key set
        bench = pdctl("bench", "wcli", "--num-prompts", "4", "--output-len", "4", "--input-len", "8", env=env)
        assert bench.returncode == 0 and "Traceback" not in bench.stderr, bench.stderr + bench.stdout

        # pdctl's own commands use the cluster's control-plane key, not the client key: they work
        # without it; an engine refuses a caller without the engine key.
        nokey = pdctl("weights", "status", env={k: v for k, v in env.items() if k != KEY_ENV})
        assert nokey.returncode == 0, nokey.stderr
        engine_url = st["engines"][0]["url"]
        assert post(engine_url + "/pause_generation", {"mode": "abort"})[0] == 401
        assert post(engine_url + "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt-99")})[0] == 401
        client = {"Authorization": f"Bearer {key}"}  # the client key is no engine key either
        assert post(engine_url + "/pause_generation", {"mode": "abort"}, headers=client)[0] == 401
        assert (
            post(url + "/workers", {"url": "http://127.0.0.1:1"}, headers={"Authorization": f"Bearer {key}"})[0] == 401
        )
    finally:
        assert pdctl("down", env=env).returncode == 0
    gone = pdctl("weights", "status", "wcli", env=env)
    assert gone.returncode == 1 and "is down" in gone.stderr
