"""CUDA tensors through a push (marked gpu; needs one CUDA device).

The trainer's model lives on the GPU: buckets are flattened there and broadcast by gloo
(which takes CUDA tensors) to the CPU sims. NCCL itself needs a second GPU for the receiving
ranks; the code path is the same with ``backend="nccl"``."""

from __future__ import annotations

import pytest
import torch

from pdctl.sim import weights_checksum
from tests.helpers import post
from tests.weights.conftest import model, sync_for

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_reach_every_engine(fleet):
    procs, router = fleet
    trainer = model(seed=31)
    expected = weights_checksum(trainer)
    on_gpu = [(name, p.detach().to("cuda")) for name, p in trainer.named_parameters()]
    with sync_for(procs, router, bucket_mb=0.05, verify="full", load_format="flattened_bucket") as sync:
        report = sync.push(on_gpu, version="cuda-31")
    assert report.engines == ["e0", "e1", "e2"] and report.load_format == "flattened_bucket"
    assert sync.group._staging is not None and sync.group._staging.is_cuda
    for p in procs:
        status, out = post(p.url + "/weights_checker", {"action": "checksum"})
        assert status == 200 and out["checksums"] == expected, p.url
