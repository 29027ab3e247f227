"""The data plane between two processes on one GPU (marked gpu; needs a CUDA device; not run on
the CPU machines this project is built on, so a session with a GPU runs it:
``pytest -m gpu tests/colocate/test_gpu.py``).

nccl: CUDA tensors from the engine process straight into the trainer's CUDA buffer on the same
device; NCCL >= 2.5 may refuse two ranks of one communicator on one GPU ("Duplicate GPU
detected"), in which case recv's error must say to use gloo (docs/colocate.md). gloo: the same
CUDA rows staged through host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.helpers import free_port

pytestmark = pytest.mark.gpu
PAIR = Path(__file__).with_name("gpu_pair.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_step_between_two_processes_on_one_gpu(tmp_path, backend) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(PAIR), role, str(port), backend, str(tmp_path / f"{role}.json")],
            env=env,
            stdout=(tmp_path / f"{role}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for role in ("trainer", "engine")
    }
    for role, proc in procs.items():
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{role}.log").read_text()[-3000:]
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    engine = json.loads((tmp_path / "engine.json").read_text())
    if "error" in trainer and "Duplicate GPU" in (tmp_path / "trainer.log").read_text() + trainer["error"]:
        assert "set placement.data_plane.backend: gloo" in trainer["error"], trainer
        pytest.fail(f"NCCL refuses two ranks on one GPU here: {trainer['error']}")
    assert engine == {"failure": None, "steps_sent": 1}, engine
    assert trainer["equal"] and trainer["ids"] and trainer["dtype"] == "torch.bfloat16", trainer
    assert trainer["device"] == ("cpu" if backend == "gloo" else "cuda:0"), trainer
