"""Training-side logprobs: teacher-forced per-token logprobs of given ids, under the sampling distribution.

Uses the same image features path, position ids and `policy_logits` (vision tokens masked, temperature
applied) as generation, so `exp(|logp_gen - logp_train|)` is 1 up to float error when the weights agree.
Outputs align with the input ids: column t is the logprob of token t given tokens < t; column 0 and padding
are 0. A target that is a masked vision token (image spans of the prompt) also gets 0 instead of -inf, so a
loss mask of 0 there never multiplies an infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gymv.backends.hf_forward import forward_logits
from gymv.backends.multimodal import MultimodalAdapter
from gymv.backends.sampling import forbidden_mask, policy_logits


@dataclass
class MultimodalBatch:
    """Right-padded token ids [B, T], attention mask [B, T], and each row's images in sequence order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    images: list[list[Any]]
    where: list[str] | None = None
    extras: dict = field(default_factory=dict)


def right_pad(sequences: Sequence[Sequence[int]], images: Sequence[Sequence[Any]], pad_id: int,
              where: Sequence[str] | None = None) -> MultimodalBatch:
    """Collate token id lists (with their images) into a right-padded batch."""
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), T), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[b, :len(s)] = 1
    return MultimodalBatch(ids, mask, [list(x) for x in images], list(where) if where else None)


def _forward_logits(model, adapter: MultimodalAdapter, batch: MultimodalBatch) -> torch.Tensor:
    dev = next(model.parameters()).device
    adapter.check_batch(batch.input_ids, batch.images, batch.where, batch.attention_mask)
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    flat = [im for row in batch.images for im in row]
    feats, grid = [], None
    if flat:
        inputs = adapter.preprocess(flat)
        grid = inputs.image_grid_thw
        feats = adapter.image_features(model, inputs)
    positions = adapter.position_ids(model, ids, mask, grid)
    return forward_logits(model, input_ids=ids, attention_mask=mask, position_ids=positions,
                          image_token_id=adapter.image_token_id, features=feats)


def sequence_logprobs(model, adapter: MultimodalAdapter, batch: MultimodalBatch, temperature: float = 1.0,
                      forbidden_ids: Sequence[int] | None = None, *, return_entropy: bool = False):
    """Per-token logprobs [B, T] (and entropies [B, T] with `return_entropy`); differentiable."""
    logits = _forward_logits(model, adapter, batch)
    ids = batch.input_ids.to(logits.device)
    mask = batch.attention_mask.to(logits.device)
    forbidden_ids = adapter.vision_token_ids if forbidden_ids is None else forbidden_ids
    forbidden = forbidden_mask(logits.shape[-1], forbidden_ids, logits.device)
    z = policy_logits(logits[:, :-1], temperature, forbidden)
    target = ids[:, 1:]
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    valid = mask[:, 1:].bool()
    if forbidden is not None:
        valid = valid & ~forbidden[target]
    lp = torch.where(valid, picked - lse, torch.zeros_like(lse))
    logprobs = torch.cat([lp.new_zeros((lp.shape[0], 1)), lp], dim=1)
    if not return_entropy:
        return logprobs
    p = torch.softmax(z, dim=-1)
    finite_z = z.masked_fill(torch.isinf(z), 0.0)
    ent = lse - (p * finite_z).sum(-1)
    ent = torch.where(mask[:, 1:].bool(), ent, torch.zeros_like(ent))
    return logprobs, torch.cat([ent.new_zeros((ent.shape[0], 1)), ent], dim=1)
