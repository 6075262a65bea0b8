"""Sequence packing in the megatron backend: a micro-batch runs as one row through GPTModel, each sequence
attending to itself (and to its group's shared prompt) alone, with its own rotary positions; the packed step
gives the padded Megatron step's logprobs, entropies, loss, gradient norm and weights, and the torch
backend's packed step's, within fp32 tolerance, for a text LM, LLaVA with images inside the row and
Qwen2-VL's and Qwen2.5-VL's 3-D positions."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training.samples import as_tensors, training_sample  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from tiny_models import chat_ids, fresh_policy, noise, solid, tiny_path  # noqa: E402

OPTIMIZER = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.01, "dtype": "float32", "micro_batch_tokens": 10_000}


def _setup(arch: str, packing, **training):
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import TrainingSection

    return TrainingSetup(model_path=str(tiny_path(arch)),
                         training=TrainingSection(**OPTIMIZER, sequence_packing=packing, **training))


def _samples(policy, images: list, seed: int) -> list[dict]:
    """Two GRPO groups of three (each sharing its prompt and image) and one sample per entry of `images`."""
    rng = random.Random(seed)
    vocab = policy.model.config.get_text_config().vocab_size
    forbidden = set(policy.adapter.vision_token_ids)

    def answer(n: int) -> list[int]:
        return [t for t in (rng.randrange(3, vocab) for _ in range(3 * n)) if t not in forbidden][:n]

    def sample(prompt, ims, where):
        gen = answer(rng.randint(3, 10))
        return as_tensors(training_sample(prompt + gen, [0] * len(prompt) + [1] * len(gen), images=ims, where=where,
                                          logp_behaviour=[-1.0] * (len(prompt) + len(gen)),
                                          advantage=rng.uniform(-1, 1)))

    out = []
    for g, ims in enumerate(images[:2]):
        prompt = chat_ids(policy, f"group {g}" + " more" * rng.randint(0, 5), ims)
        out += [sample(prompt, ims, f"group {g} sample {m}") for m in range(3)]
    for n, ims in enumerate(images):
        out.append(sample(chat_ids(policy, f"question {n}" + " more" * rng.randint(0, 6), ims), ims, f"row {n}"))
    return out


def _scores(backend, samples):
    """The layout, and the logprobs and entropies of one micro-batch holding every sample."""
    layout = backend.trainer.plan_fn.__self__
    plan = layout.plan(samples, OPTIMIZER["micro_batch_tokens"])
    assert len(plan) == 1 and sorted(plan[0]) == list(range(len(samples)))
    with torch.no_grad():
        logp, entropy, *_ = backend.logprob_fn(backend.trainer.model, layout.collate(samples))
    return layout, logp, entropy


IMAGES = {"tiny-qwen3": [[], [], [], []],
          "tiny-llava": [[solid("red")], [noise(3)], [], [noise(4)]],
          "tiny-qwen2vl": [[noise(7)], [], [solid("blue")], [noise(8)]],
          "tiny-qwen2_5vl": [[noise(5)], [solid("green")], [noise(6)], []],
          # gymv's hybrid twin: each member's Mamba-2 layers continue its group's prompt (mamba_prefix)
          "tiny-nemotron-omni": [[noise(9)], [solid("red")], [], [noise(10)]]}


@pytest.mark.slow  # three backends' steps per family: 4-6 s each
@pytest.mark.parametrize("arch", list(IMAGES))
def test_a_packed_megatron_step_equals_the_padded_one_and_the_torch_backends_packed_one(arch):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend

    runs = {}
    for name, cls, packing in (("padded", MegatronBackend, False), ("packed", MegatronBackend, True),
                               ("torch", HFTorchBackend, True)):
        backend = cls.create(_setup(arch, packing), device="cpu")
        samples = _samples(backend.policy, IMAGES[arch], seed=7)
        layout, logp, entropy = _scores(backend, copy.deepcopy(samples))
        assert layout.packed is packing and layout.shares_in_row is packing  # the prompts run once per row
        metrics = backend.train_step(copy.deepcopy(samples), PolicyLoss())
        runs[name] = logp, entropy, metrics, {k: v.clone() for k, v in backend.named_weights()}
    want_logp, want_entropy, want_metrics, want_weights = runs["padded"]
    assert want_metrics["train/grad_norm"] > 0
    for name in ("packed", "torch"):
        logp, entropy, metrics, weights = runs[name]
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=2e-5, msg=name)
        torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-5, msg=name)
        assert metrics["train/loss"] == pytest.approx(want_metrics["train/loss"], abs=1e-5), name
        assert metrics["train/grad_norm"] == pytest.approx(want_metrics["train/grad_norm"], rel=1e-4), name
        assert weights.keys() == want_weights.keys()
        for k, tensor in want_weights.items():
            torch.testing.assert_close(weights[k], tensor, rtol=0, atol=1e-5, msg=f"{name} {k}")


def test_packed_rows_under_activation_checkpointing_give_the_same_step():
    """The segments reach each checkpointed layer as an argument, so the backward's recompute attends as
    the forward did."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.megatron import MegatronBackend

    weights = []
    for checkpointed in (False, True):
        backend = MegatronBackend.create(_setup("tiny-qwen3", True, gradient_checkpointing=checkpointed), device="cpu")
        assert getattr(backend.trainer.model.gpt, "gymv_checkpointed", False) is checkpointed
        backend.train_step(_samples(backend.policy, IMAGES["tiny-qwen3"], seed=3), PolicyLoss())
        weights.append(dict(backend.named_weights()))
    for k, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][k], tensor, rtol=0, atol=1e-6, msg=k)


def _sliding_window_backend(packing):
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.backends.training.megatron_model import init_parallel

    init_parallel(1, torch.device("cpu"))
    policy = fresh_policy("tiny-qwen3")
    policy.model.config.sliding_window, policy.model.config.use_sliding_window = 64, True
    return MegatronBackend(policy, _setup("tiny-qwen3", packing), device="cpu")


def test_packing_true_is_refused_for_a_model_packed_attention_cannot_serve_and_auto_pads():
    with pytest.raises(GymvError, match="sliding-window") as e:
        _sliding_window_backend(True)
    assert e.value.where == "training.sequence_packing" and "auto or false" in e.value.fix
    layout = _sliding_window_backend("auto").trainer.plan_fn.__self__
    assert layout.packing is False


@pytest.mark.gpu
def test_a_packed_bf16_step_on_cuda_matches_the_padded_one():
    """On CUDA the packed segments go through torch's varlen flash kernel where it passed its check."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.config.schema import TrainingSection

    from gymv.backends import packed_attention

    metrics = {}
    for packing in (False, True):
        setup = TrainingSetup(model_path=str(tiny_path("tiny-qwen3")),
                              training=TrainingSection(**{**OPTIMIZER, "dtype": "bfloat16"}, sequence_packing=packing))
        backend = MegatronBackend.create(setup, device="cuda")
        before = packed_attention.varlen_calls
        metrics[packing] = backend.train_step(_samples(backend.policy, IMAGES["tiny-qwen3"], seed=9), PolicyLoss())
        assert backend.trainer.plan_fn.__self__.packed is packing
        assert (packed_attention.varlen_calls > before) is packing  # fp32 weights, bf16 autocast: still the kernel
    assert metrics[True]["train/grad_norm"] > 0
    assert metrics[True]["train/grad_norm"] == pytest.approx(metrics[False]["train/grad_norm"], rel=0.05)
    assert metrics[True]["train/loss"] == pytest.approx(metrics[False]["train/loss"], abs=0.02)
