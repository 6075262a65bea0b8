"""Sequence packing: a micro-batch's sequences run as one row without padding, with positions restarting per
sequence so attention stays inside each one, and give the padded batch's logprobs, loss and gradients (fp32
tolerance) for a text LM and for LLaVA with image tokens inside the packed row; grid (mrope) models refuse it."""

from __future__ import annotations

import random

import pytest
import torch

from gymv.backends.logprobs import MultimodalBatch, packable, token_scores
from gymv.backends.training.micro_batches import plan_packed_micro_batches, shared_prefix_cost
from gymv.backends.training.samples import as_tensors, training_sample
from gymv.config.schema import TrainingSection
from gymv.errors import GymvError
from tiny_models import chat_ids, fresh_policy, noise, solid

ATOL = 2e-5


def test_packed_plan_fills_each_row_up_to_the_token_budget():
    lengths = [7, 3, 9, 2, 5, 4, 1]
    plan = plan_packed_micro_batches(lengths, 10)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 10 for mb in plan)
    assert len(plan) == 4  # 31 tokens: ceil(31 / 10) rows


def test_packed_plan_runs_a_sample_longer_than_the_budget_alone():
    assert plan_packed_micro_batches([12, 3, 4], 10) == [[0], [1, 2]]


def test_shared_prefix_cost_counts_each_prefix_once_per_micro_batch():
    prefixes = [(5, "a"), (5, "a"), (3, "b")]
    assert shared_prefix_cost([[0, 1, 2]], prefixes, [8, 6, 4]) == 2 * 5 + 3 * 3


def _samples(policy, images_per_row, seed=0):
    rng = random.Random(seed)
    vocab = policy.model.config.get_text_config().vocab_size
    forbidden = set(policy.adapter.vision_token_ids)
    out = []
    for n, images in enumerate(images_per_row):
        prompt = chat_ids(policy, f"question {n}" + " more" * rng.randint(0, 6), images)
        gen = [t for t in (rng.randrange(3, vocab) for _ in range(20)) if t not in forbidden][: rng.randint(3, 12)]
        s = training_sample(prompt + gen, [0] * len(prompt) + [1] * len(gen), images=images, where=f"row {n}",
                            logp_behaviour=[-1.0] * (len(prompt) + len(gen)), advantage=rng.uniform(-1, 1))
        out.append(as_tensors(s))
    return out


def _batch(samples, pad_id):
    from gymv.backends.training.micro_batches import pad_collate

    mb = pad_collate([{k: s[k] for k in ("input_ids", "loss_mask")} for s in samples], {"input_ids": pad_id})
    return MultimodalBatch(mb["input_ids"], mb["attention_mask"], [s["images"] for s in samples]), mb["loss_mask"]


def _scores_agree(policy, samples, score: bool):
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    kw = {"entropy": True, "score_mask": loss_mask if score else None}
    padded = token_scores(policy.model, policy.adapter, batch, **kw)
    packed = token_scores(policy.model, policy.adapter, batch, packed=True, **kw)
    torch.testing.assert_close(packed.logp, padded.logp, atol=ATOL, rtol=0)
    torch.testing.assert_close(packed.entropy, padded.entropy, atol=ATOL, rtol=0)
    assert bool((padded.logp != 0).any())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("score", [True, False], ids=["scored", "full"])
def test_packed_logprobs_equal_padded_for_a_text_lm(attn, score):
    policy = fresh_policy("tiny-llama")
    policy.model.set_attn_implementation(attn)
    _scores_agree(policy, _samples(policy, [[]] * 5), score)


@pytest.mark.parametrize("score", [True, False], ids=["scored", "full"])
def test_packed_logprobs_equal_padded_for_llava_with_images_inside_the_row(score):
    policy = fresh_policy("tiny-llava")
    assert packable(policy.adapter) is None
    samples = _samples(policy, [[solid("red")], [], [noise(1), solid("blue")], [noise(2)]])
    _scores_agree(policy, samples, score)


def _backend(arch, packing):
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend

    policy = fresh_policy(arch)
    # Adam's eps is large so that float summation-order noise in a near-zero gradient cannot move the update
    setup = TrainingSetup(model_path="unused", training=TrainingSection(
        lr=1e-2, eps=1e-3, weight_decay=0.01, dtype="float32", micro_batch_tokens=200, sequence_packing=packing))
    return HFTorchBackend(policy, setup, device="cpu")


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-llava", "tiny-qwen2_5vl"])
def test_a_packed_training_step_equals_the_padded_step(arch):
    from gymv.algorithms.loss_fns import PolicyLoss

    images = [[]] * 6 if arch == "tiny-llama" else [[solid("red")], [], [noise(3)], [noise(4)], [], [solid("green")]]
    results = {}
    for packing in (False, True):
        backend = _backend(arch, packing)
        samples = _samples(backend.policy, images, seed=5)
        metrics = backend.train_step([dict(s) for s in samples], PolicyLoss())
        assert backend.trainer.plan_fn.__self__.packed is packing
        results[packing] = metrics, {k: v.clone() for k, v in backend.named_weights()}
    (m0, w0), (m1, w1) = results[False], results[True]
    assert m1["train/num_micro_batches"] <= m0["train/num_micro_batches"]  # no padding: never more rows
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-5)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-5, rtol=0)


def _group(policy, size: int, seed: int):
    """`size` samples sharing one prompt (with its image), each with its own answer of its own length."""
    one = _samples(policy, [[noise(seed)]], seed=seed)[0]
    prompt = int(one["loss_mask"].int().argmax())
    rng = random.Random(seed)
    group = []
    for g in range(size):
        keep = prompt + rng.randint(2, len(one["input_ids"]) - prompt)
        s = {k: (v[:keep].clone() if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in one.items()}
        s["input_ids"][prompt:] = s["input_ids"][prompt:].roll(g)
        s["where"] = f"group {seed} sample {g}"
        group.append(s)
    return group


def _slow_decay(model) -> None:
    """Mamba-2 states that last (the tiny model's initial decay forgets a prompt within a few tokens, which
    would leave a member's carried state below the tolerance)."""
    for m in model.modules():
        if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
            with torch.no_grad():
                m.A_log.copy_(torch.linspace(-3.0, 0.0, m.A_log.numel()))
                m.dt_bias.copy_(torch.linspace(-3.0, -1.0, m.dt_bias.numel()))


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-nemotron-omni"])
def test_a_packed_row_runs_a_groups_shared_prompt_once_with_the_same_logprobs(arch):
    """For the hybrid model, each member's Mamba-2 layers continue the prompt's state (gymv.backends.mamba_prefix)."""
    from gymv.backends import packed_attention, packed_mamba
    from gymv.backends.logprobs import packed_prefixes
    from gymv.backends.packing import pack

    policy = fresh_policy(arch)
    _slow_decay(policy.model)
    samples = _group(policy, 4, seed=11) + _samples(policy, [[solid("red")], []], seed=4) + _group(policy, 3, seed=12)
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    padded = token_scores(policy.model, policy.adapter, batch, entropy=True, score_mask=loss_mask)
    assert packed_attention.install(policy.model)
    assert packed_mamba.install(policy.model) is (arch == "tiny-nemotron-omni")
    prefixes = packed_prefixes(batch.input_ids, loss_mask, batch.images, policy.adapter.image_token_id)
    assert [p[0] for p in prefixes] == [0, 0, 0, 0, 1, 2, 3, 3, 3]  # a group each; alone: nothing to share
    row = pack(batch.input_ids, batch.attention_mask, batch.images, prefixes)
    prompt_len = prefixes[0][1]
    assert row.input_ids.numel() == int(batch.attention_mask.sum()) - 3 * prompt_len - 2 * prefixes[-1][1]
    assert len(row.images) == 3  # one per group, one for the unshared sample with an image
    packed = token_scores(policy.model, policy.adapter, batch, entropy=True, score_mask=loss_mask, packed=True,
                          prefixes=prefixes)
    torch.testing.assert_close(packed.logp, padded.logp, atol=ATOL, rtol=0)
    torch.testing.assert_close(packed.entropy, padded.entropy, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-nemotron-omni"])
def test_a_step_with_shared_prompts_in_packed_rows_equals_the_padded_step(arch):
    from gymv.algorithms.loss_fns import PolicyLoss

    results = {}
    for packing in (False, True):
        backend = _backend(arch, packing)
        samples = _group(backend.policy, 4, seed=21) + _group(backend.policy, 4, seed=22)
        for n, s in enumerate(samples):
            s["advantages"] = torch.tensor(float(n % 3) - 1.0)
        metrics = backend.train_step(samples, PolicyLoss())
        layout = backend.trainer.plan_fn.__self__
        assert layout.packed is packing and layout.shares_in_row is packing
        results[packing] = metrics, {k: v.clone() for k, v in backend.named_weights()}
    (m0, w0), (m1, w1) = results[False], results[True]
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-5)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-5, rtol=0)


def test_shared_packed_plan_counts_each_prompt_once_per_row():
    from gymv.backends.training.micro_batches import plan_packed_shared_micro_batches

    prefixes = [(6, "a")] * 3 + [None, (4, "b")]
    lengths = [10, 9, 8, 5, 7]
    assert plan_packed_shared_micro_batches(prefixes, lengths, 6 + 4 + 3 + 2 + 5) == [[0, 1, 2, 3], [4]]


def test_shared_packed_plan_cuts_a_group_too_long_for_one_row_into_pieces_that_each_repeat_the_prompt():
    from gymv.backends.training.micro_batches import plan_packed_shared_micro_batches

    prefixes = [(6, "a")] * 3 + [None]
    lengths = [10, 9, 8, 5]  # remainders 4, 3, 2: the group costs 15, over the budget of 12
    assert plan_packed_shared_micro_batches(prefixes, lengths, 12) == [[1, 2], [0], [3]]


def test_auto_packing_keeps_the_shared_prefix_cache_where_packed_attention_cannot_share_prompts():
    policy = fresh_policy("tiny-llava")
    policy.model.config.text_config.sliding_window = 4096  # packed attention refuses sliding-window models
    from gymv.backends.training.hf_torch import BatchLayout

    layout = BatchLayout(policy.adapter, policy.model, 0, "auto")
    assert layout.shares_in_row is False
    layout.plan(_group(policy, 8, seed=31), 10_000)
    assert layout.packed is False  # one prompt + 8 answers computes fewer tokens than 8 packed sequences
    layout.plan(_samples(policy, [[]] * 4, seed=2), 10_000)
    assert layout.packed is True


def test_gemma3_refuses_packing_with_the_reason():
    with pytest.raises(GymvError, match="extra per-token inputs"):
        _backend("tiny-gemma3", True)
    assert _backend("tiny-gemma3", "auto").trainer.plan_fn.__self__.packing is False


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny-qwen2vl", "tiny-qwen2_5vl"])
def test_a_grid_model_packs_with_its_own_3d_positions_and_shared_prompts(arch):
    from gymv.backends import packed_attention
    from gymv.backends.logprobs import packed_prefixes

    policy = fresh_policy(arch)
    samples = _group(policy, 3, seed=41) + _samples(policy, [[noise(8)], [], [solid("red"), noise(9)]], seed=6)
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    padded = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask).logp
    assert packed_attention.install(policy.model)
    prefixes = packed_prefixes(batch.input_ids, loss_mask, batch.images, policy.adapter.image_token_id)
    for share in (None, prefixes):
        packed = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask, packed=True,
                              prefixes=share).logp
        torch.testing.assert_close(packed, padded, atol=ATOL, rtol=0)


def test_packed_attention_computes_each_sequence_alone_and_leaves_padded_batches_to_sdpa():
    from gymv.backends import packed_attention

    policy = fresh_policy("tiny-llava")
    samples = _samples(policy, [[noise(5)], [], [solid("red")]], seed=3)
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    before = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask).logp
    assert packed_attention.install(policy.model) and packed_attention.active(policy.model)
    packed = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask, packed=True).logp
    padded = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask).logp
    torch.testing.assert_close(packed, before, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded, before, atol=ATOL, rtol=0)


def test_the_config_key_takes_auto_true_or_false_and_refuses_anything_else():
    from pydantic import ValidationError

    from gymv.config.schema import TrainingSection

    assert TrainingSection().sequence_packing == "auto"
    assert TrainingSection(sequence_packing=True).sequence_packing is True
    with pytest.raises(ValidationError):
        TrainingSection(sequence_packing="sometimes")


def test_a_packed_forward_whose_attention_never_gets_the_packing_arguments_is_refused():
    from gymv.backends import packed_attention

    policy = fresh_policy("tiny-llama")
    assert packed_attention.install(policy.model)
    samples = _samples(policy, [[]] * 3, seed=9)
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    for layer in policy.model.model.layers:  # a model whose layers drop the keywords they do not know
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, _f=forward, **kw: _f(*a, **{k: v for k, v in kw.items()
                                                                        if k != packed_attention.KEYWORD})
    with pytest.raises(GymvError, match="sequence_packing: false"):
        token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask, packed=True)


def test_collating_a_planned_micro_batch_reuses_the_plans_prefix_keys_and_groups_rows_as_from_scratch():
    from gymv.backends.logprobs import packed_prefixes
    from gymv.backends.training.hf_torch import BatchLayout

    policy = fresh_policy("tiny-llava")
    samples = _group(policy, 3, seed=21) + _samples(policy, [[solid("red")]], seed=5) + _group(policy, 2, seed=22)
    layout = BatchLayout(policy.adapter, policy.model, policy.tokenizer.pad_token_id or 0, True)
    plan = layout.plan(samples, 1 << 20)
    assert layout._known_keys([samples[i] for i in plan[0]]) is not None
    mb = layout.collate([samples[i] for i in plan[0]])
    fresh = packed_prefixes(mb["input_ids"], mb["loss_mask"], mb["images"], policy.adapter.image_token_id)
    assert mb["prefixes"] == fresh and [p[0] for p in fresh] == [0, 0, 0, 1, 2, 2]
    assert layout._known_keys([as_tensors(dict(s)) for s in samples]) is None  # other objects: computed anew


def test_a_planned_micro_batch_is_scored_from_its_host_copies_without_hashing_its_pictures_again(monkeypatch):
    from gymv.backends import multimodal
    from gymv.backends.training.hf_torch import BatchLayout, logprob_fn

    policy = fresh_policy("tiny-llava")
    samples = _group(policy, 3, seed=23) + _samples(policy, [[solid("red")]], seed=6)
    layout = BatchLayout(policy.adapter, policy.model, policy.tokenizer.pad_token_id or 0, True)
    plan = layout.plan(samples, 1 << 20)
    mb = layout.collate([samples[i] for i in plan[0]])
    host = mb["host"]
    assert host.input_ids is mb["input_ids"] and host.loss_mask is mb["loss_mask"]
    assert sorted(host.image_hashes) == sorted({id(im) for row in mb["images"] for im in row})
    want = logprob_fn(policy.adapter, 1.0)(policy.model, {k: v for k, v in mb.items() if k != "host"})
    hashed = []
    monkeypatch.setattr(multimodal, "image_hash", lambda im: hashed.append(im) or "unused")
    got = logprob_fn(policy.adapter, 1.0)(policy.model, mb)
    assert hashed == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "host" in layout.collate([as_tensors(dict(s)) for s in samples[:2]])  # unplanned: still a host view
    assert layout.collate([as_tensors(dict(s)) for s in samples[:2]])["host"].image_hashes is None


def test_packed_attention_runs_a_float32_query_under_16_bit_autocast_in_the_autocast_dtype():
    from gymv.backends.packed_attention import _half_dtype

    query = torch.zeros(1, 2, 3, 4)
    assert _half_dtype(query) is None and _half_dtype(query.bfloat16()) is torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):
        assert _half_dtype(query) is torch.bfloat16


@pytest.mark.gpu
def test_a_packed_torch_backend_step_on_cuda_runs_the_varlen_kernel_under_autocast():
    """float32 weights and bf16 autocast: rotary embeddings leave the query in float32, and the packed
    attention still takes the flash kernel (once per layer and pass) rather than one SDPA call per segment."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends import packed_attention
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    policy = fresh_policy("tiny-llava")
    setup = TrainingSetup(model_path=str(policy.path), device="cuda", training=TrainingSection(
        lr=1e-5, weight_decay=0.01, dtype="bfloat16", sequence_packing=True))
    backend = HFTorchBackend(policy, setup, device="cuda")
    samples = _group(policy, 3, seed=31) + _group(policy, 2, seed=32)
    before, calls = packed_attention.varlen_calls, packed_attention.calls
    backend.train_step(samples, PolicyLoss())
    assert backend.trainer.plan_fn.__self__.packed
    assert packed_attention.varlen_calls - before == packed_attention.calls - calls > 0


def test_a_hybrid_slice_without_attention_layers_packs_and_scores_as_padded_rows():
    """A Nemotron-H slice of Mamba and MoE layers alone has no attention layer for the packing keyword to
    reach: it packs (segments still restart each Mamba layer's state) instead of being refused."""
    import copy
    import dataclasses

    from gymv.backends import packed_attention, packed_mamba

    base = fresh_policy("tiny-nemotron-omni")
    config = copy.deepcopy(base.model.config)
    config.text_config.layers_block_type = [k for k in config.text_config.layers_block_type
                                            if k not in packed_attention.ATTENTION_KINDS]
    assert len(config.text_config.layers_block_type) >= 2
    torch.manual_seed(0)
    policy = dataclasses.replace(base, model=type(base.model)(config).eval())
    assert not packed_attention.attends(policy.model)
    assert packed_attention.install(policy.model) and packed_mamba.install(policy.model)
    _scores_agree(policy, _samples(policy, [[solid("red")], [], [noise(3)]], seed=4), score=True)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-nemotron-omni"])
def test_a_packed_forward_reads_nothing_back_for_transformers_packed_sequence_detection(arch):
    """transformers looks at the positions of a forward without a mask for restarts (`.all()` on the device:
    a wait for the GPU each forward) to build a packed mask that packed attention never uses."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from gymv.backends import packed_attention, packed_mamba
    from gymv.backends.logprobs import packed_prefixes

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("_local_scalar_dense", "is_nonzero")):
                reads.append([f.name for f in traceback.extract_stack()[:-1]])
            return func(*args, **(kwargs or {}))

    policy = fresh_policy(arch)
    samples = _group(policy, 3, seed=13) + _samples(policy, [[solid("red")], []], seed=8)
    batch, loss_mask = _batch(samples, policy.tokenizer.pad_token_id or 0)
    padded = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask).logp
    assert packed_attention.install(policy.model)
    packed_mamba.install(policy.model)
    prefixes = packed_prefixes(batch.input_ids, loss_mask, batch.images, policy.adapter.image_token_id)
    with Reads():
        packed = token_scores(policy.model, policy.adapter, batch, score_mask=loss_mask, packed=True,
                              prefixes=prefixes).logp
    torch.testing.assert_close(packed, padded, atol=ATOL, rtol=0)
    assert not [r for r in reads if "find_packed_sequence_indices" in r], reads
