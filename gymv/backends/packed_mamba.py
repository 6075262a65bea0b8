"""Mamba-2 layers over packed rows: every sequence of the row starts from a zero state.

A Mamba-2 mixer runs through its input in order, carrying a convolution window and an SSM state, so over a
packed row each sequence would start from the state the one before it left. transformers' NemotronH mixer
takes no segment boundaries on its torch path (its `seq_idx` keyword reaches only the CUDA kernels of
`mamba_ssm` and `causal_conv1d`, which gymv does not install), so `install` wraps each mixer of the model:
in a packed forward (the row's segments arrive as gymv's packed-attention keyword, which transformers hands
to every layer) the mixer runs once per segment and the outputs are joined; any other call is the
mixer's own. A segment that continues a shared prompt would need the prompt's final state: rows of a model
with these layers are packed without sharing prompts (gymv.backends.training.hf_torch.BatchLayout).
"""

from __future__ import annotations

import torch

from gymv.backends.packed_attention import KEYWORD

MIXERS = ("NemotronHMamba2Mixer",)


def mixers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in MIXERS]


def install(model) -> bool:
    """Wrap every Mamba-2 mixer of `model` (once); False when it has none."""
    found = mixers(model)
    for m in found:
        if not getattr(m, "gymv_packed", False):
            m.forward = _per_segment(m.forward)
            m.gymv_packed = True
    return bool(found)


def _per_segment(forward):
    def packed_forward(hidden_states, *args, **kwargs):
        packing = kwargs.pop(KEYWORD, None)
        if packing is None or hidden_states.shape[0] != 1 or args or kwargs.get("cache") is not None:
            return forward(hidden_states, *args, **kwargs)
        if packing.keys is not None:
            raise RuntimeError("a packed row with shared prompts reached a Mamba-2 layer (its segments would not "
                               "start from the prompt's state)")
        cu = packing.bounds[0] if packing.bounds is not None else packing.cu_q.tolist()
        kwargs["attention_mask"] = None  # a packed row has no padding
        parts = [forward(hidden_states[:, a:b], **kwargs) for a, b in zip(cu[:-1], cu[1:]) if b > a]
        return torch.cat(parts, dim=1)
    return packed_forward
