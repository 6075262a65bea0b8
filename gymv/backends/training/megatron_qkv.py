"""Megatron's fused attention projection: per kv group, its q heads then k then v, as linear_qkv holds them.
Pure tensor arithmetic shared by the dense (megatron_weights) and hybrid (megatron_hybrid_weights) mappings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: Any, groups: int | None = None) -> Tensor:
    """[q; k; v] rows (weight or bias) -> Megatron's grouped layout: per kv group, its q heads, k, v. A TP
    rank's rows of each (`groups` = kv_heads / tp of them) fuse to its rows of the whole fused tensor. `shape`:
    any with heads, kv_heads and head_dim (the hybrid model's HybridShape too)."""
    g, d = shape.kv_heads if groups is None else groups, shape.head_dim
    per = shape.heads // shape.kv_heads
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def split_qkv(qkv: Tensor, shape: Any, groups: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv` over `groups` kv groups (a TP shard holds kv_heads / tp of them)."""
    g = shape.kv_heads if groups is None else groups
    d, per = shape.head_dim, shape.heads // shape.kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)
