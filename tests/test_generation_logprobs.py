"""Training-side logprobs: teacher forcing under the same masked, temperature-scaled distribution."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.errors import GymvError
from tests.tiny_models import chat_ids, fresh_policy, noise, shared_policy


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
        _, ent = sequence_logprobs(policy.model, policy.adapter, batch, temperature=0.8, return_entropy=True)
    logp, ids = reference(policy, batch, 0, 0.8)
    p = logp.exp()
    want = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    assert torch.allclose(ent[0, 1:len(ids)], want[:-1], atol=1e-4)


def test_gradients_are_finite_through_masked_vision_targets():
    policy = fresh_policy("tiny-llava")
    policy.model.train()
    batch = batch_of(policy)
    lp, ent = sequence_logprobs(policy.model, policy.adapter, batch, return_entropy=True)
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
