"""Hugging Face <-> Megatron-core weight mapping for Llama-style decoders (Llama, Qwen2, Qwen3, the language
model of Qwen2.5-VL): gymv's own, so the training backend needs no converter package.

Megatron's GPTModel (local layer spec) keeps per layer one fused QKV projection and one fused gate/up
projection. The QKV rows are grouped by key/value head: for each group, its query heads, then its key head,
then its value head. Tensor parallelism splits whole groups over ranks (column parallel), the output and
down projections by input columns (row parallel), the vocabulary by rows; the fused gate/up weight holds
each rank's gate slice followed by its up slice. Everything here is pure tensor arithmetic (no
megatron-core import), so the mapping is tested without the library.

`hf_to_megatron` takes HF weights as a state dict or as a lazy mapping (gymv.backends.model_weights, which
reads a checkpoint tensor when asked for it): it asks for each rank's slice alone (`rows`, `cols`), so a rank
reading the checkpoint that way reads its shard and not the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gymv.backends.model_weights import cols, rows
from gymv.backends.training.megatron_qkv import fuse_qkv, split_qkv
from gymv.errors import GymvError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_5_vl_text", "qwen2_vl_text", "mistral")


@dataclass(frozen=True)
class DecoderShape:
    """The sizes a mapping needs, read from an HF text config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head
    mrope_section: tuple[int, ...] | None = None  # Qwen2-VL / Qwen2.5-VL: 3-D rotary positions (t, h, w)
    hf_prefix: str = "model."  # where the decoder's weights live in the HF state dict
    hf_head: str = "lm_head.weight"

    @staticmethod
    def of(config: Any, *, hf_prefix: str = "model.", hf_head: str = "lm_head.weight") -> DecoderShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise GymvError(f"training.backend megatron maps {', '.join(SUPPORTED_MODEL_TYPES)} decoders, not "
                            f"{model_type!r}", where="model.path", fix="use training.backend: torch or fsdp2 for this model")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        return DecoderShape(layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads,
                            kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                            ffn=text.intermediate_size, vocab=text.vocab_size, tied=tied,
                            qkv_bias=model_type.startswith("qwen2") or bool(getattr(text, "attention_bias", False)),
                            qk_norm=model_type == "qwen3", mrope_section=_mrope_section(text),
                            hf_prefix=hf_prefix, hf_head=hf_head)

    def check_tp(self, tp: int) -> None:
        for what, n in (("key/value heads", self.kv_heads), ("attention heads", self.heads),
                        ("MLP width", self.ffn), ("vocabulary", self.vocab)):
            if n % tp:
                raise GymvError(f"tensor parallel size {tp} does not divide the model's {what} ({n})",
                                where="training.parallel.tensor",
                                fix=f"use a tensor parallel size that divides {n}")


# Replicated on every TP rank, but each rank's gradient covers only its own heads: a trainer sums these
# gradients over the TP group before its step (every other replicated weight gets the full gradient).
TP_PARTIAL_GRADIENTS = ("self_attention.q_layernorm.", "self_attention.k_layernorm.")


TP_SHARDED = ("embedding.word_embeddings.", "output_layer.", "self_attention.linear_qkv.",
              "self_attention.linear_proj.", "mlp.linear_fc1.", "mlp.linear_fc2.")


def tp_partial_gradient(name: str) -> bool:
    """A weight of GPTModel or of the hybrid model (megatron_hybrid_weights) whose TP ranks' gradients sum."""
    from gymv.backends.training import megatron_hybrid_weights as hybrid

    return any(part in name for part in TP_PARTIAL_GRADIENTS + hybrid.TP_PARTIAL_GRADIENTS)


def tp_sharded(name: str) -> bool:
    """A GPTModel (or hybrid model) weight split over the TP ranks (the rest, norms, are whole on every rank)."""
    from gymv.backends.training import megatron_hybrid_weights as hybrid

    return any(part in name for part in TP_SHARDED + hybrid.TP_SHARDED)


def _mrope_section(text) -> tuple[int, ...] | None:
    for where in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(where, dict) and where.get("mrope_section"):
            return tuple(int(x) for x in where["mrope_section"])
    return None


def _layer(shape: DecoderShape, i: int) -> str:
    return f"{shape.hf_prefix}layers.{i}."


def hf_to_megatron(hf: Mapping[str, Tensor], shape: DecoderShape, *, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Tensor]:
    """One tensor-parallel rank's GPTModel state dict from the HF weights (a state dict, or a lazy mapping that
    then reads this rank's slices alone)."""
    shape.check_tp(tp_size)
    r, tp = tp_rank, tp_size
    groups = shape.kv_heads // tp
    out = {"embedding.word_embeddings.weight": rows(hf, f"{shape.hf_prefix}embed_tokens.weight", r, tp)}
    for i in range(shape.layers):
        h, m = _layer(shape, i), f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(rows(hf, h + f"self_attn.{p}_proj.weight", r, tp) for p in "qkv"), shape, groups)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(rows(hf, h + f"self_attn.{p}_proj.bias", r, tp) for p in "qkv"), shape, groups)
        if shape.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = cols(hf, h + "self_attn.o_proj.weight", r, tp)
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([rows(hf, h + "mlp.gate_proj.weight", r, tp),
                                                      rows(hf, h + "mlp.up_proj.weight", r, tp)])
        out[m + "mlp.linear_fc2.weight"] = cols(hf, h + "mlp.down_proj.weight", r, tp)
    out["decoder.final_layernorm.weight"] = hf[f"{shape.hf_prefix}norm.weight"]
    if not shape.tied:
        out["output_layer.weight"] = rows(hf, shape.hf_head, r, tp)
    return {k: v.contiguous() for k, v in out.items()}


def megatron_layer_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: DecoderShape, i: int) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of decoder layer `i` from every TP rank's state dict (rank order)."""
    tp = len(shards)
    h, m = _layer(shape, i), f"decoder.layers.{i}."
    groups = shape.kv_heads // tp
    yield h + "input_layernorm.weight", shards[0][m + "input_layernorm.weight"]
    parts = [split_qkv(s[m + "self_attention.linear_qkv.weight"], shape, groups) for s in shards]
    for n, name in enumerate(("q_proj", "k_proj", "v_proj")):
        yield h + f"self_attn.{name}.weight", torch.cat([p[n] for p in parts])
    if shape.qkv_bias:
        parts = [split_qkv(s[m + "self_attention.linear_qkv.bias"], shape, groups) for s in shards]
        for n, name in enumerate(("q_proj", "k_proj", "v_proj")):
            yield h + f"self_attn.{name}.bias", torch.cat([p[n] for p in parts])
    if shape.qk_norm:
        yield h + "self_attn.q_norm.weight", shards[0][m + "self_attention.q_layernorm.weight"]
        yield h + "self_attn.k_norm.weight", shards[0][m + "self_attention.k_layernorm.weight"]
    yield h + "self_attn.o_proj.weight", torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], dim=1)
    yield h + "post_attention_layernorm.weight", shards[0][m + "pre_mlp_layernorm.weight"]
    gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
    yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in gate_up])
    yield h + "mlp.up_proj.weight", torch.cat([u for _, u in gate_up])
    yield h + "mlp.down_proj.weight", torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], dim=1)


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: DecoderShape, *,
                   include_tied_head: bool = False) -> Iterator[tuple[str, Tensor]]:
    """HF (name, tensor) pairs, one at a time, from every TP rank's state dict (rank order). A tied head is
    left out unless asked for (HF checkpoints omit it; a generator may want it under its own name)."""
    embed = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    yield f"{shape.hf_prefix}embed_tokens.weight", embed
    for i in range(shape.layers):
        yield from megatron_layer_to_hf(shards, shape, i)
    yield f"{shape.hf_prefix}norm.weight", shards[0]["decoder.final_layernorm.weight"]
    if not shape.tied:
        yield shape.hf_head, torch.cat([s["output_layer.weight"] for s in shards])
    elif include_tied_head:
        yield shape.hf_head, embed
