"""The sim's `--forward-hooks` (loaded and registered as SGLang's hook manager does) and
`return_hidden_states` (SGLang's `meta_info.hidden_states`): a user's hook on `model.norm` sees
exactly the hidden states the HTTP answer carries, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdctl.sim.hooks import parse_hook_specs
from tests.helpers import SimProcess, post

PROBE = '''
import json


def factory(config):
    """A forward hook that appends each output (shape and values) to config["path"]."""
    def hook(module, inputs, output):
        with open(config["path"], "a") as out:
            out.write(json.dumps({"shape": list(output.shape), "values": output.tolist()}) + "\\n")
    return hook


def nothing(config):
    return None
'''


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hooks")
    (tmp / "hook_probe.py").write_text(PROBE)
    seen = tmp / "seen.jsonl"
    hooks = [
        {"name": "probe", "target_modules": ["model.nor*"], "hook_factory": "hook_probe:factory",
         "config": {"path": str(seen)}},
        {"name": "none", "target_modules": ["lm_head"], "hook_factory": "hook_probe.nothing"},
        {"name": "nowhere", "target_modules": ["no.such.*"], "hook_factory": "hook_probe:factory", "config": {}},
    ]  # fmt: skip
    sim = SimProcess(tmp, "--enable-return-hidden-states", "--forward-hooks", json.dumps(hooks),
                     "--skip-server-warmup", env={"PYTHONPATH": str(tmp)}).start()  # fmt: skip
    try:
        yield sim, seen
    finally:
        sim.stop()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_hook_on_model_norm_sees_the_hidden_states_the_answer_returns(hooked) -> None:
    sim, seen = hooked
    before = len(_lines(seen))
    body = {"text": "hidden states", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_hidden_states": True}  # fmt: skip
    status, out = post(sim.url + "/generate", body)
    assert status == 200, out
    rows = out["meta_info"]["hidden_states"]
    prompt = out["meta_info"]["prompt_tokens"]
    # SGLang's layout: the prompt's rows from the prefill, then one row per decode step
    assert len(rows) == 4 and len(rows[0]) == prompt and all(len(r) == 64 for r in rows[0]) and len(rows[1]) == 64
    calls = _lines(seen)[before:]
    assert [c["shape"] for c in calls] == [[prompt, 64], [1, 64], [1, 64], [1, 64]]
    assert calls[0]["values"] == rows[0] and [c["values"][0] for c in calls[1:]] == rows[1:]  # bit for bit
    log = sim.log.read_text()
    assert "registered forward hook 'probe' on model.norm" in log
    assert (
        "'hook_probe.nothing' of spec 'none' returned None" in log and "no modules matched hook spec 'nowhere'" in log
    )


def test_hidden_states_only_when_asked_and_refused_where_not_enabled(hooked, tmp_path) -> None:
    sim, _ = hooked
    status, out = post(sim.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and "hidden_states" not in out["meta_info"]
    with_batch = {"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 2}, "return_hidden_states": [True, False]}
    status, out = post(sim.url + "/generate", with_batch)
    assert status == 200 and "hidden_states" in out[0]["meta_info"] and "hidden_states" not in out[1]["meta_info"]
    plain = SimProcess(tmp_path, "--skip-server-warmup").start()
    try:
        status, out = post(plain.url + "/generate", {"text": "x", "return_hidden_states": True})
        assert status == 400 and "--enable-return-hidden-states" in json.dumps(out), out
    finally:
        plain.stop()


def test_bad_hook_specs_fail_clearly() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        parse_hook_specs("[{")
    with pytest.raises(ValueError, match="list of objects"):
        parse_hook_specs('{"name": "x"}')
    bad = json.dumps([{"name": "x", "target_modules": ["model.norm"], "hook_factory": "no_such_module:f"}])
    run = subprocess.run(
        [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--port", "0", "--forward-hooks", bad],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1 and "cannot import 'no_such_module'" in run.stderr and "Traceback" not in run.stderr
    garbled = subprocess.run(
        [sys.executable, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--forward-hooks", "[{"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert garbled.returncode == 2 and "--forward-hooks: Invalid JSON list" in garbled.stderr  # SGLang's json_list_type
