"""A step's images go through the vision tower once (gymv.backends.step_images), however many micro-batches
hold them: the same step as one tower call per micro-batch, weights and metrics alike, on the torch and fsdp2
backends (the tiny Nemotron 3 Omni)."""

from __future__ import annotations

import pytest
import torch

from test_sequence_packing import _group
from tiny_models import fresh_policy, tiny_path

ARCH = "tiny-nemotron-omni"


def test_earlier_micro_batches_gradients_reach_the_tower_in_the_last_ones_backward_for_its_model_only():
    from gymv.backends.step_images import StepImages, lookup

    tower, other = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    pixels = torch.randn(2, 5, 3)
    step = StepImages(tower, ["a", "b"], [tower(pixels[0]), tower(pixels[1])], None)
    with step.active():
        step.last_micro_batch(False)
        (b,), _ = lookup(tower, ["b"])
        (3 * b).sum().backward()  # the first micro-batch: only the copy's gradient moves
        assert tower.weight.grad is None
        step.last_micro_batch(True)
        a, b2 = lookup(tower, ["a", "b"])[0]
        (a.sum() + b2.sum()).backward()
        assert lookup(other, ["a"]) is None and lookup(tower, ["c"]) is None
    assert lookup(tower, ["a"]) is None  # no step active
    want = torch.nn.Linear(3, 4)
    want.load_state_dict(tower.state_dict())
    (want(pixels[0]).sum() + 4 * want(pixels[1]).sum()).backward()
    torch.testing.assert_close(tower.weight.grad, want.weight.grad)
    torch.testing.assert_close(tower.bias.grad, want.bias.grad)


def _backend(cls, micro_batch_tokens: int, checkpointing: bool):
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection

    training = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", sequence_packing=False,
                               micro_batch_tokens=micro_batch_tokens, gradient_checkpointing=checkpointing)
    setup = TrainingSetup(model_path=str(tiny_path(ARCH)), training=training)
    return (cls or HFTorchBackend)(fresh_policy(ARCH), setup, device="cpu")


def _step(monkeypatch, cls, *, once: bool, checkpointing: bool = False):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends import step_images

    if not once:
        monkeypatch.setattr(step_images, "MAX_PIXEL_VALUES", 0)
    probe = fresh_policy(ARCH)
    samples = _group(probe, 3, seed=3) + _group(probe, 3, seed=4)
    for s, a in zip(samples, (1.0, -1.0, 0.5, -0.5, 0.25, 1.0)):
        s["advantages"] = torch.tensor(a)
    longest = max(int(s["input_ids"].shape[0]) for s in samples)
    backend = _backend(cls, 2 * longest, checkpointing)  # two samples a micro-batch: a group straddles two
    calls = []
    encode = backend.policy.adapter.image_features
    monkeypatch.setattr(backend.policy.adapter, "image_features",
                        lambda model, inputs: calls.append(len(inputs.tokens_per_image)) or encode(model, inputs))
    metrics = backend.train_step(samples, PolicyLoss())
    monkeypatch.undo()
    return metrics, {k: v.clone() for k, v in backend.named_weights()}, calls


def _same_step(a, b):
    (m0, w0, _), (m1, w1, _) = a, b
    assert m1["train/num_micro_batches"] == m0["train/num_micro_batches"] >= 3
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-6)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0, msg=k)


def test_a_step_hashes_each_distinct_picture_once(monkeypatch):
    from gymv.backends import multimodal

    probe = fresh_policy(ARCH)
    samples = _group(probe, 3, seed=3) + _group(probe, 3, seed=4)
    layout = _backend(None, 4096, False).trainer.plan_fn.__self__
    hashed, original = [], multimodal.image_hash

    def counting(im):
        hashed.append(id(im))
        return original(im)

    monkeypatch.setattr(multimodal, "image_hash", counting)
    plan = layout.plan(samples, 4096)
    assert layout.step_images(layout.model, samples, plan) is not None
    assert len(hashed) == len(set(hashed)) == 2  # two groups' pictures, each hashed once, not once a sample


@pytest.mark.slow
def test_the_torch_backend_encodes_a_steps_images_in_one_call_and_steps_as_before(monkeypatch):
    per_micro_batch = _step(monkeypatch, None, once=False, checkpointing=True)
    once = _step(monkeypatch, None, once=True, checkpointing=True)
    assert once[2] == [2]  # both groups' images, once
    assert len(per_micro_batch[2]) >= 3 and sum(per_micro_batch[2]) > 2  # the straddling group's image twice
    _same_step(per_micro_batch, once)
    _tower_trained(once[1])


@pytest.mark.slow
def test_one_fsdp2_rank_encodes_a_steps_images_in_one_call_and_steps_as_before(monkeypatch):
    from gymv.backends.training.hf_fsdp import HFFSDPBackend

    per_micro_batch = _step(monkeypatch, HFFSDPBackend, once=False)
    once = _step(monkeypatch, HFFSDPBackend, once=True)
    assert once[2] == [2]
    _same_step(per_micro_batch, once)
    _tower_trained(once[1])


def _tower_trained(weights: dict) -> None:
    """Every tower and projector weight moved: the one backward through the tower reached them all."""
    fresh = fresh_policy(ARCH).model.state_dict()
    tower = [k for k in weights if k.startswith(("vision_model.encoder", "multi_modal_projector"))]
    assert tower and all(not torch.equal(weights[k], fresh[k]) for k in tower), tower
