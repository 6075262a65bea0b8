"""The layout of a packed row: a micro-batch's sequences back to back in one row, no padding, and where a
GRPO group's samples share their prompt, that prompt once.

A row is a list of segments. A plain sequence is one segment attending causally to itself. A group that
shares a prefix (gymv.backends.logprobs.prefix_key: the tokens before the first scored one, all images
inside) is one prefix segment, attending to itself, and one segment per member holding the rest of its
sequence, attending to the prefix and causally to itself. Positions continue from the prefix, so each
member computes exactly what its own unshared sequence would, and the prefix's gradients add up over
its members. Keys of segment s are `keys.index[cu_k[s]:cu_k[s+1]]` (positions in the row;
gymv.backends.packed_gather, whose plan for adding the prompt's gradients back is built here, on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gymv.backends.packed_gather import KeyGather


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: the column of each token in its own row (1-D positions of the packed row)
    source_rows: torch.Tensor  # [N]: the batch row each token comes from
    cu_q: torch.Tensor  # [S + 1] int32: segment starts in the row, and its end
    keys: KeyGather | None  # [Nk] gathered keys, or None: every segment's keys are its own tokens
    cu_k: torch.Tensor  # [S + 1] int32
    max_q: int
    max_k: int
    images: list
    image_rows: list[int]  # the batch rows whose images the row holds, in order (`images` is theirs)
    starts: list[int]  # per batch row: where its column `offsets[b]` lands in the row
    offsets: list[int]  # per batch row: its first column held in its own segment (its prefix length, or 0)

    def index(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Row positions of batch (row, column) pairs; each column must lie in the row's own segment."""
        starts = torch.tensor(self.starts, device=rows.device)
        offsets = torch.tensor(self.offsets, device=rows.device)
        return starts[rows] + columns - offsets[rows]

    def attention_args(self, device) -> PackedAttentionArgs:
        from gymv.backends.host_copy import to_device

        return PackedAttentionArgs(to_device(self.cu_q, device), None if self.keys is None else self.keys.to(device),
                                   to_device(self.cu_k, device), self.max_q, self.max_k,
                                   (self.cu_q.tolist(), self.cu_k.tolist()))


@dataclass
class PackedAttentionArgs:
    """What the packed attention needs of the row: segments, and where each segment's keys come from."""

    cu_q: torch.Tensor
    keys: KeyGather | None
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    bounds: tuple[list[int], list[int]] | None = None  # cu_q and cu_k on the host: no device read per layer


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[Sequence],
         prefixes: Sequence[tuple | None] | None = None) -> PackedRow:
    """Pack right-padded rows. `prefixes[b]`: (group, prefix length) for a row sharing its prefix with the
    other rows of its group (every image of the row inside the prefix), else None."""
    lengths = attention_mask.long().sum(1).tolist()
    prefixes = list(prefixes) if prefixes is not None else [None] * len(lengths)
    members: dict = {}
    for p in prefixes:
        if p is not None:
            members[p[0]] = members.get(p[0], 0) + 1
    prefixes = [p if p is not None and members[p[0]] > 1 else None for p in prefixes]  # alone: nothing shared
    group_first: dict = {}
    for b, p in enumerate(prefixes):
        if p is not None:
            group_first.setdefault(p[0], b)
    ids_parts, pos_parts, row_parts, q_lens, k_parts, k_lens, flat_images, image_rows = [], [], [], [], [], [], [], []
    starts, offsets = [], []
    prefix_at: dict = {}  # group -> (start in the row, length)
    n = 0

    def segment(b: int, ids: torch.Tensor, first_pos: int, keys: list[torch.Tensor]) -> int:
        nonlocal n
        start = n
        ids_parts.append(ids)
        pos_parts.append(torch.arange(first_pos, first_pos + ids.numel()))
        row_parts.append(torch.full((ids.numel(),), b, dtype=torch.long))
        own = torch.arange(start, start + ids.numel())
        k_parts.extend([*keys, own])
        k_lens.append(sum(k.numel() for k in keys) + ids.numel())
        q_lens.append(ids.numel())
        n += ids.numel()
        return start

    for b, length in enumerate(lengths):
        row = input_ids[b, :length]
        p = prefixes[b]
        if p is None or group_first.get(p[0], b) == b:  # a plain row, or its group's prompt comes first
            flat_images.extend(images[b])
            image_rows.append(b)
        if p is None:
            starts.append(segment(b, row, 0, []))
            offsets.append(0)
            continue
        group, plen = p
        if group not in prefix_at:
            prefix_at[group] = (segment(b, row[:plen], 0, []), plen)
        pstart, plen = prefix_at[group]
        starts.append(segment(b, row[plen:], plen, [torch.arange(pstart, pstart + plen)]))
        offsets.append(plen)
    cu_q = torch.nn.functional.pad(torch.cumsum(torch.tensor(q_lens), 0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(torch.cumsum(torch.tensor(k_lens), 0), (1, 0)).to(torch.int32)
    keys = KeyGather.build(torch.cat(k_parts), n) if prefix_at else None
    return PackedRow(torch.cat(ids_parts), torch.cat(pos_parts), torch.cat(row_parts), cu_q, keys, cu_k,
                     max(q_lens), max(k_lens), flat_images, image_rows, starts, offsets)
