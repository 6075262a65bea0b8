"""Offloaded fsdp2 training keeps its weights and gradients at their own sizes in host memory: pinned where
torch pins a large block exactly, else pageable (pinned blocks rounding up to a power of two took up to twice
the memory)."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.training.fsdp import PINNED_EXACT_ABOVE_MB, pins_exactly

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_without_cuda_nothing_is_pinned():
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    assert pins_exactly() is False


def test_a_users_own_pinned_setting_is_left_alone(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:8")
    assert pins_exactly() is False


@pytest.mark.gpu
@needs_cuda
def test_where_torch_pins_exactly_a_large_pinned_tensor_takes_its_own_size(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    if not pins_exactly():
        pytest.skip(f"torch {torch.__version__} rounds pinned blocks up (offload runs unpinned)")
    n = 3584 * 18944  # a 7B MLP weight in float32: 272 MB, which rounds to 512 MB
    assert n * 4 > PINNED_EXACT_ABOVE_MB * 2**20
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    t = torch.empty(n, dtype=torch.float32).pin_memory()
    taken = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    assert t.is_pinned()
    assert taken == n * 4, f"pinned {taken} bytes for a {n * 4}-byte tensor"
