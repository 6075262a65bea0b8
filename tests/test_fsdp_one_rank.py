"""fsdp2 on one rank reduces gradients once per step (accumulated over the micro-batches) and clips them with
multi-tensor kernels: its clipped steps over several packed micro-batches equal the torch backend's."""

from __future__ import annotations

import pytest
import torch

from test_sequence_packing import _group


def _two_steps(backend_cls):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import TrainingSection
    from tiny_models import fresh_policy

    policy = fresh_policy("tiny-llava")
    setup = TrainingSetup(model_path="unused", training=TrainingSection(
        lr=1e-2, eps=1e-3, weight_decay=0.01, dtype="float32", micro_batch_tokens=100, max_grad_norm=0.05,
        sequence_packing=True))
    backend = backend_cls(policy, setup, device="cpu")
    samples = _group(policy, 4, seed=21) + _group(policy, 4, seed=22)
    for n, s in enumerate(samples):
        s["advantages"] = torch.tensor(float(n % 3) - 1.0)
    metrics = [backend.train_step([dict(s) for s in samples], PolicyLoss()) for _ in range(2)]
    return metrics, {k: v.clone() for k, v in backend.named_weights()}


def test_one_fsdp2_rank_steps_like_the_torch_backend_over_several_clipped_micro_batches():
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.hf_torch import HFTorchBackend

    (m0, w0), (m1, w1) = _two_steps(HFTorchBackend), _two_steps(HFFSDPBackend)
    for a, b in zip(m0, m1):
        assert b["train/num_micro_batches"] == a["train/num_micro_batches"] > 1
        assert a["train/grad_norm"] > 0.05 * 10  # clipping acts
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0)
