"""``apply_memory_fraction``: the colocated trainer's cap on its share of the GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from pdctl.errors import WeightSyncError
from pdctl.weights import apply_memory_fraction


def test_not_colocated_is_a_no_op() -> None:
    assert apply_memory_fraction(env={}) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_cuda_it_says_so_and_applies_nothing(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pdctl.weights"):
        assert apply_memory_fraction(env={"PDCTL_TRAIN_FRAC": "0.45"}) is None
    assert "no CUDA device: the memory fraction 0.45 is not applied" in caplog.text


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "half"])
def test_a_value_that_is_no_fraction_is_refused(value) -> None:
    with pytest.raises(WeightSyncError, match="PDCTL_TRAIN_FRAC"):
        apply_memory_fraction(env={"PDCTL_TRAIN_FRAC": value})
