"""Helpers over named weights that every backend and transport shares: content hashes, and the per-tensor
digests with which a refit is checked on the engine's side (gymv.cluster.refit_check).

A digest is an exact fingerprint of a tensor's bits, position by position: two tensors of the same shape
and dtype have the same digest when their bits are equal, and a permuted, transposed, half-written or
stale tensor almost surely another one. On an accelerator it is integer arithmetic where the tensor lives
(no rounding, no copy to the host: bench/refit_check.py); on a CPU a SHA-256 of its bytes. Both methods give
the same value on any device.
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
_ROW = 1 << 14  # 16-bit words per row: a row's weighted sum stays below 2**45 (words < 2**15, weights < 2**16)
_CHUNK_ROWS = 1 << 12  # rows per pass: bounds the scratch (int32 products) to 256 MiB
_SEED = 0x9E3779B1
_tables: dict[str, torch.Tensor] = {}


def _column_weights(device: torch.device) -> torch.Tensor:
    """One pseudo-random weight in [1, 2**16) per position of a row, int32 (cached per device)."""
    key = str(device)
    if key not in _tables:
        j = torch.arange(_ROW, dtype=torch.int64)
        _tables[key] = ((j * _SEED + (_SEED >> 7)) % 65521 + 1).to(torch.int32).to(device)
    return _tables[key]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 16-bit words (one byte each where there is an odd number of them)."""
    flat = t.detach().contiguous().reshape(-1)
    if (flat.numel() * flat.element_size()) % 2:
        return flat.view(torch.uint8)
    return flat.view(torch.int16) if flat.element_size() > 1 else flat.view(torch.uint8).view(torch.int16)


def _sum_digest(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the tensor's 16-bit words mod 2**31 - 1, on its own device, as a 0-d int64
    tensor there (read it when every tensor's is queued: one wait for the device, not one per tensor): products
    are int32 (|word| < 2**15 times a weight < 2**16), rows of 2**14 summed in int64, rows weighted by index."""
    words = _words(t) if t.numel() else torch.zeros(0, dtype=torch.int16, device=t.device)
    cols = _column_weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    step = _ROW * _CHUNK_ROWS
    for start in range(0, words.numel(), step):
        chunk = words[start:start + step].to(torch.int32)
        pad = (-chunk.numel()) % _ROW
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        rows = (chunk.view(-1, _ROW) * cols).sum(dim=1, dtype=torch.int64) % _PRIME
        index = torch.arange(rows.numel(), dtype=torch.int64, device=rows.device) + start // _ROW
        total = (total + ((rows * ((index * (_SEED | 1) + 12345) % _PRIME + 1)) % _PRIME).sum()) % _PRIME
    return total


DIGEST_METHODS = ("sum", "sha256")


class Digests:
    """Digests of tensors added one by one (a refit's stream): `sum` values stay on the device until `result()`
    reads them all at once, so taking them never waits for the device tensor by tensor."""

    def __init__(self, method: str | None = None):
        self.method = method
        self._pending: list[tuple[str, str, object]] = []  # (name, "shape:dtype:method", value or device scalar)

    def add(self, name: str, t: torch.Tensor) -> None:
        method = self.method or ("sha256" if t.device.type == "cpu" else "sum")
        if method == "sum":
            value: object = _sum_digest(t)
        elif method == "sha256":
            data = t.detach().cpu().contiguous().reshape(-1)
            value = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:32]
        else:
            raise ValueError(f"unknown digest method {method!r}; use one of {DIGEST_METHODS}")
        shape = "x".join(map(str, t.shape)) or "scalar"
        self._pending.append((name, f"{shape}:{str(t.dtype).removeprefix('torch.')}:{method}", value))

    def result(self) -> dict[str, str]:
        devices: dict[torch.device, list[int]] = {}
        for i, (_, _, v) in enumerate(self._pending):
            if isinstance(v, torch.Tensor):
                devices.setdefault(v.device, []).append(i)
        values = [v for _, _, v in self._pending]
        for indices in devices.values():
            for i, x in zip(indices, torch.stack([values[i] for i in indices]).tolist()):
                values[i] = f"{x:08x}"
        return {name: f"{head}:{value}" for (name, head, _), value in zip(self._pending, values)}


def tensor_digest(t: torch.Tensor, method: str | None = None) -> str:
    """An exact fingerprint of `t`: its shape, dtype, the method and its value. `sum` (the default on an
    accelerator: it reads the tensor where it is) is the integer sum above; `sha256` (the default on a CPU, where
    OpenSSL hashes faster than tensor arithmetic) the hash of its bytes. Either is the same on any device, so two
    sides compare when they use one method (gymv.cluster.refit_check makes the engine use the trainer's)."""
    digests = Digests(method)
    digests.add("", t)
    return digests.result()[""]


def digest_method(digest: str) -> str:
    """The method a digest was taken with."""
    return digest.split(":")[2]


def weight_digests(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   dtype: torch.dtype | None = None, method: str | None = None) -> dict[str, str]:
    """{name: tensor_digest} of named weights, each floating one cast to `dtype` first (the generation dtype a
    refit sends)."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    digests = Digests(method)
    with torch.no_grad():
        for name, t in pairs:
            digests.add(name, t if dtype is None or t.dtype == dtype or not t.is_floating_point() else t.to(dtype))
    return digests.result()
