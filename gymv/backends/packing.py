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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gymv.backends.host_copy import to_device, to_device_many
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
    bounds: tuple[list[int], list[int]] | None = None  # cu_q and cu_k as host lists (no device read per layer)
    prefix_of: list[int] | None = None  # per segment: the segment holding its shared prompt, or -1; None: none

    def to(self, device) -> PackedRow:
        """The row with its tensors on `device`, moved in one copy (host lists stay)."""
        keys = self.keys
        tensors = [self.input_ids, self.positions, self.source_rows, self.cu_q, self.cu_k]
        if keys is not None:
            tensors += [keys.index, keys.first, keys.repeated, *keys.tables]
        moved = to_device_many(tensors, device)
        if keys is not None:
            keys = KeyGather(*moved[5:8], moved[8:])
        return dataclasses.replace(self, input_ids=moved[0], positions=moved[1], source_rows=moved[2],
                                   cu_q=moved[3], cu_k=moved[4], keys=keys, bounds=self.host_bounds())

    def host_bounds(self) -> tuple[list[int], list[int]]:
        return self.bounds if self.bounds is not None else (self.cu_q.tolist(), self.cu_k.tolist())

    def index(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Row positions of batch (row, column) pairs; each column must lie in the row's own segment."""
        starts = torch.tensor(self.starts, device=rows.device)
        offsets = torch.tensor(self.offsets, device=rows.device)
        return starts[rows] + columns - offsets[rows]

    def attention_args(self, device) -> PackedAttentionArgs:
        return PackedAttentionArgs(to_device(self.cu_q, device), None if self.keys is None else self.keys.to(device),
                                   to_device(self.cu_k, device), self.max_q, self.max_k, self.host_bounds(),
                                   self.prefix_of)


@dataclass
class PackedAttentionArgs:
    """What the packed attention needs of the row: segments, and where each segment's keys come from."""

    cu_q: torch.Tensor
    keys: KeyGather | None
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    bounds: tuple[list[int], list[int]] | None = None  # cu_q and cu_k on the host: no device read per layer
    prefix_of: list[int] | None = None  # per segment: the segment holding its shared prompt, or -1
    # what a layer derives from the row once per forward (gymv.backends.packed_mamba's prompt plan), by key
    plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


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
    # each segment: (batch row, first column taken, length, first position, shared prefix's (start, length))
    segments: list[tuple[int, int, int, int, tuple[int, int] | None]] = []
    flat_images, image_rows, starts, offsets = [], [], [], []
    prefix_at: dict = {}  # group -> (start in the row, length)
    n = 0

    def segment(b: int, col: int, length: int, first_pos: int, prefix: tuple[int, int] | None) -> int:
        nonlocal n
        segments.append((b, col, length, first_pos, prefix))
        n += length
        return n - length

    for b, length in enumerate(lengths):
        p = prefixes[b]
        if p is None or group_first.get(p[0], b) == b:  # a plain row, or its group's prompt comes first
            flat_images.extend(images[b])
            image_rows.append(b)
        if p is None:
            starts.append(segment(b, 0, length, 0, None))
            offsets.append(0)
            continue
        group, plen = p
        if group not in prefix_at:
            prefix_at[group] = (segment(b, 0, plen, 0, None), plen)
        starts.append(segment(b, plen, length - plen, plen, prefix_at[group]))
        offsets.append(plen)
    # every per-token tensor from the segment table at once (a micro-batch holds a hundred or more segments)
    rows, cols, lens, first = (np.array(c, dtype=np.int64) for c in list(zip(*segments))[:4])
    seg_start = np.cumsum(lens) - lens
    offset = np.arange(n) - np.repeat(seg_start, lens)  # each token's place in its segment
    width = input_ids.shape[1]
    flat = np.repeat(rows * width + cols, lens) + offset
    ids = input_ids.reshape(-1)[torch.from_numpy(flat)]
    positions = torch.from_numpy(np.repeat(first, lens) + offset)
    source_rows = torch.from_numpy(np.repeat(rows, lens))
    prefix = np.array([sp if sp is not None else (0, 0) for *_, sp in segments], dtype=np.int64).reshape(-1, 2)
    k_lens = prefix[:, 1] + lens
    q_lens = lens
    keys = None
    if prefix_at:  # per segment: its prefix's positions, then its own
        range_starts = np.stack([prefix[:, 0], seg_start], 1).reshape(-1)
        range_lens = np.stack([prefix[:, 1], lens], 1).reshape(-1)
        key_index = np.repeat(range_starts - (np.cumsum(range_lens) - range_lens), range_lens) + np.arange(
            int(range_lens.sum()))
        keys = KeyGather.build(torch.from_numpy(key_index), n)
    cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])).to(torch.int32)
    cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(k_lens)])).to(torch.int32)
    prefix_of = None
    if prefix_at:
        index_at = {int(start): s for s, start in enumerate(seg_start)}
        prefix_of = [index_at[sp[0]] if sp is not None else -1 for *_, sp in segments]
    return PackedRow(ids, positions, source_rows, cu_q, keys, cu_k, int(q_lens.max()), int(k_lens.max()),
                     flat_images, image_rows, starts, offsets, (cu_q.tolist(), cu_k.tolist()), prefix_of)
