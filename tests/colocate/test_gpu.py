"""The data plane between two processes on one GPU (marked gpu; needs a CUDA device; not run on
the CPU machines this project is built on, so a session with a GPU runs it:
``pytest -m gpu tests/colocate/test_gpu.py``).

cuda_ipc: the engine process writes its CUDA rows straight into the trainer's buffer on the same
device, with and without the MPS daemon that colocation runs; gloo: the same rows staged through
host memory. (NCCL cannot be a backend here: it refuses two ranks of one communicator on one
GPU, "Duplicate GPU detected", as seen with NCCL 2.28.9 on an H100.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pdctl.node import mps
from tests.conftest import REPO
from tests.helpers import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PAIR = Path(__file__).with_name("gpu_pair.py")
HAS_MPS = shutil.which(mps.CONTROL_BINARY) is not None


@contextmanager
def mps_daemon(tmp_path: Path, on: bool) -> Iterator[dict[str, str]]:
    """The environment of an MPS client of a fresh daemon (or none)."""
    if not on:
        yield {}
        return
    req = {"pipe_dir": str(tmp_path / "mps-pipe"), "log_dir": str(tmp_path / "mps-log")}
    daemon = mps.start(req)
    assert daemon["started"], daemon
    try:
        yield {"CUDA_MPS_PIPE_DIRECTORY": req["pipe_dir"], "CUDA_MPS_LOG_DIRECTORY": req["log_dir"]}
    finally:
        mps.stop({**req, **daemon, "grace_secs": 30})


def run_pair(tmp_path: Path, backend: str, env: dict[str, str], *extra: str) -> tuple[dict, dict | None]:
    port = free_port()
    env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(PAIR), role, str(port), backend, str(tmp_path / f"{role}.json"), *extra],
            env=env,
            stdout=(tmp_path / f"{role}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for role in ("trainer", "engine")
    }
    codes = {role: proc.wait(timeout=300) for role, proc in procs.items()}
    assert codes["trainer"] == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    engine_out = tmp_path / "engine.json"
    return trainer, json.loads(engine_out.read_text()) if engine_out.exists() else None


@pytest.mark.parametrize(
    ("backend", "under_mps"),
    [
        ("gloo", False),
        ("cuda_ipc", False),
        pytest.param("cuda_ipc", True, marks=pytest.mark.skipif(not HAS_MPS, reason="needs nvidia-cuda-mps-control")),
    ],
)
def test_steps_between_two_processes_on_one_gpu_arrive_bit_for_bit(tmp_path, backend, under_mps) -> None:
    """Three steps (the second outgrows the trainer's buffer, the third fits it), final and
    auxiliary hidden states cast to bfloat16 by the engine, each equal to what the engine had."""
    with mps_daemon(tmp_path, under_mps) as env:
        trainer, engine = run_pair(tmp_path, backend, env)
    assert engine == {"failure": None, "steps_sent": 3}, (engine, trainer)
    assert trainer["error"] is None, trainer
    assert [s["step"] for s in trainer["steps"]] == [0, 1, 2]
    for s in trainer["steps"]:
        assert s["hidden_equal"] and s["aux_equal"] and s["ids_equal"], s
        assert s["dtype"] == "torch.bfloat16" and s["device"] == ("cpu" if backend == "gloo" else "cuda:0"), s
    assert [s["seq_lens"] for s in trainer["steps"]] == [[64] * 4, [128] * 4, [32] * 4]
    if backend == "cuda_ipc":
        assert trainer["buffers"] == 2, trainer  # (allocated at step 0, grown at step 1, reused at step 2)


def test_an_engine_that_dies_mid_run_fails_the_trainers_recv_naming_it(tmp_path) -> None:
    trainer, _ = run_pair(tmp_path, "cuda_ipc", {}, "1")
    assert [s["step"] for s in trainer["steps"]] == [0], trainer
    error = trainer["error"]
    assert error and (error["engine"], error["rank"], error["step"]) == ("gpu-engine", 1, 1), trainer
    assert "engine gpu-engine" in error["message"], error
