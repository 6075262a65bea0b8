"""Hugging Face <-> Megatron weight mapping for the Nemotron-H hybrid decoder (Mamba-2, attention, MoE and MLP
layers; the language model of Nemotron 3 Omni), over tensor- and expert-parallel ranks. Pure tensor
arithmetic, like gymv.backends.training.megatron_weights, so it is tested without megatron-core.

Megatron names (gymv.backends.training.megatron_hybrid): `decoder.layers.{i}.norm` then `.mixer.*`:
- Mamba-2: `in_proj` holds, per TP rank, that rank's slices of [z, x, B, C, dt] (heads and B/C groups split
  evenly; a group's heads stay on its rank), `conv1d` its slices of [x, B, C]; `A_log`, `D`, `dt_bias` and
  the gated norm (whose groups are rank-local) split by heads; `out_proj` by input columns.
- attention: megatron's fused `linear_qkv` (per kv group: its query heads, key, value) and `linear_proj`.
- MoE: `router.weight` and `router.e_score_correction_bias` whole on every rank; `experts.up_proj` /
  `experts.down_proj` [local experts, ...]: under expert parallelism the experts split over EP ranks
  (contiguous blocks), each expert whole (megatron's expert tensor parallel size 1, `expert_tensor_size`);
  at EP 1 each expert's width splits over TP ranks instead; `shared_expert.up_proj` / `.down_proj` split
  over TP like a dense MLP.
- MLP: `up_proj` (rows) and `down_proj` (columns) over TP.
Every split is a slice and every merge a concatenation, so a round trip is bit-exact. `hf_to_megatron` asks
for each rank's slices alone (its rows, columns, experts), so a lazy mapping of the checkpoint
(gymv.backends.model_weights) reads the rank's shard and not the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gymv.backends.model_weights import chunk, cols, read, rows
from gymv.backends.training.megatron_qkv import fuse_qkv, split_qkv
from gymv.errors import GymvError

MODEL_TYPES = ("nemotron_h",)
KINDS = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}


@dataclass(frozen=True)
class HybridShape:
    """The sizes of a Nemotron-H decoder, read from its HF text config."""

    pattern: str  # one letter per layer: M Mamba-2, * attention, E MoE, - MLP
    hidden: int
    vocab: int
    eps: float
    tied: bool
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    mamba_heads: int
    mamba_head_dim: int
    groups: int
    state: int
    conv_kernel: int
    conv_bias: bool
    chunk: int
    time_step_limit: tuple[float, float]
    experts: int
    top_k: int
    moe_ffn: int
    shared_ffn: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hf_prefix: str = "model."
    hf_head: str = "lm_head.weight"

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @staticmethod
    def of(config: Any, *, hf_prefix: str = "model.", hf_head: str = "lm_head.weight") -> HybridShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "model_type", "") not in MODEL_TYPES:
            raise GymvError(f"not a Nemotron-H decoder ({getattr(text, 'model_type', '')!r})", where="model.path",
                            fix="use training.backend: torch or fsdp2 for this model")
        for key, bad in (("moe_latent_size", None), ("use_bias", False), ("mlp_bias", False),
                         ("attention_bias", False), ("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if getattr(text, key, bad) != bad:
                raise GymvError(f"training.backend megatron maps Nemotron-H with {key}={bad!r}, not "
                                f"{getattr(text, key)!r}", where="model.path config.json",
                                fix="use training.backend: torch or fsdp2 for this model")
        heads = text.num_attention_heads
        tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        limit = tuple(float(v) for v in (getattr(text, "time_step_limit", None) or (0.0, float("inf"))))
        return HybridShape(
            pattern="".join(KINDS[k] for k in text.layers_block_type), hidden=text.hidden_size,
            vocab=text.vocab_size, eps=float(text.layer_norm_epsilon), tied=tied, heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, ffn=text.intermediate_size,
            mamba_heads=text.mamba_num_heads, mamba_head_dim=text.mamba_head_dim, groups=text.n_groups,
            state=text.ssm_state_size, conv_kernel=text.conv_kernel, conv_bias=bool(text.use_conv_bias),
            chunk=text.chunk_size, time_step_limit=limit, experts=text.n_routed_experts or 0,
            top_k=text.num_experts_per_tok or 0, moe_ffn=text.moe_intermediate_size or 0,
            shared_ffn=(text.moe_shared_expert_intermediate_size or 0) if (text.n_shared_experts or 0) else 0,
            n_group=getattr(text, "n_group", 1) or 1, topk_group=getattr(text, "topk_group", 1) or 1,
            norm_topk_prob=bool(text.norm_topk_prob), routed_scaling_factor=float(text.routed_scaling_factor),
            hf_prefix=hf_prefix, hf_head=hf_head)

    def check_parallel(self, tp: int, ep: int = 1) -> None:
        sizes = [("vocabulary", self.vocab)]
        if "*" in self.pattern:
            sizes += [("attention heads", self.heads), ("key/value heads", self.kv_heads)]
        if "M" in self.pattern:
            sizes += [("Mamba heads", self.mamba_heads), ("Mamba groups (n_groups)", self.groups)]
        if "-" in self.pattern:
            sizes.append(("MLP width", self.ffn))
        if "E" in self.pattern:
            sizes += ([("expert width", self.moe_ffn)] if expert_tensor_size(tp, ep) > 1 else []) + (
                [("shared expert width", self.shared_ffn)] if self.shared_ffn else [])
        for what, n in sizes:
            if n % tp:
                raise GymvError(f"tensor parallel size {tp} does not divide the model's {what} ({n})",
                                where="training.parallel.tensor", fix=f"use a tensor parallel size that divides {n}")
        if "E" in self.pattern and self.experts % ep:
            raise GymvError(f"expert parallel size {ep} does not divide the model's {self.experts} experts",
                            where="training.parallel.expert", fix=f"use an expert parallel size that divides {self.experts}")


def expert_tensor_size(tp: int, ep: int) -> int:
    """How many ranks each routed expert's width is split over (megatron's expert tensor parallel size): 1
    under expert parallelism (experts whole, as the reference runs set `expert_tensor_parallel_size`), else TP."""
    return 1 if ep > 1 else tp


# Weights split over TP ranks (substrings of Megatron names); everything else is whole on every rank.
TP_SHARDED = ("mixer.in_proj.", "mixer.conv1d.", "mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.",
              "mixer.out_proj.", "mixer.linear_qkv.", "mixer.linear_proj.", "mixer.experts.",
              "mixer.shared_expert.", "mixer.up_proj.", "mixer.down_proj.")
# Whole on every TP rank, but each rank's gradient covers only its share of the experts' width (EP 1), or of
# the tokens it dispatches (EP > 1, experts whole): summed over the TP group before a step.
TP_PARTIAL_GRADIENTS = ("mixer.router.weight",)
EXPERT_SHARDED = ("mixer.experts.",)  # split over EP ranks too


def _hf_layer(shape: HybridShape, i: int) -> str:
    return f"{shape.hf_prefix}layers.{i}."


def _mamba_in_parts(shape: HybridShape) -> list[int]:
    gn = shape.groups * shape.state
    return [shape.mamba_inner, shape.mamba_inner, gn, gn, shape.mamba_heads]


def _conv_parts(shape: HybridShape) -> list[int]:
    gn = shape.groups * shape.state
    return [shape.mamba_inner, gn, gn]


def _slice_parts(hf: Mapping[str, Tensor], name: str, parts: list[int], r: int, tp: int) -> Tensor:
    """Rank r's slice of each of the concatenated `parts` (rows) of `hf[name]`, concatenated."""
    starts = [sum(parts[:j]) for j in range(len(parts))]
    return torch.cat([read(hf, name, (slice(s + r * n // tp, s + (r + 1) * n // tp),)) for s, n in zip(starts, parts)])


def _merge_parts(shards: Sequence[Tensor], parts: list[int], tp: int) -> Tensor:
    local = [n // tp for n in parts]
    pieces = [s.split(local, dim=0) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces]) for j in range(len(parts))])


def hf_to_megatron(hf: Mapping[str, Tensor], shape: HybridShape, *, tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1) -> dict[str, Tensor]:
    """One (TP rank, EP rank)'s state dict of the hybrid decoder from the HF weights (a state dict, or a lazy
    mapping that then reads this rank's slices and experts alone)."""
    shape.check_parallel(tp_size, ep_size)
    r, tp = tp_rank, tp_size
    out = {"embedding.word_embeddings.weight": rows(hf, f"{shape.hf_prefix}embeddings.weight", r, tp)}
    for i, kind in enumerate(shape.pattern):
        h, m = _hf_layer(shape, i), f"decoder.layers.{i}."
        out[m + "norm.weight"] = hf[h + "norm.weight"]
        h, m = h + "mixer.", m + "mixer."
        if kind == "M":
            out[m + "in_proj.weight"] = _slice_parts(hf, h + "in_proj.weight", _mamba_in_parts(shape), r, tp)
            out[m + "conv1d.weight"] = _slice_parts(hf, h + "conv1d.weight", _conv_parts(shape), r, tp)
            if shape.conv_bias:
                out[m + "conv1d.bias"] = _slice_parts(hf, h + "conv1d.bias", _conv_parts(shape), r, tp)
            for name in ("A_log", "D", "dt_bias", "norm.weight"):
                out[m + name] = rows(hf, h + name, r, tp)
            out[m + "out_proj.weight"] = cols(hf, h + "out_proj.weight", r, tp)
        elif kind == "*":
            out[m + "linear_qkv.weight"] = fuse_qkv(*(rows(hf, h + f"{p}_proj.weight", r, tp) for p in "qkv"), shape,
                                                     shape.kv_heads // tp)
            out[m + "linear_proj.weight"] = cols(hf, h + "o_proj.weight", r, tp)
        elif kind == "E":
            out[m + "router.weight"] = hf[h + "gate.weight"]
            out[m + "router.e_score_correction_bias"] = hf[h + "gate.e_score_correction_bias"]
            mine = (slice(ep_rank * shape.experts // ep_size, (ep_rank + 1) * shape.experts // ep_size),)
            et = expert_tensor_size(tp, ep_size)
            out[m + "experts.up_proj"] = chunk(hf, h + "experts.up_proj", r % et, et, 1, lead=mine)
            out[m + "experts.down_proj"] = chunk(hf, h + "experts.down_proj", r % et, et, -1, lead=mine)
            if shape.shared_ffn:
                out[m + "shared_expert.up_proj.weight"] = rows(hf, h + "shared_experts.up_proj.weight", r, tp)
                out[m + "shared_expert.down_proj.weight"] = cols(hf, h + "shared_experts.down_proj.weight", r, tp)
        else:
            out[m + "up_proj.weight"] = rows(hf, h + "up_proj.weight", r, tp)
            out[m + "down_proj.weight"] = cols(hf, h + "down_proj.weight", r, tp)
    out["decoder.final_norm.weight"] = hf[f"{shape.hf_prefix}norm_f.weight"]
    if not shape.tied:
        out["output_layer.weight"] = rows(hf, shape.hf_head, r, tp)
    return {k: v.contiguous() for k, v in out.items()}


def megatron_layer_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: HybridShape, i: int, *,
                         expert_shards: Sequence[Sequence[Mapping[str, Tensor]]] | None = None
                         ) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of layer `i` from every TP rank's state dict (rank order). `expert_shards[e][t]`: the
    state dicts of EP rank e, expert-TP rank t, for the experts (default: `shards` alone, one EP rank whose
    experts split over TP); under EP each row holds one state dict (experts whole)."""
    tp = len(shards)
    h, m = _hf_layer(shape, i), f"decoder.layers.{i}."
    yield h + "norm.weight", shards[0][m + "norm.weight"]
    h, m = h + "mixer.", m + "mixer."
    kind = shape.pattern[i]
    if kind == "M":
        yield h + "A_log", torch.cat([s[m + "A_log"] for s in shards])
        yield h + "D", torch.cat([s[m + "D"] for s in shards])
        yield h + "dt_bias", torch.cat([s[m + "dt_bias"] for s in shards])
        yield h + "conv1d.weight", _merge_parts([s[m + "conv1d.weight"] for s in shards], _conv_parts(shape), tp)
        if shape.conv_bias:
            yield h + "conv1d.bias", _merge_parts([s[m + "conv1d.bias"] for s in shards], _conv_parts(shape), tp)
        yield h + "in_proj.weight", _merge_parts([s[m + "in_proj.weight"] for s in shards], _mamba_in_parts(shape), tp)
        yield h + "norm.weight", torch.cat([s[m + "norm.weight"] for s in shards])
        yield h + "out_proj.weight", torch.cat([s[m + "out_proj.weight"] for s in shards], dim=1)
    elif kind == "*":
        parts = [split_qkv(s[m + "linear_qkv.weight"], shape, shape.kv_heads // tp) for s in shards]
        for n, name in enumerate(("q_proj", "k_proj", "v_proj")):
            yield h + f"{name}.weight", torch.cat([p[n] for p in parts])
        yield h + "o_proj.weight", torch.cat([s[m + "linear_proj.weight"] for s in shards], dim=1)
    elif kind == "E":
        grid = expert_shards if expert_shards is not None else [shards]
        yield h + "experts.up_proj", torch.cat([torch.cat([s[m + "experts.up_proj"] for s in row], dim=1)
                                                for row in grid])
        yield h + "experts.down_proj", torch.cat([torch.cat([s[m + "experts.down_proj"] for s in row], dim=2)
                                                  for row in grid])
        yield h + "gate.weight", shards[0][m + "router.weight"]
        yield h + "gate.e_score_correction_bias", shards[0][m + "router.e_score_correction_bias"]
        if shape.shared_ffn:
            yield h + "shared_experts.up_proj.weight", torch.cat([s[m + "shared_expert.up_proj.weight"] for s in shards])
            yield h + "shared_experts.down_proj.weight", torch.cat(
                [s[m + "shared_expert.down_proj.weight"] for s in shards], dim=1)
    else:
        yield h + "up_proj.weight", torch.cat([s[m + "up_proj.weight"] for s in shards])
        yield h + "down_proj.weight", torch.cat([s[m + "down_proj.weight"] for s in shards], dim=1)


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: HybridShape, *, include_tied_head: bool = False,
                   expert_shards: Sequence[Sequence[Mapping[str, Tensor]]] | None = None
                   ) -> Iterator[tuple[str, Tensor]]:
    """HF (name, tensor) pairs, one at a time, from every TP rank's state dict (rank order); experts from
    `expert_shards` (see `megatron_layer_to_hf`)."""
    embed = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    yield f"{shape.hf_prefix}embeddings.weight", embed
    for i in range(len(shape.pattern)):
        yield from megatron_layer_to_hf(shards, shape, i, expert_shards=expert_shards)
    yield f"{shape.hf_prefix}norm_f.weight", shards[0]["decoder.final_norm.weight"]
    if not shape.tied:
        yield shape.hf_head, torch.cat([s["output_layer.weight"] for s in shards])
    elif include_tied_head:
        yield shape.hf_head, embed
