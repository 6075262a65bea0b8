"""The replicated vision modules of an FSDP2 model (gymv.backends.training.replicated_precision): under autocast
outside a training step; inside one, from one cast copy of their weights that every pass of the step reads,
whose backward hands the step's gradient to the float32 masters (the tiny Nemotron 3 Omni on a CPU, bf16)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_models import fresh_policy

ARCH = "tiny-nemotron-omni"


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _tower(checkpointing: bool = True, arch: str = ARCH):
    from gymv.backends.training.fsdp import autocast_replicated

    policy = fresh_policy(arch)
    model = policy.model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    precision = autocast_replicated(model, "cpu", torch.bfloat16)
    images = [_image(s) for s in (1, 2)]
    inputs = policy.adapter.preprocess(images)
    return policy, model, precision, inputs


def _image(seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8))


def _vision_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _two_passes(policy, model, inputs):
    """Two micro-batches' worth of tower calls and backward passes, as a step without step images runs them."""
    for weight in (1.0, -0.5):
        feats = policy.adapter.image_features(model, inputs)
        (weight * sum(f.float().pow(2).mean() for f in feats)).backward()


def test_the_modules_compute_in_bf16_from_float32_masters_outside_a_step_and_inside():
    policy, model, precision, inputs = _tower()
    assert precision.names == ["vision_model", "multi_modal_projector"]
    outside = policy.adapter.image_features(model, inputs)
    with precision.working_copy():
        inside = policy.adapter.image_features(model, inputs)
        assert model.vision_model.encoder.layer[0].mlp.fc1.weight.dtype == torch.bfloat16
    assert {f.dtype for f in outside + inside} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for a, b in zip(outside, inside):
        torch.testing.assert_close(b.float(), a.float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2_5vl"])
def test_other_families_towers_run_from_the_working_copy_and_train_their_masters(arch):
    policy, model, precision, inputs = _tower(checkpointing=False, arch=arch)
    sum(f.float().pow(2).sum() for f in policy.adapter.image_features(model, inputs)).backward()
    want = _vision_grads(model)
    model.zero_grad(set_to_none=True)
    with precision.working_copy():
        feats = policy.adapter.image_features(model, inputs)
        sum(f.float().pow(2).sum() for f in feats).backward()
    assert {f.dtype for f in feats} == {torch.bfloat16}
    got = _vision_grads(model)
    assert want and got.keys() == want.keys() and all(g.dtype == torch.float32 for g in got.values())


def test_a_step_casts_each_weight_once_and_its_backward_reaches_the_masters_as_autocast_does():
    policy, model, precision, inputs = _tower()
    autocast = _Ops()
    with autocast:
        _two_passes(policy, model, inputs)
    want = _vision_grads(model)
    model.zero_grad(set_to_none=True)
    ops = _Ops()
    with precision.working_copy(), ops:
        _two_passes(policy, model, inputs)
    got = _vision_grads(model)
    assert want.keys() == got.keys() and any(k.startswith("vision_model.encoder") for k in got)
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], atol=2e-2, rtol=0.1, msg=k)
    # autocast casts a weight at each use and each matrix product's input, in each pass and recomputation; the
    # copy is one multi-tensor cast each way (what is left: pixels, the loss, the projector norm's own casts)
    assert ops.count["_foreach_copy_"] == 1 and ops.count["_foreach_add_"] == 1  # backward: onto .grad, then added
    assert ops.count["_to_copy"] < autocast.count["_to_copy"] / 3, (ops.count, autocast.count)


def test_the_masters_are_back_in_place_after_a_step_that_fails():
    policy, model, precision, inputs = _tower(checkpointing=False)
    before = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="boom"), precision.working_copy():
        policy.adapter.image_features(model, inputs)
        raise RuntimeError("boom")
    assert dict(model.named_parameters()) == before and not precision.active
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_a_gradient_lands_on_its_master_with_the_masters_strides_in_every_micro_batch():
    """CUDA's fused AdamW refuses a gradient whose strides differ from its parameter's; a weight read
    transposed gets a transposed gradient from autograd."""
    from gymv.backends.training.replicated_precision import cast_copies

    layer = torch.nn.Linear(3, 4, bias=False)
    for seed in range(2):  # the first micro-batch makes `.grad`, the second adds onto it
        with cast_copies([[(layer, "weight")]], torch.bfloat16):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).bfloat16()
            (layer.weight.t() * x).float().sum().backward()
        assert layer.weight.grad.dtype == torch.float32
        assert layer.weight.grad.stride() == layer.weight.stride()


def test_a_frozen_tower_is_cast_without_a_gradient_path():
    policy, model, precision, inputs = _tower(checkpointing=False)
    model.vision_model.requires_grad_(False)
    with precision.working_copy():
        feats = policy.adapter.image_features(model, inputs)
        assert not model.vision_model.encoder.layer[0].mlp.fc1.weight.requires_grad
        sum(f.float().sum() for f in feats).backward()
    assert all(p.grad is None for p in model.vision_model.parameters())
    assert all(p.grad is not None for p in model.multi_modal_projector.parameters())


def _step(backend_cls, working_copy: bool):
    """One step of two groups in micro-batches of two samples (the tower once a step, checkpointed), its
    tower in bf16 under autocast or from the working copy; returns the metrics and the trained weights."""
    from test_step_images import _backend, _group

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.fsdp import autocast_replicated

    probe = fresh_policy(ARCH)
    samples = _group(probe, 3, seed=3) + _group(probe, 3, seed=4)
    for s, a in zip(samples, (1.0, -1.0, 0.5, -0.5, 0.25, 1.0)):
        s["advantages"] = torch.tensor(a)
    longest = max(int(s["input_ids"].shape[0]) for s in samples)
    backend = _backend(backend_cls, 2 * longest, checkpointing=True)
    trainer = backend.trainer
    trainer.precision = autocast_replicated(trainer.model, "cpu", torch.bfloat16)
    copy, entered = trainer.precision.working_copy, []
    trainer.precision.working_copy = lambda: entered.append(1) or copy()
    if not working_copy:
        trainer._step_weights = lambda: contextlib.nullcontext()
    metrics = backend.train_step(samples, PolicyLoss())
    assert entered == ([1] if working_copy else [])  # once for the whole step
    tower = [p for n, p in trainer.model.named_parameters() if n.startswith(tuple(trainer.precision.names))]
    assert tower and all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in tower)
    return metrics, {k: v.clone() for k, v in backend.named_weights()}


def _backend_class(name: str):
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.hf_torch import HFTorchBackend

    return {"fsdp2": HFFSDPBackend, "torch": HFTorchBackend}[name]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "torch"])
def test_a_step_trains_the_tower_from_its_working_copy_as_under_autocast(backend):
    cls = _backend_class(backend)
    (m0, w0), (m1, w1) = _step(cls, working_copy=False), _step(cls, working_copy=True)
    assert m1["train/num_micro_batches"] == m0["train/num_micro_batches"] >= 3
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-3)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=0.05)
    fresh = fresh_policy(ARCH).model.state_dict()
    tower = [k for k in w1 if k.startswith(("vision_model.encoder", "multi_modal_projector"))]
    assert tower and all(not torch.equal(w1[k], fresh[k]) for k in tower)
    for k in w0:  # lr 1e-2: a step moves each weight by about 1e-2; bf16 rounding may flip a few signs
        torch.testing.assert_close(w1[k], w0[k], atol=2.5e-2, rtol=0, msg=k)


def test_a_second_setup_of_one_model_keeps_the_first():
    from gymv.backends.training.fsdp import autocast_replicated

    model = fresh_policy(ARCH).model
    first = autocast_replicated(model, "cpu", torch.bfloat16)
    forward = model.vision_model.forward
    assert autocast_replicated(model, "cpu", torch.bfloat16) is first and model.vision_model.forward is forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["fsdp2", "torch"])
def test_on_cuda_a_bf16_step_trains_the_tower_from_one_copy_and_packs_its_images_through_the_flash_kernel(
        backend, monkeypatch):
    from test_step_images import _group

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends import vision_attention
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    probe = fresh_policy(ARCH)
    samples = _group(probe, 3, seed=3) + _group(probe, 3, seed=4)
    for s, a in zip(samples, (1.0, -1.0, 0.5, -0.5, 0.25, 1.0)):
        s["advantages"] = torch.tensor(a)
    training = TrainingSection(lr=1e-3, dtype="bfloat16", micro_batch_tokens=2 * max(len(s["input_ids"]) for s in samples),
                               gradient_checkpointing=True, backend=backend)
    setup = TrainingSetup(model_path=str(tiny_path(ARCH)), training=training, device="cuda")
    trained = _backend_class(backend)(fresh_policy(ARCH), setup, device="cuda")
    trainer = trained.trainer
    assert trainer.precision is not None and trainer.precision.names
    copy, entered = trainer.precision.working_copy, []
    trainer.precision.working_copy = lambda: entered.append(1) or copy()
    kernel, ran = vision_attention._varlen, []
    monkeypatch.setattr(vision_attention, "_varlen", lambda *a: ran.append(kernel(*a)) or ran[-1])
    metrics = trained.train_step(samples, PolicyLoss())
    assert entered == [1] and ran and all(r is not None for r in ran)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["train/grad_norm"] > 0
    weights = dict(trained.named_weights())
    fresh = fresh_policy(ARCH).model.state_dict()
    tower = [k for k in weights if k.startswith(("vision_model.encoder", "multi_modal_projector"))]
    assert tower and all(not torch.equal(weights[k].float().cpu(), fresh[k].float()) for k in tower)
    assert all(p.dtype == torch.float32 for n, p in trainer.model.named_parameters()
               if n.startswith(tuple(trainer.precision.names)))
