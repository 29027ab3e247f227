"""The real CUDA MPS daemon with a trainer process and an engine process on one GPU, each
held to its memory fraction (marked gpu; needs CUDA and nvidia-cuda-mps-control)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pdctl.node import mps

pytestmark = pytest.mark.gpu

CLIENT = """
import json, os, sys, torch
from pdctl.weights import apply_memory_fraction
role, fraction = sys.argv[1], float(sys.argv[2])
if role == "trainer":
    applied = apply_memory_fraction()          # reads PDCTL_TRAIN_FRAC, as a colocated trainer does
else:
    torch.cuda.set_per_process_memory_fraction(fraction, 0)   # what --mem-fraction-static bounds in SGLang
    applied = fraction
total = torch.cuda.get_device_properties(0).total_memory
within = torch.empty(int(total * fraction * 0.8), dtype=torch.uint8, device="cuda")
try:
    beyond = torch.empty(int(total * fraction * 0.5), dtype=torch.uint8, device="cuda")
    refused = False
except torch.OutOfMemoryError:
    refused = True
print(json.dumps({"role": role, "applied": applied, "refused_past_fraction": refused}), flush=True)
sys.stdin.readline()  # stay an MPS client until the test has looked at the server list
"""


@pytest.mark.skipif(
    not torch.cuda.is_available() or shutil.which(mps.CONTROL_BINARY) is None,
    reason="needs a CUDA device and nvidia-cuda-mps-control",
)
def test_real_daemon_two_processes_on_one_gpu_with_their_fractions(tmp_path) -> None:
    req = {"pipe_dir": str(tmp_path / "pipe"), "log_dir": str(tmp_path / "log")}
    daemon = mps.start(req)
    assert daemon["started"]
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": req["pipe_dir"], "CUDA_MPS_LOG_DIRECTORY": req["log_dir"],
           "CUDA_VISIBLE_DEVICES": "0", "PDCTL_TRAIN_FRAC": "0.4"}  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        procs += [
            subprocess.Popen([sys.executable, "-c", CLIENT, role, "0.4"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
            for role in ("trainer", "engine")
        ]  # fmt: skip
        results = [json.loads(p.stdout.readline()) for p in procs]  # both hold their memory now
        servers = subprocess.run(
            [shutil.which(mps.CONTROL_BINARY)], input="get_server_list\n", env=env, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        for p in procs:
            p.communicate("\n", timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stopped = mps.stop({**req, **daemon, "grace_secs": 30})
    assert all(p.returncode == 0 for p in procs)
    assert [r["applied"] for r in results] == [0.4, 0.4]
    assert all(r["refused_past_fraction"] for r in results), results
    assert servers.stdout.strip(), "no MPS server ran while the two clients did"
    assert not stopped["forced"], stopped
