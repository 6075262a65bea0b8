"""The torch backend's working copy of the language model's matrices (gymv.backends.training.step_copy): one
cast a decoder layer a step instead of one at every use, the same gradients as autocast's casts (the tiny
Nemotron 3 Omni on a CPU in bf16: Mamba-2, MoE experts and attention layers)."""

from __future__ import annotations

import pytest
import torch
from test_replicated_precision import _Ops

from gymv.backends.training.step_copy import StepCopy, matrix_groups
from tiny_models import fresh_policy

ARCH = "tiny-nemotron-omni"


def _text_batch(model, rows: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _passes(model, ids: torch.Tensor, passes: int = 2) -> None:
    """`passes` micro-batches' forward and backward under bf16 autocast, as the trainer runs them."""
    for n in range(passes):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids.roll(n, dims=1)).logits
        (logits.float().log_softmax(-1)[..., 0].mean() * (1 - 0.5 * n)).backward()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_decoder_layer_is_a_group_of_its_matrices_and_the_rest_one_more():
    model = fresh_policy(ARCH).model
    groups = matrix_groups(model)
    layers = len(model.language_model.model.layers)
    assert len(groups) == layers + 1  # the head's own group last
    kinds = {f"{type(m).__name__}.{k}" for g in groups for m, k in g}
    assert kinds == {"Linear.weight", "NemotronHExperts.up_proj", "NemotronHExperts.down_proj"}
    names = {id(p): n for n, p in model.named_parameters()}
    copied = {names[id(m._parameters[k])] for g in groups for m, k in g}
    assert not any(n.startswith(("vision_model", "multi_modal_projector")) for n in copied)  # the tower's own copy
    assert not any("norm" in n or "embed" in n or n.endswith("gate.weight") for n in copied), copied
    assert any(n.endswith("mixer.experts.up_proj") for n in copied)


def test_a_weight_tied_to_the_input_embedding_is_not_copied():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    copied = [m for g in matrix_groups(model) for m, _ in g]
    assert model.lm_head not in copied and len(matrix_groups(model)) == 2  # the two layers, no head group


def test_inside_a_step_the_matrices_are_bf16_copies_and_the_masters_come_back():
    model = fresh_policy(ARCH).model
    copy = StepCopy(model, torch.bfloat16)
    lm = model.language_model
    up = next(m for m in lm.modules() if type(m).__name__ == "NemotronHExperts")
    masters = dict(model.named_parameters())
    with copy.working_copy():
        assert up.up_proj.dtype == torch.bfloat16 and not isinstance(up.up_proj, torch.nn.Parameter)
        assert lm.model.norm_f.weight.dtype == torch.float32 and lm.lm_head.weight.dtype == torch.bfloat16
    assert all(p is masters[n] and p.dtype == torch.float32 for n, p in model.named_parameters())


def test_a_frozen_matrix_is_copied_without_a_gradient_path():
    model = fresh_policy(ARCH).model
    head = model.language_model.lm_head
    head.requires_grad_(False)
    with StepCopy(model, torch.bfloat16).working_copy():
        assert head.weight.dtype == torch.bfloat16 and not head.weight.requires_grad
        _passes(model, _text_batch(model), passes=1)
    assert head.weight.grad is None and model.language_model.model.layers[0].mixer.in_proj.weight.grad is not None


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_copy_gives_autocasts_gradients_with_one_cast_a_layer_a_step(checkpointing):
    model = fresh_policy(ARCH).model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = _text_batch(model)
    autocast = _Ops()
    with autocast:
        _passes(model, ids)
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    copy, ops = StepCopy(model, torch.bfloat16), _Ops()
    with ops, copy.working_copy():
        _passes(model, ids)
    got = _grads(model)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], atol=2e-3, rtol=0.05, msg=k)
    # one multi-tensor cast a group forward; backward, one multi-tensor copy a group onto the masters' empty
    # gradients, then one multi-tensor add in place a pass; gone: autocast's cast of each matrix at each use
    # and its backward's cast of the gradient (the activations' casts stay, as autocast does them)
    assert ops.count["_foreach_copy_"] == len(copy.groups) * 2 and ops.count["_foreach_add_"] == len(copy.groups)
    matrices = sum(len(g) for g in copy.groups)
    assert autocast.count["_to_copy"] - ops.count["_to_copy"] >= 2 * 2 * matrices, (ops.count, autocast.count)


def _samples(policy) -> list[dict]:
    """Four text samples of 20 tokens, the last 10 trained, with advantages of both signs."""
    ids = _text_batch(policy.model, rows=4, length=20, seed=1)
    return [{"input_ids": r, "loss_mask": torch.arange(len(r)) >= 10, "advantages": torch.tensor(a),
             "logp_behaviour": torch.full((len(r),), -2.0)} for r, a in zip(ids, (1.0, -1.0, 0.5, -0.5))]


def _torch_step(weight_copy: bool):
    """One torch-backend step of two micro-batches on the tiny Omni's text side, under bf16 autocast on the CPU
    (the GPU's setting), with or without the working copy; its metrics and trained weights."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    torch.manual_seed(0)
    policy = fresh_policy(ARCH)
    samples = _samples(policy)
    training = TrainingSection(lr=1e-2, eps=1e-3, dtype="float32", sequence_packing=False, micro_batch_tokens=40,
                               gradient_checkpointing=True, weight_copy=weight_copy)
    backend = HFTorchBackend(policy, TrainingSetup(model_path=str(tiny_path(ARCH)), training=training), device="cpu")
    trainer = backend.trainer
    trainer.autocast_dtype = torch.bfloat16  # bf16 autocast, as on a GPU (training.dtype bfloat16 asks for CUDA)
    trainer.step_copy = StepCopy(trainer.model, torch.bfloat16) if weight_copy else None
    entered = []
    if weight_copy:
        inner = trainer.step_copy.working_copy
        trainer.step_copy.working_copy = lambda: entered.append(1) or inner()
    metrics = backend.train_step(samples, PolicyLoss())
    assert entered == ([1] if weight_copy else [])  # once for the whole step
    return metrics, {k: v.clone() for k, v in backend.named_weights()}


def test_a_torch_backend_step_from_the_copy_trains_as_autocast_does():
    (m0, w0), (m1, w1) = _torch_step(weight_copy=False), _torch_step(weight_copy=True)
    assert m1["train/num_micro_batches"] == m0["train/num_micro_batches"] == 2
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-3)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=0.02)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=2.5e-2, rtol=0, msg=k)


def test_weight_copy_false_or_float32_leaves_the_trainer_without_a_copy():
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    for weight_copy in (True, False):
        setup = TrainingSetup(model_path=str(tiny_path(ARCH)), training=TrainingSection(weight_copy=weight_copy))
        trainer = HFTorchBackend(fresh_policy(ARCH), setup, device="cpu").trainer
        assert trainer.step_copy is None  # float32 on a CPU: nothing to cast
        with trainer._step_weights():
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_bf16_torch_step_reads_the_copy_and_trains_as_autocast_does():
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    results = []
    for weight_copy in (False, True):
        torch.manual_seed(0)
        policy = fresh_policy(ARCH)
        samples = _samples(policy)
        training = TrainingSection(lr=1e-2, eps=1e-3, dtype="bfloat16", micro_batch_tokens=40,
                                   gradient_checkpointing=True, weight_copy=weight_copy)
        backend = HFTorchBackend(policy, TrainingSetup(model_path=str(tiny_path(ARCH)), training=training),
                                 device="cuda")
        assert (backend.trainer.step_copy is not None) == weight_copy
        metrics = backend.train_step(samples, PolicyLoss())
        results.append((metrics, {k: v.float().cpu() for k, v in backend.named_weights()}))
    (m0, w0), (m1, w1) = results
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-3)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=0.02)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=2.5e-2, rtol=0, msg=k)


def _compiled_steps(compile_backend):
    from test_training_compile import _text_groups

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection

    policy = fresh_policy("tiny-llama")
    setup = TrainingSetup(model_path="unused", training=TrainingSection(
        lr=1e-2, eps=1e-3, dtype="float32", micro_batch_tokens=60, sequence_packing=True,
        gradient_checkpointing=True, compile=compile_backend))
    backend = HFTorchBackend(policy, setup, device="cpu")
    trainer = backend.trainer
    trainer.autocast_dtype = torch.bfloat16
    trainer.step_copy = StepCopy(trainer.model, torch.bfloat16)
    samples = _text_groups(policy, groups=3, size=3, seed=4)
    metrics = [backend.train_step([dict(s) for s in samples], PolicyLoss()) for _ in range(2)]
    logp = backend.compute_logprobs([dict(s) for s in samples[:2]])  # outside a step: the float32 masters
    return metrics, logp


@pytest.mark.slow  # compiles every layer for the copy's bf16 weights and again for the masters: about 10 s
def test_compiled_layers_read_the_copy_in_a_step_and_the_masters_outside_it():
    from torch._dynamo.utils import counters

    (m0, l0), (m1, l1) = _compiled_steps(False), _compiled_steps("aot_eager")
    assert counters["stats"]["unique_graphs"] > 0
    for a, b in zip(m0, m1):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-2)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=0.05)
    for a, b in zip(l0, l1):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=0)
