"""Helpers over named weights that every backend and transport shares: content hashes, and the per-tensor
digests with which a refit is checked on the engine's side (gymv.cluster.refit_check).

A digest is an exact fingerprint of a tensor's bits, position by position: two tensors of the same shape
and dtype have the same digest when their bits are equal, and a permuted, transposed, half-written or
stale tensor almost surely another one. It is integer arithmetic (no rounding), so the trainer's GPU, an
engine's other GPU and a CPU compute the same value, and it runs where the tensor lives, reading it once:
no copy to the host, no hash of gigabytes on one core.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def weights_hash(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """Content hash of named weights (optionally cast to `dtype` first): equal weights, equal hash."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        if dtype is not None:
            t = t.to(dtype)
        t = t.cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


_PRIME = (1 << 31) - 1
_ROW = 1 << 14  # words per row: a row's weighted sum stays below 2**62 (words < 2**31, weights < 2**17)
_CHUNK_ROWS = 1 << 10  # rows per pass: bounds the int64 scratch to 128 MiB
_SEEDS = (0x9E3779B1, 0x85EBCA77)
_tables: dict[tuple[str, int], torch.Tensor] = {}


def _column_weights(device: torch.device, seed: int) -> torch.Tensor:
    """One pseudo-random weight in [1, 2**17) per position of a row (cached per device)."""
    key = (str(device), seed)
    if key not in _tables:
        j = torch.arange(_ROW, dtype=torch.int64)
        _tables[key] = ((j * seed + (seed >> 7)) % 131071 + 1).to(device)
    return _tables[key]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as int64 words (2-byte elements one word each, 4- and 8-byte elements in 4-byte words,
    1-byte elements one byte each), all below 2**31 in magnitude."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if size == 2:
        words = flat.view(torch.int16)
    elif size in (4, 8):
        words = flat.view(torch.int32)
    else:
        words = flat.view(torch.uint8)
    return words.to(torch.int64)


def tensor_digest(t: torch.Tensor) -> str:
    """An exact fingerprint of `t`: its shape, dtype and two position-weighted sums of its bits mod 2**31 - 1."""
    words = _words(t) if t.numel() else torch.zeros(0, dtype=torch.int64, device=t.device)
    sums = []
    for seed in _SEEDS:
        cols = _column_weights(words.device, seed)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        step = _ROW * _CHUNK_ROWS
        for start in range(0, words.numel(), step):
            chunk = words[start:start + step]
            pad = (-chunk.numel()) % _ROW
            if pad:
                chunk = torch.nn.functional.pad(chunk, (0, pad))
            rows = (chunk.view(-1, _ROW) * cols).sum(dim=1) % _PRIME
            index = torch.arange(rows.numel(), dtype=torch.int64, device=rows.device) + start // _ROW
            row_weights = (index * (seed | 1) + 12345) % _PRIME + 1
            total = (total + ((rows * row_weights) % _PRIME).sum()) % _PRIME
        sums.append(int(total))
    shape = "x".join(map(str, t.shape)) or "scalar"
    return f"{shape}:{str(t.dtype).removeprefix('torch.')}:{sums[0]:08x}{sums[1]:08x}"


def weight_digests(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   dtype: torch.dtype | None = None) -> dict[str, str]:
    """{name: tensor_digest} of named weights, each cast to `dtype` first (the generation dtype a refit sends)."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    out = {}
    with torch.no_grad():
        for name, t in pairs:
            out[name] = tensor_digest(t if dtype is None or t.dtype == dtype or not t.is_floating_point()
                                      else t.to(dtype))
    return out
