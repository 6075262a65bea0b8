"""training.compile: each decoder layer compiled gives the eager step's loss, gradient norm and weights
(fp32 tolerance) with FSDP2, packed rows whose groups share a prompt, and activation checkpointing; the key
reaches the trainer from a recipe, and the megatron backend refuses it."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from gymv.backends.training.samples import as_tensors, training_sample
from tiny_models import chat_ids, fresh_policy

REPO = Path(__file__).resolve().parents[1]


def _text_groups(policy, groups: int, size: int, seed: int) -> list[dict]:
    """GRPO-shaped text samples: `size` answers of their own lengths to each of `groups` prompts."""
    rng = random.Random(seed)
    vocab = policy.model.config.get_text_config().vocab_size
    out = []
    for g in range(groups):
        prompt = chat_ids(policy, f"question {g}" + " more" * rng.randint(0, 8), [])
        for m in range(size):
            gen = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 14))]
            out.append(as_tensors(training_sample(prompt + gen, [0] * len(prompt) + [1] * len(gen), images=[],
                                                  where=f"group {g} sample {m}", logp_behaviour=[-1.0] * (len(prompt) + len(gen)),
                                                  advantage=rng.uniform(-1, 1))))
    return out


def _steps(compile_backend, *, checkpointing: bool, micro_batch_tokens: int, steps: int = 2):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.config.schema import TrainingSection

    policy = fresh_policy("tiny-llama")
    # Adam's eps is large so that float summation-order noise in a near-zero gradient cannot move the update
    setup = TrainingSetup(model_path="unused", training=TrainingSection(
        lr=1e-2, eps=1e-3, weight_decay=0.01, dtype="float32", micro_batch_tokens=micro_batch_tokens,
        sequence_packing=True, gradient_checkpointing=checkpointing, compile=compile_backend))
    backend = HFFSDPBackend(policy, setup, device="cpu")
    samples = _text_groups(policy, groups=3, size=3, seed=4)
    metrics = [backend.train_step([dict(s) for s in samples], PolicyLoss()) for _ in range(steps)]
    layout = backend.trainer.plan_fn.__self__
    assert layout.packed and layout.shares_in_row
    return backend, metrics, {k: v.clone() for k, v in backend.named_weights()}


def _assert_same_steps(eager, compiled_run):
    from torch._dynamo.utils import counters

    from gymv.backends.training.compile import compiled

    _, m0s, w0 = eager
    backend, m1s, w1 = compiled_run
    assert compiled(backend.model) and counters["stats"]["unique_graphs"] > 0  # it really compiled
    for m0, m1 in zip(m0s, m1s):
        assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-5)
        assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-5, rtol=0)
    return m1s


@pytest.mark.slow  # compiles every layer twice over: about 7 s
def test_compiled_layers_under_fsdp2_with_packing_and_checkpointing_give_the_eager_steps():
    # aot_eager: dynamo's capture, the packed-attention graph break, AOT autograd, FSDP2's hooks and
    # checkpointing's recomputation, without inductor's kernel compilation (the slow test below)
    kw = dict(checkpointing=True, micro_batch_tokens=60, steps=1)
    got = _assert_same_steps(_steps(False, **kw), _steps("aot_eager", **kw))
    assert got[-1]["train/num_micro_batches"] > 1  # rows of different lengths: the dynamic-length recompile ran


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles CPU kernels with a C++ compiler, and none is installed")
def test_an_inductor_compiled_step_equals_the_eager_step():
    kw = dict(checkpointing=False, micro_batch_tokens=4096, steps=1)
    _assert_same_steps(_steps(False, **kw), _steps("inductor", **kw))


def test_compiling_a_model_without_decoder_layers_is_a_config_error():
    from gymv.backends.training.compile import compile_layers
    from gymv.errors import GymvError

    with pytest.raises(GymvError, match="training.compile found no decoder layers"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_recipe_key_is_a_bool_that_reaches_the_trainer_setup():
    from pydantic import ValidationError

    from gymv.config import load_recipe
    from gymv.config.schema import TrainingSection
    from gymv.train.setup import worker_spec

    assert TrainingSection().compile is False
    with pytest.raises(ValidationError):
        TrainingSection(compile="fast")
    cfg = load_recipe(REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", ["training.compile=true"]).validated
    assert worker_spec(cfg, "unused").training_setup().training.compile is True


def test_compile_with_the_megatron_backend_is_a_lint_error():
    from gymv.config import check_compatibility
    from gymv.config.schema import MODELS

    c = MODELS["grpo"].model_validate({"algorithm": "grpo", "training": {"backend": "megatron", "compile": True}})
    assert "training.compile-backend" in {f.rule for f in check_compatibility(c) if f.severity == "error"}
    ok = MODELS["grpo"].model_validate({"algorithm": "grpo", "training": {"backend": "fsdp2", "compile": True}})
    assert "training.compile-backend" not in {f.rule for f in check_compatibility(ok)}
