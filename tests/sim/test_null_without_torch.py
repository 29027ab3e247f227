"""The null engine (router benchmarks, a plain install's smoke tests) needs no torch."""

from __future__ import annotations

import subprocess
import sys

NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
        return None

sys.meta_path.insert(0, NoTorch())
import pdctl.sim.null
print("imported", "torch" in sys.modules)
"""


def test_the_null_engine_imports_without_torch() -> None:
    res = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "imported False", res.stderr[-2000:]


SIM_WITHOUT_TORCH = NO_TORCH.replace(
    'import pdctl.sim.null\nprint("imported", "torch" in sys.modules)\n',
    "from pdctl.sim.__main__ import main\nmain(sys.argv[1:])\n",
)


def test_the_sims_null_mode_serves_a_cluster_engines_flags_without_torch(tmp_path) -> None:
    """``python -m pdctl.sim --sim-null`` (topology ``args: {sim-null: true}``) takes the flags
    `pdctl up` gives an engine: its role, bootstrap port, key (checked as SGLang checks it),
    version and port file, with torch unimportable."""
    from tests.helpers import bound_ports, get

    port_file = tmp_path / "ports.json"
    argv = [sys.executable, "-c", SIM_WITHOUT_TORCH, "--sim-null", "--model-path", "sim://tiny", "--port", "0"]
    argv += ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0", "--api-key", "k3y"]
    argv += ["--weight-version", "v7", "--sim-port-file", str(port_file)]
    log = tmp_path / "null.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        ports = bound_ports(port_file, proc, log)
        url = f"http://127.0.0.1:{ports['port']}"
        assert get(url + "/health")[0] == 200  # open, as SGLang's
        assert get(url + "/model_info")[0] == 401
        status, info = get(url + "/model_info", headers={"Authorization": "Bearer k3y"})
        assert status == 200 and info["weight_version"] == "v7" and info["disaggregation_mode"] == "prefill"
        assert get(f"http://127.0.0.1:{ports['bootstrap_port']}/health")[0] == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]


def test_a_bad_sim_flag_is_refused_before_torch_is_imported() -> None:
    """The sim parses its flags first: a typo costs no torch import (3 s of CPU) to refuse."""
    argv = [sys.executable, "-c", SIM_WITHOUT_TORCH, "--model-path", "sim://tiny", "--no-such-flag"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--no-such-flag" in res.stderr, res.stderr[-2000:]


def test_the_null_engine_refuses_what_needs_a_model() -> None:
    hooks = '[{"name": "h", "target_modules": ["model.layers.0"], "hook_factory": "m:f"}]'
    for extra in (["--nnodes", "2", "--tp-size", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:5000"],
                  ["--sim-profile", "llama3-8b-h100"], ["--forward-hooks", hooks]):  # fmt: skip
        argv = [sys.executable, "-c", SIM_WITHOUT_TORCH, "--sim-null", "--model-path", "sim://tiny", *extra]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and f"{extra[0]} needs the sim proper" in res.stderr, (extra, res.stderr[-2000:])
