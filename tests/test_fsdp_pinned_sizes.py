"""Offloaded fsdp2 training pins its weights and gradients at their own sizes, not the next power of two."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.training.fsdp import PINNED_EXACT_ABOVE_MB, exact_pinned_sizes

needs_settings = pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
                                    reason="this torch has no allocator settings API")


@needs_settings
def test_the_pinned_allocator_is_told_to_keep_large_blocks_exact(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert exact_pinned_sizes() is True
    settings = torch._C._accelerator_getAllocatorSettings()
    assert f"pinned_max_round_threshold_mb:{PINNED_EXACT_ABOVE_MB}" in settings
    assert f"pinned_max_cached_size_mb:{PINNED_EXACT_ABOVE_MB}" in settings


@needs_settings
def test_a_users_own_pinned_setting_is_left_alone(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:8")
    assert exact_pinned_sizes() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_large_pinned_tensor_takes_its_own_size_of_host_memory():
    exact_pinned_sizes()
    n = 3584 * 18944  # a 7B MLP weight in float32: 272 MB, which rounds to 512 MB
    before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
    t = torch.empty(n, dtype=torch.float32).pin_memory()
    taken = torch.cuda.host_memory_stats()["reserved_bytes.current"] - before
    assert t.is_pinned()
    assert taken == n * 4, f"pinned {taken} bytes for a {n * 4}-byte tensor"
