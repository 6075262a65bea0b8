"""Training-side logprobs: teacher forcing under the same masked, temperature-scaled distribution."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.logprobs import right_pad, sequence_logprobs, token_scores
from gymv.errors import GymvError
from tiny_models import chat_ids, fresh_policy, noise, shared_policy


def batch_of(policy, n=3):
    seqs, images = [], []
    for i in range(n):
        image = noise(10 + i, (70 + 20 * i, 60))
        ids = chat_ids(policy, "How many?" + " more" * i, [image])
        seqs.append(ids + [policy.tokenizer.convert_tokens_to_ids("<|im_end|>")])
        images.append([image])
    return right_pad(seqs, images, policy.tokenizer.pad_token_id, where=[f"row {i}" for i in range(n)])


def reference(policy, batch, b, temperature):
    """Row b alone, unpadded, through the plain HF forward: log_softmax(masked logits / T)."""
    n = int(batch.attention_mask[b].sum())
    ids = batch.input_ids[b:b + 1, :n]
    inputs = policy.adapter.preprocess(batch.images[b])
    kwargs = {"pixel_values": inputs.pixel_values}
    if inputs.image_grid_thw is not None:
        kwargs.update(image_grid_thw=inputs.image_grid_thw, mm_token_type_ids=(ids == policy.adapter.image_token_id).int())
    with torch.no_grad():
        logits = policy.model(input_ids=ids, **kwargs).logits[0].float()
    logits[:, list(policy.adapter.vision_token_ids)] = float("-inf")
    logp = torch.log_softmax(logits / temperature, -1)
    return logp, ids[0]


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_padded_batch_logprobs_equal_each_row_alone(arch):
    policy = shared_policy(arch)
    batch = batch_of(policy)
    with torch.no_grad():
        got = sequence_logprobs(policy.model, policy.adapter, batch, temperature=1.3)
    for b in range(3):
        logp, ids = reference(policy, batch, b, 1.3)
        want = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        text = ~torch.isin(ids[1:], torch.tensor(policy.adapter.vision_token_ids))
        assert torch.allclose(got[b, 1:len(ids)][text], want[text], atol=1e-5)


def test_image_targets_padding_and_first_column_are_zero():
    policy = shared_policy("tiny-llava")
    batch = batch_of(policy)
    with torch.no_grad():
        lp = sequence_logprobs(policy.model, policy.adapter, batch)
    assert (lp[:, 0] == 0).all()
    assert (lp[batch.attention_mask == 0] == 0).all()
    assert (lp[batch.input_ids == policy.adapter.image_token_id] == 0).all()
    assert torch.isfinite(lp).all()


def test_entropy_is_that_of_the_masked_scaled_distribution():
    policy = shared_policy("tiny-llava")
    batch = batch_of(policy, n=1)
    with torch.no_grad():
        _, ent, _ = token_scores(policy.model, policy.adapter, batch, temperature=0.8, entropy=True)
    logp, ids = reference(policy, batch, 0, 0.8)
    p = logp.exp()
    want = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    assert torch.allclose(ent[0, 1:len(ids)], want[:-1], atol=1e-4)


def test_gradients_are_finite_through_masked_vision_targets():
    policy = fresh_policy("tiny-llava")
    policy.model.train()
    batch = batch_of(policy)
    lp, ent, _ = token_scores(policy.model, policy.adapter, batch, entropy=True)
    loss = -(lp * batch.attention_mask).sum() - 0.01 * ent.sum()
    loss.backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    vision_grads = [p.grad for p in policy.model.model.vision_tower.parameters() if p.grad is not None]
    assert vision_grads and sum(float(g.abs().sum()) for g in vision_grads) > 0


def test_placeholder_mismatch_in_a_training_batch_names_the_row():
    policy = shared_policy("tiny-llava")
    batch = batch_of(policy)
    batch.images[1] = []
    with pytest.raises(GymvError, match="^row 1: image placeholder tokens do not match"):
        sequence_logprobs(policy.model, policy.adapter, batch)


def test_right_pad_aligns_tokens_left_and_masks_the_rest():
    b = right_pad([[5, 6, 7], [8]], [[], []], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def group_batch(policy, completion_lens=(3, 5, 1, 4), second_turn_image=False):
    """A GRPO-shaped batch: rows of two prompts (one image each) with completions of several lengths;
    loss mask 1 on the completion tokens only. With `second_turn_image`, each row goes on with a user turn
    that brings another image and a second completion."""
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    g = torch.Generator().manual_seed(0)
    seqs, images, masks = [], [], []
    for i, n in enumerate(completion_lens):
        image = noise(20 + i % 2, (70, 60))
        prompt = chat_ids(policy, "How many?" + " more" * (i % 2), [image])
        completion = torch.randint(10, 200, (n,), generator=g).tolist()[:-1] + [im_end]
        seqs.append(prompt + completion)
        images.append([image])
        masks.append([0] * len(prompt) + [1] * n)
        if second_turn_image:
            turn = chat_ids(policy, "And now?", [noise(30 + i, (60, 70))])
            seqs[-1] += turn + completion
            images[-1].append(noise(30 + i, (60, 70)))
            masks[-1] += [0] * len(turn) + [1] * n
    batch = right_pad(seqs, images, policy.tokenizer.pad_token_id, where=[f"row {i}" for i in range(len(seqs))])
    mask = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    for b, m in enumerate(masks):
        mask[b, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return batch, mask


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
@pytest.mark.parametrize("second_turn_image", [False, True], ids=["one-turn", "image-in-a-later-turn"])
def test_scoring_the_loss_mask_only_gives_the_full_logprobs_and_entropies_there_and_zero_elsewhere(
        arch, second_turn_image):
    policy = shared_policy(arch)
    batch, mask = group_batch(policy, second_turn_image=second_turn_image)
    with torch.no_grad():
        lp_full, ent_full, _ = token_scores(policy.model, policy.adapter, batch, 0.9, entropy=True)
        lp, ent, _ = token_scores(policy.model, policy.adapter, batch, 0.9, entropy=True, score_mask=mask)
    assert torch.allclose(lp[mask], lp_full[mask], atol=1e-5)
    assert torch.allclose(ent[mask], ent_full[mask], atol=1e-5)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
@pytest.mark.parametrize("second_turn_image", [False, True], ids=["one-turn", "image-in-a-later-turn"])
def test_candidate_tokens_are_scored_from_the_same_distribution_as_the_sampled_ones(arch, second_turn_image):
    """Top-k distillation: at every scored position, the student's logprobs of a teacher's candidates."""
    from gymv.backends.logprobs import _forward_logits, forbidden_mask, policy_logits

    policy = shared_policy(arch)
    batch, mask = group_batch(policy, second_turn_image=second_turn_image)
    B, T = batch.input_ids.shape
    cand = torch.randint(10, 200, (B, T, 3), generator=torch.Generator().manual_seed(3))
    cand[..., 0] = batch.input_ids  # the sampled token among them
    with torch.no_grad():
        lp, _, got = token_scores(policy.model, policy.adapter, batch, 0.9, entropy=True, score_mask=mask,
                                  gather_ids=cand)
        logits = _forward_logits(policy.model, policy.adapter, batch)
        z = policy_logits(logits[:, :-1], 0.9, forbidden_mask(logits.shape[-1], policy.adapter.vision_token_ids, logits.device))
        want = torch.log_softmax(z, -1).gather(-1, cand[:, 1:])
    m = mask[:, 1:]
    assert torch.allclose(got[:, 1:][m], want[m], atol=1e-5)
    assert torch.allclose(got[..., 0][mask], lp[mask], atol=1e-5)
    assert (got[~mask] == 0).all()


def test_gradients_of_a_loss_on_the_scored_tokens_equal_the_full_computations():
    policy = fresh_policy("tiny-llava")
    policy.model.train()
    batch, mask = group_batch(policy)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])[:, None]

    def grads(score_mask):
        policy.model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(policy.model, policy.adapter, batch, score_mask=score_mask)
        (-(lp * adv * mask).sum() / mask.sum()).backward()
        return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}

    full, masked = grads(None), grads(mask)
    assert full.keys() == masked.keys() and any("vision_tower" in n for n in full)
    for n in full:
        assert torch.allclose(masked[n], full[n], rtol=1e-4, atol=1e-6), n


def test_the_lm_head_runs_only_on_the_columns_that_predict_scored_tokens():
    policy = shared_policy("tiny-llava")
    batch, mask = group_batch(policy, completion_lens=(2, 4))
    rows_seen = []
    hook = policy.model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: rows_seen.append(args[0].shape[:-1].numel()))
    try:
        with torch.no_grad():
            sequence_logprobs(policy.model, policy.adapter, batch, score_mask=mask)
    finally:
        hook.remove()
    columns = int(mask.any(0).sum())  # the union over rows of the completion columns
    assert rows_seen == [2 * columns]
    assert columns < 8 < batch.input_ids.shape[1] - 60  # the image and prompt positions are never projected


def test_an_image_shared_by_several_rows_goes_through_the_vision_tower_once():
    policy = shared_policy("tiny-llava")
    batch, mask = group_batch(policy)  # four rows, two distinct images
    images_seen = []
    hook = policy.model.model.vision_tower.register_forward_hook(
        lambda mod, args, kwargs, out: images_seen.append(int((args[0] if args else kwargs["pixel_values"]).shape[0])),
        with_kwargs=True)
    try:
        with torch.no_grad():
            sequence_logprobs(policy.model, policy.adapter, batch, score_mask=mask)
    finally:
        hook.remove()
    assert images_seen == [2]


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_rows_that_share_a_prompt_and_image_run_that_prompt_through_the_decoder_once(arch):
    policy = shared_policy(arch)
    batch, mask = group_batch(policy)  # four rows, two distinct prompts
    tokens_seen = []
    layer = policy.model.model.language_model.layers[0]
    hook = layer.register_forward_hook(lambda mod, args, out: tokens_seen.append(args[0].shape[:-1].numel()))
    try:
        with torch.no_grad():
            sequence_logprobs(policy.model, policy.adapter, batch, score_mask=mask)
    finally:
        hook.remove()
    prompt_lens = [int(mask[b].int().argmax()) - 1 for b in (0, 1)]  # the prefix ends before the last prompt token
    completion_cols = int(((batch.attention_mask.sum(1)) - torch.tensor(prompt_lens * 2)).max())
    assert tokens_seen == [2 * max(prompt_lens), 4 * completion_cols]
