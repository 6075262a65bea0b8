"""Host-to-device copies: several index tensors move in one pinned copy, each keeping its dtype, shape and
values."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.host_copy import to_device_many


def _tensors() -> list[torch.Tensor]:
    return [torch.arange(7, dtype=torch.int64), torch.tensor([0, 3, 9], dtype=torch.int32),
            torch.tensor([True, False, True]), torch.zeros(0, dtype=torch.long), torch.tensor(2.5),
            torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]]  # a strided view


def test_moving_to_the_host_device_returns_the_same_values():
    for got, want in zip(to_device_many(_tensors(), "cpu"), _tensors()):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.gpu
def test_one_pinned_copy_to_a_gpu_keeps_each_tensors_dtype_shape_and_values():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moved = to_device_many(_tensors(), "cuda")
    for got, want in zip(moved, _tensors()):
        assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
