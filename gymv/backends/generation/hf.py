"""In-process generation with a transformers model: batched, KV-cached, from token ids + images.

Prompts are left-padded and positions skip the pads (so padding never changes a row's logits); one prefill
pass fills a DynamicCache and each step then feeds one token per unfinished row. Finished rows leave the
batch (the cache drops them too). Image features come from a cache keyed by the image's pixel hash, so the
G generations of one prompt, and later turns that repeat an image, encode it once; the cache is cleared
only by `reset_encoder_cache()`, because whether the encoder's weights changed is the caller's knowledge.
A hit on features computed before the latest weight update is counted (`encoder_cache_stale_hits`): with
the reset policy on it stays 0, which is how tests and runs check it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import torch

from gymv.backends.generation.base import (
    GenerationBackend,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    Weights,
    named,
)
from gymv.backends.hf_forward import forward_logits, select_cache_rows
from gymv.backends.logprobs import right_pad, token_scores
from gymv.backends.multimodal import MultimodalAdapter, hash_pictures, preprocess_threaded
from gymv.backends.policy import load_policy
from gymv.backends.sampling import forbidden_mask, policy_logits, sample
from gymv.backends.weights import weight_digests, weights_hash
from gymv.errors import GymvError


class HFGenerationBackend(GenerationBackend):
    def __init__(self, model, tokenizer, adapter: MultimodalAdapter, *, seed: int = 0, max_cached_images: int = 4096,
                 chat_template: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.chat_template = chat_template
        self.device = next(model.parameters()).device
        self.max_cached_images = max_cached_images
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # image hash -> (features, grid, the weight update they were computed after)
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor | None, int]] = OrderedDict()
        self._stats = {"encoder_cache_hits": 0, "encoder_cache_misses": 0, "encoder_cache_evictions": 0,
                       "encoder_cache_resets": 0, "encoder_cache_stale_hits": 0, "weight_updates": 0}
        eos = {tokenizer.eos_token_id, *_as_ids(getattr(model.generation_config, "eos_token_id", None))}
        self.eos_token_ids = tuple(sorted(i for i in eos if i is not None))
        self.last_timing: dict = {}

    @classmethod
    def from_policy(cls, policy, **kwargs) -> HFGenerationBackend:
        return cls(policy.model, policy.tokenizer, policy.adapter, chat_template=policy.chat_template, **kwargs)

    @classmethod
    def create(cls, model_path: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
               trust_remote_code: bool = False) -> HFGenerationBackend:
        policy = load_policy(model_path, device=device, dtype=getattr(torch, dtype), seed=seed,
                             trust_remote_code=trust_remote_code)
        return cls.from_policy(policy, seed=seed)

    # -- image features ------------------------------------------------------------------------------
    def _encode(self, requests: Sequence[GenerationRequest],
                keys: list[list[str]] | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Features of every image of every request, in sequence order, through the hash-keyed cache."""
        keys = image_keys(requests) if keys is None else keys
        todo: dict[str, Any] = {}
        for r, ks in zip(requests, keys):
            for im, k in zip(r.images, ks):
                if k in self._cache:
                    self._cache.move_to_end(k)
                    self._stats["encoder_cache_hits"] += 1
                    if self._cache[k][2] != self._stats["weight_updates"]:  # features of older weights
                        self._stats["encoder_cache_stale_hits"] += 1
                elif k in todo:
                    self._stats["encoder_cache_hits"] += 1
                else:
                    todo[k] = im
                    self._stats["encoder_cache_misses"] += 1
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        if todo:
            inputs = preprocess_threaded(self.adapter, list(todo.values()))
            with torch.no_grad():
                feats = self.adapter.image_features(self.model, inputs)
            for i, k in enumerate(todo):
                grid = inputs.image_grid_thw[i:i + 1] if inputs.image_grid_thw is not None else None
                fresh[k] = (feats[i], grid, self._stats["weight_updates"])
        ordered = [fresh[k] if k in fresh else self._cache[k] for ks in keys for k in ks]
        for k, v in fresh.items():
            self._cache[k] = v
        while len(self._cache) > self.max_cached_images:
            self._cache.popitem(last=False)
            self._stats["encoder_cache_evictions"] += 1
        feats = [f for f, _, _ in ordered]
        grids = [g for _, g, _ in ordered if g is not None]
        return feats, (torch.cat(grids) if grids else None)

    def reset_encoder_cache(self) -> None:
        self._cache.clear()
        self._stats["encoder_cache_resets"] += 1

    def stats(self) -> dict:
        return {**self._stats, "encoder_cache_entries": len(self._cache)}

    # -- weights -------------------------------------------------------------------------------------
    def update_weights(self, weights: Weights) -> None:
        own = self.model.state_dict()
        incoming = named(weights)
        for name, value in incoming.items():  # every check before the first copy: all or nothing
            if name not in own:
                raise GymvError(f"refit sent a weight the model does not have: {name}", where="refit",
                                fix="training and generation must load the same architecture (model.path)")
            if tuple(value.shape) != tuple(own[name].shape):
                raise GymvError(f"refit sent {name} with shape {tuple(value.shape)}; the model's has shape "
                                f"{tuple(own[name].shape)}", where="refit",
                                fix="training and generation must load the same architecture (model.path)")
        with torch.no_grad():
            for name, value in incoming.items():
                own[name].copy_(value)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stats["weight_updates"] += 1

    def weights_hash(self) -> str:
        return weights_hash(self.model.state_dict())

    def held_digests(self, names: Collection[str], dtype: str | None = None, method: str | None = None) -> dict[str, str]:
        own = self.model.state_dict()
        return weight_digests(((n, own[n]) for n in names if n in own), getattr(torch, dtype) if dtype else None,
                              method)

    def probe_logprobs(self, token_ids: Sequence[int], images: Sequence[Any] = ()) -> list[float]:
        self.adapter.check(list(token_ids), images, where="refit probe")
        batch = right_pad([list(token_ids)], [list(images)], self.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            logp = token_scores(self.model, self.adapter, batch, 1.0, ()).logp
        return logp[0, 1:len(token_ids)].float().cpu().tolist()

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        params.validate()
        for i, r in enumerate(requests):
            where = r.where or f"request {i}"
            if not r.prompt_token_ids:
                raise GymvError("empty prompt", where=where, fix="render at least one message before generating")
            self.adapter.check(r.prompt_token_ids, r.images, where=where)
        if not requests:
            return []
        with torch.no_grad():
            return self._generate(list(requests), params)

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        model, dev = self.model, self.device
        generator = self._generator if params.seed is None else torch.Generator(device=dev).manual_seed(params.seed)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        keys = image_keys(requests)
        feats, grid = self._encode(requests, keys)
        # Requests with the same prompt and images (the G samples of a group) are prefilled once; their
        # rows of the KV cache and of the first logits are then copies of that one row.
        row_slot, firsts, image_idx = distinct_prompts(requests, keys)
        if image_idx is not None:
            feats = [feats[i] for i in image_idx]
            if grid is not None:
                grid = grid[torch.tensor(image_idx, device=grid.device, dtype=torch.long)]
        prompts = [requests[b] for b in firsts]
        t_enc = time.perf_counter()

        B, U = len(requests), len(prompts)
        input_ids, mask = left_pad(prompts, pad)
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = self.adapter.position_ids(model, input_ids, mask, grid)
        next_pos = self.adapter.next_positions(positions, mask)
        cache = DynamicCache(config=model.config)
        logits = forward_logits(model, input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                image_token_id=self.adapter.image_token_id, features=feats, cache=cache,
                                logits_to_keep=1, extra=_forward_kwargs(self.adapter, input_ids),
                                adapter=self.adapter)[:, -1]
        if U < B:
            rows = torch.tensor(row_slot, device=dev)
            select_cache_rows(cache, rows)
            logits, mask, next_pos = logits[rows], mask[rows], next_pos[rows]
        t_prefill = time.perf_counter()

        forbidden = forbidden_mask(logits.shape[-1], self.adapter.vision_token_ids, dev)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        stop_strings = tuple(s for s in params.stop_strings if s)
        windows = {s: len(s.encode("utf-8")) + 1 for s in stop_strings}
        greedy = params.temperature == 0
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish: list[tuple[str, Any]] = [("length", None)] * B
        active = list(range(B))
        for step in range(params.max_new_tokens):
            z = policy_logits(logits, params.temperature, forbidden)
            tok = sample(z, params.top_p, greedy, generator)
            lp = torch.log_softmax(z, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
            keep: list[int] = []
            for j, (row, t, p) in enumerate(zip(active, tok.tolist(), lp.tolist())):
                tokens[row].append(t)
                logps[row].append(p)
                if t in stop_ids:
                    finish[row] = ("stop", t)
                    continue
                hit = self._stop_string(tokens[row], stop_strings, windows)
                if hit is not None:
                    finish[row] = ("stop", hit)
                    continue
                keep.append(j)
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                select_cache_rows(cache, idx)
                mask, next_pos, tok = mask[idx], next_pos[idx], tok[idx]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            pos = self.adapter.step_positions(next_pos)
            next_pos = next_pos + 1
            logits = forward_logits(model, input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                                    cache=cache)[:, -1]
        t_end = time.perf_counter()
        n_new = sum(len(t) for t in tokens)
        self.last_timing = {"encode_s": t_enc - t0, "prefill_s": t_prefill - t_enc, "decode_s": t_end - t_prefill,
                            "total_s": t_end - t0, "new_tokens": n_new, "batch": B, "prefill_rows": U}
        return [
            GenerationOutput(token_ids=tokens[b], logprobs=logps[b],
                             text=self.tokenizer.decode(tokens[b], skip_special_tokens=True),
                             finish_reason=finish[b][0], stop_reason=finish[b][1])
            for b in range(B)
        ]

    def _stop_string(self, ids: list[int], stops: tuple[str, ...], windows: dict[str, int]) -> str | None:
        """A stop string in the decoded tail; checked every step, so a match ends at the newest token."""
        if not stops:
            return None
        tail = self.tokenizer.decode(ids[-max(windows.values()):], skip_special_tokens=False)
        return next((s for s in stops if s in tail), None)


def distinct_prompts(requests: Sequence[GenerationRequest], keys: list[list[str]]):
    """(row_slot, firsts, image_idx): each request's distinct (prompt, images) slot, the first request of each
    slot, and the indices of the first requests' images in the flat image list (None when every request is
    distinct), so that a group's shared prompt is prefilled once."""
    slots: dict[tuple, int] = {}
    row_slot = [slots.setdefault((tuple(r.prompt_token_ids), tuple(ks)), len(slots)) for r, ks in zip(requests, keys)]
    firsts = [row_slot.index(u) for u in range(len(slots))]
    if len(firsts) == len(requests):
        return row_slot, firsts, None
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + len(r.images))
    return row_slot, firsts, [i for b in firsts for i in range(starts[b], starts[b + 1])]


def left_pad(prompts: Sequence[GenerationRequest], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention mask), each [U, L]: the prompts right-aligned at their longest length L, so that
    every row's next token goes in the same column and a prefill's last logits are each row's own."""
    L = max(len(r.prompt_token_ids) for r in prompts)
    input_ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, r in enumerate(prompts):
        n = len(r.prompt_token_ids)
        input_ids[b, L - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[b, L - n:] = 1
    return input_ids, mask


def image_keys(requests: Sequence[GenerationRequest]) -> list[list[str]]:
    """Each request's image hashes. The G requests of a group carry the same image objects: each object is
    hashed once (hashing a 1000x1000 picture takes milliseconds, and a step has G times more requests than
    pictures)."""
    seen = hash_pictures(im for r in requests for im in r.images)
    return [[seen[id(im)] for im in r.images] for r in requests]


def _forward_kwargs(adapter, input_ids) -> dict:
    fn = getattr(adapter, "forward_kwargs", None)
    return fn(input_ids) if fn is not None else {}


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]
