"""A packed vision tower's attention (gymv.backends.vision_attention): RADIO's images attend each to itself,
their bounds handed in from the host (no read of the device in any block), the same features and gradients
as transformers' own path; the variable-length flash kernel on CUDA."""

from __future__ import annotations

import pytest
import torch

from tiny_models import fresh_policy

ARCH = "tiny-nemotron-omni"


def _image(seed: int, side: int = 64):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8))


def _features_and_grads(policy, inputs):
    model = policy.model
    model.zero_grad(set_to_none=True)
    feats = policy.adapter.image_features(model, inputs)
    sum(f.float().pow(2).sum() for f in feats).backward()
    return [f.detach() for f in feats], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_only_a_radio_tower_is_switched():
    from gymv.backends import vision_attention

    assert vision_attention.install(fresh_policy(ARCH).model)
    assert not vision_attention.install(fresh_policy("tiny-llava").model)
    assert not vision_attention.install(fresh_policy("tiny-qwen2_5vl").model)


def test_images_of_different_sizes_get_transformers_features_and_gradients_with_their_longest_length_given(
        monkeypatch):
    from gymv.backends import vision_attention

    policy = fresh_policy(ARCH)
    policy.model.train()
    inputs = policy.adapter.preprocess([_image(1), _image(2, side=48), _image(3, side=80)])
    want = _features_and_grads(policy, inputs)
    assert vision_attention.install(policy.model)
    from transformers.models.radio import modeling_radio

    computed = []  # the tower works the longest length out itself only by reading the device
    given = modeling_radio.get_max_seqlen
    monkeypatch.setattr(modeling_radio, "get_max_seqlen", lambda cu, config, kwargs=None, **kw: computed.append(
        "max_seqlen" not in (kwargs or {})) or given(cu, config, kwargs, **kw))
    seen = []
    kernel = vision_attention._varlen
    monkeypatch.setattr(vision_attention, "_varlen", lambda q, k, v, cu, longest, s: seen.append(
        (cu.tolist(), longest)) or kernel(q, k, v, cu, longest, s))
    got = _features_and_grads(policy, inputs)
    prefix = policy.model.config.vision_config.num_summary_tokens
    lengths = [int(h) * int(w) + prefix for h, w in inputs.image_grid_thw.tolist()]
    layers = policy.model.config.vision_config.num_hidden_layers
    assert len(seen) == layers and len(set(lengths)) == 3 and computed == [False] * layers
    assert all(longest == max(lengths) and cu == [0, *torch.tensor(lengths).cumsum(0).tolist()] for cu, longest in seen)
    for a, b in zip(want[0], got[0]):
        torch.testing.assert_close(b, a)
    assert want[1].keys() == got[1].keys()
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], msg=k)


def test_one_image_is_a_plain_sequence():
    from gymv.backends import vision_attention

    policy = fresh_policy(ARCH)
    inputs = policy.adapter.preprocess([_image(4)])
    want = policy.adapter.image_features(policy.model, inputs)
    vision_attention.install(policy.model)
    torch.testing.assert_close(policy.adapter.image_features(policy.model, inputs)[0], want[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_flash_kernel_runs_and_matches_per_image_sdpa_in_bf16(monkeypatch):
    from gymv.backends import vision_attention

    policy = fresh_policy(ARCH)
    policy.model.to("cuda", torch.bfloat16).train()
    policy.model.config.vision_config.dtype = torch.bfloat16  # transformers casts the pixels to the config's dtype
    inputs = policy.adapter.preprocess([_image(1), _image(2, side=48), _image(3, side=80)])
    want = _features_and_grads(policy, inputs)
    assert vision_attention.install(policy.model)
    ran = []
    kernel = vision_attention._varlen
    monkeypatch.setattr(vision_attention, "_varlen", lambda *a: ran.append(kernel(*a)) or ran[-1])
    got = _features_and_grads(policy, inputs)
    assert ran and all(r is not None for r in ran)
    for a, b in zip(want[0], got[0]):
        torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)
    for k in want[1]:
        torch.testing.assert_close(got[1][k].float(), want[1][k].float(), atol=5e-2, rtol=5e-2, msg=k)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_the_kernels_one_time_checks_pass_when_first_asked_by_a_pass_without_autograd(monkeypatch, grad_mode):
    """A GRPO step scores (no_grad) before it trains: the checks' backward must still run, or their cached
    failure keeps the kernels unused for the run. The kernels are stood in for by the per-segment SDPA they
    are checked against (a CPU has none)."""
    from gymv.backends import packed_attention, vision_attention

    monkeypatch.setattr(packed_attention, "_call_varlen",
                        lambda q, k, v, args, scaling, **kw: packed_attention._per_segment(q, k, v, args, scaling, 0.0))
    monkeypatch.setattr(vision_attention, "_call",
                        lambda q, k, v, cu, longest, scaling: vision_attention._per_image(q, k, v, cu.tolist(), scaling, 0.0))
    checks = (packed_attention._varlen_checks, packed_attention._varlen_inputs, vision_attention._checked)
    for check in checks:
        check.cache_clear()
    try:
        with getattr(torch, grad_mode)():
            cpu = torch.device("cpu")
            assert packed_attention._varlen_checks(cpu, torch.float32) == (True, True)
            assert packed_attention._varlen_inputs(cpu, torch.float32) == (True, True)
            assert vision_attention._checked(cpu, torch.float32)
    finally:
        for check in checks:
            check.cache_clear()
