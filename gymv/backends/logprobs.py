"""Training-side logprobs: teacher-forced per-token logprobs of given ids, under the sampling distribution.

Uses the same image features path, position ids and `policy_logits` (vision tokens masked, temperature
applied) as generation, so `exp(|logp_gen - logp_train|)` is 1 up to float error when the weights agree.
Outputs align with the input ids: column t is the logprob of token t given tokens < t; column 0 and padding
are 0. A target that is a masked vision token (image spans of the prompt) also gets 0 instead of -inf, so a
loss mask of 0 there never multiplies an infinity.

With a `score_mask` (the loss mask), only those target positions are scored: the LM head, log-softmax and
entropy run on them alone, and every other column is exactly 0. A GRPO sample is mostly prompt (image
tokens included), so this is most of the softmax work of a step saved, with the same values where it counts.
Each distinct image of a batch goes through the vision tower once (the G samples of a group share theirs);
gradients of a shared image's features add up over its uses, as they would for separate copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.profiler import record_function

from gymv.backends import packed_attention, step_images
from gymv.backends.chunked_scores import chunked_scores
from gymv.backends.hf_forward import forward_logits, has_recurrent_layers, select_cache_rows
from gymv.backends.host_copy import to_device, to_device_many
from gymv.backends.multimodal import MultimodalAdapter, hash_pictures
from gymv.backends.packing import PackedRow, pack
from gymv.backends.pixel_cache import pixel_cache
from gymv.backends.sampling import forbidden_mask, policy_logits


@dataclass
class MultimodalBatch:
    """Right-padded token ids [B, T], attention mask [B, T], and each row's images in sequence order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    images: list[list[Any]]
    where: list[str] | None = None
    extras: dict = field(default_factory=dict)
    image_hashes: dict[int, str] | None = None  # content hashes by id(picture) where already computed


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


def _image_features(model, adapter: MultimodalAdapter, images: list,
                    hashes: dict[int, str] | None = None) -> tuple[list, Any]:
    """Features of `images` in order, each distinct image (by pixel hash) encoded once. `hashes`: content
    hashes by id(picture) already computed for these pictures (planning hashes a step's pictures)."""
    seen = hash_pictures(images, dict(hashes or {}))
    keys = [seen[id(im)] for im in images]
    found = step_images.lookup(model, keys)  # the step's images, encoded once for all its micro-batches
    if found is not None:
        return found
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    unique = [images[i] for i in first.values()]
    pin = next(model.parameters()).device.type == "cuda"  # joined straight into pinned memory for the copy
    with record_function("gymv/preprocess_images"):
        inputs = pixel_cache(adapter).inputs(adapter, unique, list(first), pin=pin)
    feats = adapter.image_features(model, inputs)
    slot = {k: n for n, k in enumerate(first)}
    order = [slot[k] for k in keys]
    grid = inputs.image_grid_thw
    if grid is not None and len(unique) != len(images):
        grid = grid[torch.tensor(order, device=grid.device)]
    return [feats[n] for n in order], grid


def _forward_kwargs(adapter, input_ids) -> dict:
    """The adapter's extra model inputs (Gemma 3's token_type_ids); teachers' adapters may not define any."""
    fn = getattr(adapter, "forward_kwargs", None)
    return fn(input_ids) if fn is not None else {}


def packable(adapter: MultimodalAdapter, packed_attention: bool = False, model=None) -> str | None:
    """None when the adapter's rows can be packed into one row (no extra model inputs; positions of its own,
    such as 3-D rotary ones, only with gymv's packed attention, which confines attention to each sequence
    without reading positions); else why not, for the error that
    refuses packing. A model with Mamba-2 layers packs through gymv.backends.packed_mamba (with packed attention,
    which carries the row's segments to every layer)."""
    if model is not None and has_recurrent_layers(model):
        from gymv.backends.packed_mamba import mixers

        if not mixers(model):
            return ("the decoder's recurrent layers run through a row's tokens in order, and gymv cannot restart "
                    "them at each packed sequence")
        if not packed_attention:
            return "its Mamba-2 layers find a packed row's sequences through gymv's packed attention, which it cannot use"
    cls = type(adapter)
    if cls.position_ids is not MultimodalAdapter.position_ids and not packed_attention:
        return (f"the {adapter.style} processor style computes its own (multi-dimensional) positions, which "
                "only gymv's packed attention can pack, and this model cannot use it")
    if cls.forward_kwargs is not MultimodalAdapter.forward_kwargs:
        return f"the {adapter.style} processor style passes extra per-token inputs (bidirectional image attention)"
    if cls.feature_inputs is not MultimodalAdapter.feature_inputs:
        return f"the {adapter.style} processor style feeds image features into the decoder's layers"
    return None


def _forward_logits(model, adapter: MultimodalAdapter, batch: MultimodalBatch, keep=None, *,
                    packed: PackedRow | None = None) -> torch.Tensor:
    """Logits [B, T, V], or [B, K, V] at the K sequence columns of the 1-D index tensor `keep`.

    `packed`: the rows run as this one packed row (gymv.backends.packing), no padding computed; logits are
    then [1, N, V], or [1, K, V] with `keep` indexing the packed row. With gymv.backends.packed_attention
    installed each segment attends to its own keys alone; without it, no attention mask is passed and
    transformers confines attention to each sequence from the restarting positions (no shared prefixes).
    """
    dev = next(model.parameters()).device
    with record_function("gymv/check_batch"):
        adapter.check_batch(batch.input_ids, batch.images, batch.where, batch.attention_mask)
    if packed is not None:
        packed = packed.to(dev)  # every index tensor of the row in one copy
        packed_attention.prepare(dev)
        if type(adapter).position_ids is MultimodalAdapter.position_ids:
            feats = _image_features(model, adapter, packed.images, batch.image_hashes)[0] if packed.images else []
            positions = packed.positions[None]  # 1-D: each sequence counts from 0
        else:  # the adapter's own positions (3-D rotary) of the padded rows, taken at each packed token
            flat = [im for row in batch.images for im in row]
            feats, grid = _image_features(model, adapter, flat, batch.image_hashes) if flat else ([], None)
            first = [0]
            for row in batch.images:
                first.append(first[-1] + len(row))
            feats = [feats[j] for b in packed.image_rows for j in range(first[b], first[b + 1])]
            rows, cols = packed.source_rows, packed.positions
            padded = adapter.position_ids(model, to_device(batch.input_ids, dev), to_device(batch.attention_mask, dev), grid)
            positions = padded[..., rows, cols].unsqueeze(-2)  # [..., 1, N]
        active = packed_attention.active(model)
        extra = {packed_attention.KEYWORD: packed.attention_args(dev)} if active else {}
        before = packed_attention.calls
        with packed_attention.packed_forward() if active else contextlib.nullcontext():
            logits = forward_logits(model, input_ids=packed.input_ids[None], attention_mask=None,
                                    position_ids=positions, image_token_id=adapter.image_token_id,
                                    features=feats, logits_to_keep=keep, extra=extra, adapter=adapter)
        if active:
            packed_attention.check_reached(before, model)
        if keep is not None and logits.shape[1] != keep.numel():
            logits = logits[:, keep.to(logits.device)]
        return logits
    ids, mask = to_device(batch.input_ids, dev), to_device(batch.attention_mask, dev)
    flat = [im for row in batch.images for im in row]
    feats, grid = [], None
    if flat:
        feats, grid = _image_features(model, adapter, flat, batch.image_hashes)
    positions = adapter.position_ids(model, ids, mask, grid)
    logits = forward_logits(model, input_ids=ids, attention_mask=mask, position_ids=positions,
                            image_token_id=adapter.image_token_id, features=feats, logits_to_keep=keep,
                            extra=_forward_kwargs(adapter, ids), adapter=adapter)
    if keep is not None and logits.shape[1] != keep.numel():  # the model ignored logits_to_keep
        logits = logits[:, keep.to(logits.device)]
    return logits


def recomputes_activations(model) -> bool:
    """Activation checkpointing on: the model keeps no KV cache in training, so prefixes cannot be shared.
    Also true of an FSDP-sharded model: its ranks must make the same forward calls in lock step, and the
    shared-prefix path makes two calls where a batch without a shared prefix makes one."""
    new = hasattr(type(model), "is_activation_checkpointing")  # the older name warns from transformers 5.2x
    name = "is_activation_checkpointing" if new else "is_gradient_checkpointing"
    return bool(getattr(model, name, False)) or bool(getattr(model, "gymv_lockstep", False))


def prefix_key(input_ids: torch.Tensor, score_mask: torch.Tensor, images: Sequence[Any], image_token_id: int,
               hashes: dict[int, str] | None = None) -> tuple | None:
    """What one unpadded row shares with the rows of its group under `sequence_logprobs(score_mask=...)`: the
    tokens before the one that predicts its first scored token, and its images; (length, the tokens' bytes,
    image hashes). None when nothing is shared: no scored token after the second, or an image after the prefix."""
    ids, scores = _host_array(input_ids), _host_array(score_mask)  # numpy: once per sample per step
    scored = np.flatnonzero(scores[1:])
    if scored.size == 0:
        return None
    p = int(scored[0])  # logits column of the first scored token = the prefix length
    if p < 1 or bool((ids[p:] == image_token_id).any()):
        return None
    hashes = hash_pictures(images, hashes)
    prefix = ids[:p]
    return p, prefix.dtype.str.encode() + prefix.tobytes(), tuple(hashes[id(im)] for im in images)


def _host_array(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def packed_prefixes(input_ids: torch.Tensor, score_mask: torch.Tensor, images: Sequence[Sequence[Any]],
                    image_token_id: int) -> list[tuple | None]:
    """Per row of a packed micro-batch, (group, prefix length) for rows sharing a prefix with another row
    (:func:`prefix_key` on each unpadded row), else None; rows are right-padded, the mask 0 on padding."""
    hashes: dict[int, str] = {}
    return group_prefixes([prefix_key(input_ids[b], score_mask[b], images[b], image_token_id, hashes)
                           for b in range(input_ids.shape[0])])


def group_prefixes(keys: Sequence[tuple | None]) -> list[tuple | None]:
    """(group, prefix length) per row from each row's :func:`prefix_key`, groups numbered in order of first
    appearance; None where the row shares nothing."""
    groups: dict = {}
    return [None if key is None else (groups.setdefault(key, len(groups)), key[0]) for key in keys]


def _shared_prefix_logits(model, adapter: MultimodalAdapter, batch: MultimodalBatch, wanted: torch.Tensor):
    """Logits [N, V] at the scored (row, column) pairs of `wanted` [B, T-1], with the tokens before each row's
    first scored column run once per distinct prefix (the G samples of a GRPO group share their prompt and
    image) and the rest of each row run on top of that prefix's KV cache. Causal attention makes this the
    same computation as one pass over every row; gradients of a shared prefix add up over its rows.

    Returns (logits, rows, columns), or None where it does not apply: no two rows share a prefix, an image
    lies after a row's first scored token, or the model recomputes activations (no cache in training).
    """
    from transformers import DynamicCache

    if recomputes_activations(model):
        return None
    # the bookkeeping below runs on CPU copies (the batch may live on the GPU); model inputs move to `dev`
    ids, mask, wanted = batch.input_ids.cpu(), batch.attention_mask.bool().cpu(), wanted.cpu()
    B, T = ids.shape
    if not bool(wanted.any(1).all()):
        return None
    first = wanted.int().argmax(1)  # first scored logits column = prefix length
    if int(first.min()) < 1:
        return None
    columns = torch.arange(T)[None, :]
    if bool(((ids == adapter.image_token_id) & mask & (columns >= first[:, None])).any()):
        return None
    hashes = hash_pictures(im for row in batch.images for im in row)
    groups: list[int] = []
    keys: dict = {}
    for b in range(B):
        row_hashes = tuple(hashes[id(im)] for im in batch.images[b])
        key = (tuple(ids[b, :int(first[b])].tolist()), row_hashes)
        groups.append(keys.setdefault(key, len(keys)))
    U = len(keys)
    if U == B:
        return None
    adapter.check_batch(ids, batch.images, batch.where, batch.attention_mask)
    reps = [groups.index(u) for u in range(U)]
    P = int(first.max())
    if has_recurrent_layers(model) and int(first.min()) != P:
        return None  # a recurrent layer's state would run on through a shorter prefix's padding
    dev = next(model.parameters()).device
    rep_idx = torch.tensor(reps)
    pre_len = first[rep_idx]
    pre_ids = ids[rep_idx, :P]
    pre_mask = (torch.arange(P)[None, :] < pre_len[:, None]).long()
    pre_ids = torch.where(pre_mask.bool(), pre_ids, pre_ids[:, :1]).to(dev)  # pads: a prefix's own first token
    pre_mask = pre_mask.to(dev)
    flat = [im for u in reps for im in batch.images[u]]
    feats, grid = _image_features(model, adapter, flat) if flat else ([], None)
    pre_pos = adapter.position_ids(model, pre_ids, pre_mask, grid)
    cache = DynamicCache(config=model.config)
    forward_logits(model, input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos,
                   image_token_id=adapter.image_token_id, features=feats, cache=cache, logits_to_keep=1,
                   extra=_forward_kwargs(adapter, pre_ids), adapter=adapter)
    if cache.get_seq_length() != P:  # the model kept no cache: run every row in full
        return None
    group_idx = torch.tensor(groups, device=dev)
    next_pos = adapter.next_positions(pre_pos, pre_mask)[group_idx]
    select_cache_rows(cache, group_idx)

    lengths = mask.sum(1)
    S = int((lengths - first).max())
    col = first[:, None] + torch.arange(S)[None, :]  # the original column of each suffix column
    valid = col < lengths[:, None]
    col = col.clamp(max=T - 1)
    suf_ids = ids.gather(1, col)
    suf_ids = torch.where(valid, suf_ids, suf_ids[:, :1]).to(dev)
    suf_mask = torch.cat([pre_mask[group_idx], valid.long().to(dev)], dim=1)
    positions = torch.cat([adapter.step_positions(next_pos + j) for j in range(S)], dim=-1)
    last_predicts_nothing = torch.cat([wanted, wanted.new_zeros((B, 1))], dim=1)
    suf_wanted = last_predicts_nothing.gather(1, col) & valid
    keep = suf_wanted.any(0).nonzero().squeeze(-1).to(dev)
    logits = forward_logits(model, input_ids=suf_ids, attention_mask=suf_mask, position_ids=positions, cache=cache,
                            logits_to_keep=keep)
    if logits.shape[1] != keep.numel():  # the model ignored logits_to_keep
        logits = logits[:, keep]
    rows, k = suf_wanted[:, keep.cpu()].to(dev).nonzero(as_tuple=True)
    return logits[rows, k], rows, first.to(dev)[rows] + keep[k]


def _full_logprobs(logits, ids, mask, temperature, forbidden, return_entropy):
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
    ent = _entropy(z, lse)
    ent = torch.where(mask[:, 1:].bool(), ent, torch.zeros_like(ent))
    return logprobs, torch.cat([ent.new_zeros((ent.shape[0], 1)), ent], dim=1)


def sequence_topk(model, adapter: MultimodalAdapter, batch: MultimodalBatch, k: int, temperature: float = 1.0,
                  forbidden_ids: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [B, T] of the sequence's own tokens, the k most likely next tokens [B, T, k] and their
    logprobs [B, T, k]), position t holding the distribution of token t (position 0 and padding: 0)."""
    forbidden_ids = adapter.vision_token_ids if forbidden_ids is None else forbidden_ids
    logits = _forward_logits(model, adapter, batch)
    ids, mask = batch.input_ids.to(logits.device), batch.attention_mask.to(logits.device)
    forbidden = forbidden_mask(logits.shape[-1], forbidden_ids, logits.device)
    lsm = torch.log_softmax(policy_logits(logits[:, :-1], temperature, forbidden).float(), dim=-1)
    target = ids[:, 1:]
    valid = mask[:, 1:].bool() if forbidden is None else mask[:, 1:].bool() & ~forbidden[target]
    own = torch.where(valid, lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lsm[..., 0]))
    logprobs = torch.cat([own.new_zeros((own.shape[0], 1)), own], dim=1)  # as _full_logprobs, from one softmax
    top_lp, top_ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
    top_lp = top_lp.clamp(min=-1e4)  # a forbidden token among the k: probability 0, no -inf in the loss
    keep = mask[:, 1:].bool().unsqueeze(-1)
    top_lp = torch.where(keep, top_lp, torch.zeros_like(top_lp))
    top_ids = torch.where(keep, top_ids, torch.zeros_like(top_ids))
    pad = lambda x: torch.cat([x.new_zeros((x.shape[0], 1, x.shape[2])), x], dim=1)  # noqa: E731
    return logprobs, pad(top_ids), pad(top_lp)


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(z, dim=-1)
    finite_z = z.masked_fill(torch.isinf(z), 0.0)
    return lse - (p * finite_z).sum(-1)


class TokenScores(NamedTuple):
    """What one forward pass says about a batch's tokens, each aligned with input_ids: logprobs [B, T];
    entropies [B, T] when asked; logprobs of candidate tokens [B, T, k] when given some."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


def sequence_logprobs(model, adapter: MultimodalAdapter, batch: MultimodalBatch, temperature: float = 1.0,
                      forbidden_ids: Sequence[int] | None = None, *,
                      score_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token logprobs [B, T]; differentiable (`token_scores` for entropies and candidates)."""
    return token_scores(model, adapter, batch, temperature, forbidden_ids, score_mask=score_mask).logp


def token_scores(model, adapter: MultimodalAdapter, batch: MultimodalBatch, temperature: float = 1.0,
                 forbidden_ids: Sequence[int] | None = None, *, entropy: bool = False,
                 score_mask: torch.Tensor | None = None, gather_ids: torch.Tensor | None = None,
                 packed: bool = False, prefixes: Sequence[tuple | None] | None = None) -> TokenScores:
    """Per-token logprobs [B, T], with entropies [B, T] when `entropy`; differentiable.

    `packed`: the forward pass runs the rows' real tokens packed into one row (gymv.backends.packing); the
    results are laid out as for the padded batch, and equal its results up to float error. `prefixes[b]`
    (with `score_mask` and packed attention installed): (group, prefix length) of a row whose prefix the
    rows of its group share, run once in the packed row (:func:`packed_prefixes`).

    `score_mask` [B, T] (e.g. the loss mask): score only these tokens; all other entries are 0.
    `gather_ids` [B, T, k] (with `score_mask`): also the logprobs of these candidate tokens at each scored
    position, [B, T, k] (e.g. a teacher's top k there).
    """
    return_entropy = entropy
    if gather_ids is not None and score_mask is None:
        raise ValueError("gather_ids needs score_mask")
    forbidden_ids = adapter.vision_token_ids if forbidden_ids is None else forbidden_ids
    ids_cpu, mask_cpu = batch.input_ids, batch.attention_mask
    if score_mask is not None:
        wanted = score_mask.to(mask_cpu.device).bool()[:, 1:] & mask_cpu[:, 1:].bool()
        cols = wanted.any(0).nonzero().squeeze(-1)  # column c of the logits predicts token c + 1
        if cols.numel() == 0:
            score_mask = None  # nothing to score: the full path keeps the loss attached to the graph
    if score_mask is None:
        row = pack(ids_cpu, mask_cpu, batch.images) if packed else None
        logits = _forward_logits(model, adapter, batch, packed=row)
        if packed:
            real = mask_cpu.bool().to(logits.device)
            logits = logits.new_zeros((*real.shape, logits.shape[-1])).index_put(real.nonzero(as_tuple=True), logits[0])
        ids, mask = ids_cpu.to(logits.device), mask_cpu.to(logits.device)
        forbidden = forbidden_mask(logits.shape[-1], forbidden_ids, logits.device)
        out = _full_logprobs(logits, ids, mask, temperature, forbidden, return_entropy)
        logp, ent = out if return_entropy else (out, None)
        if gather_ids is None:
            return TokenScores(logp, ent)
        none = logits.new_zeros(gather_ids.shape) + 0.0 * logits.sum()  # nothing scored, still on the graph
        return TokenScores(logp, ent, none)

    dev = next(model.parameters()).device
    scored = None if packed else _shared_prefix_logits(model, adapter, batch, wanted)
    if packed:
        share = prefixes if prefixes is not None and packed_attention.active(model) else None
        with record_function("gymv/pack"):
            row = pack(ids_cpu, mask_cpu, batch.images, share)
        rows, t = wanted.nonzero(as_tuple=True)
        keep = row.index(rows, t)
        order = keep.argsort()  # logits_to_keep in row order
        rows, t = rows[order], t[order]
        logits = _forward_logits(model, adapter, batch, keep=to_device(keep[order], dev), packed=row)[0]  # [N, V]
        scored = logits, rows, t  # where the ids are: on the host, the targets are taken there too
    if scored is None:
        cols_dev = to_device(cols, dev)
        logits = _forward_logits(model, adapter, batch, keep=cols_dev)  # [B, K, V]
        sel = wanted[:, cols].to(logits.device)  # [B, K]: the scored (row, column) pairs
        rows, k = sel.nonzero(as_tuple=True)
        t = cols_dev[k]  # logits column; the token scored is t + 1
        scored = logits[rows, k], rows, t
    logits, rows, t = scored
    forbidden = forbidden_mask(logits.shape[-1], forbidden_ids, logits.device)
    if rows.device == ids_cpu.device:
        target = ids_cpu[rows, t + 1]
    else:
        target = to_device(ids_cpu, dev)[rows, t + 1]
    rows, t, target = to_device_many([rows, t, target], dev)
    B, T = ids_cpu.shape
    if gather_ids is None:  # never the whole [N, V] in float32 at once
        lp, ent, _ = chunked_scores(logits, target, forbidden, temperature, return_entropy)
        logprobs = lp.new_zeros((B, T)).index_put((rows, t + 1), lp)
        entropies = ent.new_zeros((B, T)).index_put((rows, t + 1), ent) if return_entropy else None
        return TokenScores(logprobs, entropies, None)
    z = policy_logits(logits, temperature, forbidden)  # [N, V]
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    lp = picked - lse
    if forbidden is not None:
        lp = torch.where(forbidden[target], torch.zeros_like(lp), lp)
    logprobs = lp.new_zeros((B, T)).index_put((rows, t + 1), lp)
    entropies = candidates = None
    if return_entropy:
        ent = _entropy(z, lse)
        entropies = ent.new_zeros((B, T)).index_put((rows, t + 1), ent)
    if gather_ids is not None:
        cand = gather_ids.to(dev)[rows, t + 1]  # [N, k]
        got = (z - lse.unsqueeze(-1)).gather(-1, cand)
        got = torch.where(torch.isfinite(got), got, torch.zeros_like(got))  # a forbidden candidate
        candidates = got.new_zeros((B, T, cand.shape[-1])).index_put((rows, t + 1), got)
    return TokenScores(logprobs, entropies, candidates)
