"""Attention for a vision tower that packs a call's images into one sequence (RADIO, Nemotron 3 Omni's tower),
without reading the device in every block.

transformers' RADIO attention, without a flash kernel, splits the packed sequence by image with
`lengths.tolist()` in each block: a wait on the device per block and pass (64 a call for RADIO-H's 32
checkpointed blocks), each draining the queue of a tower whose host time is already its bound. gymv
registers its own implementation, "gymv_flash_vision" (transformers takes its flash branch for a name with
"flash" in it, passing the images' bounds as `cu_seq_lens_q`, and with `max_seqlen` given reads nothing from
the device): torch's variable-length flash kernel, non-causal, on CUDA where it passed a one-time check
against SDPA; else one SDPA call an image, the bounds read once.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from gymv.backends import packed_attention
from gymv.backends.packing import PackedAttentionArgs

NAME = "gymv_flash_vision"
TOWERS = ("radio",)  # vision config model types whose packed path this serves


def _vision_config(model):
    return getattr(model.config, "vision_config", None)


def install(model) -> bool:
    """Switch a RADIO tower to this attention; False for another tower or one set to another implementation."""
    cfg = _vision_config(model)
    if cfg is None or getattr(cfg, "model_type", None) not in TOWERS:
        return False
    if getattr(cfg, "_attn_implementation", None) not in (None, "sdpa", "eager", NAME):
        return False
    _register()
    cfg._attn_implementation = NAME
    return True


def installed(model) -> bool:
    cfg = _vision_config(model)
    return cfg is not None and getattr(cfg, "_attn_implementation", None) == NAME


@lru_cache(maxsize=None)
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs):
    """transformers' attention signature: query/key/value [1, H, N, D]; returns ([1, N, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:  # one image: a plain sequence
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    dropout = dropout if module.training else 0.0
    out = None
    if dropout == 0.0 and max_length_q is not None:
        out = _varlen(query, key, value, cu_seq_lens_q, int(max_length_q), scaling)
    if out is None:
        out = _per_image(query, key, value, cu_seq_lens_q.tolist(), scaling, dropout)
    return out, None


def _per_image(query, key, value, bounds: list[int], scaling, dropout: float):
    parts = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, scale=scaling)
        for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _varlen(query, key, value, cu: torch.Tensor, longest: int, scaling):
    """The flash kernel's output, or None: not on CUDA, no kernel, or it failed its check."""
    if not query.is_cuda:
        return None
    found = packed_attention._varlen_kernel()
    dtype = packed_attention._half_dtype(query)
    if found is None or dtype is None or not _checked(query.device, dtype):
        return None
    return _call(query.to(dtype), key.to(dtype), value.to(dtype), cu.to(torch.int32), longest, scaling)


def _call(query, key, value, cu, longest: int, scaling):
    """packed_attention's kernel call with no causal mask: every image's tokens see each other."""
    args = PackedAttentionArgs(cu, None, cu, longest, longest)
    return packed_attention._call_varlen(query, key, value, args, scaling, causal=False)


@lru_cache(maxsize=None)
@packed_attention.with_grad
def _checked(device, dtype) -> bool:
    """The kernel runs forward and backward and matches per-image SDPA (non-causal) on two images of 3 and 5
    tokens, head size 80 (RADIO-H's), once per device and dtype."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 80, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3))
    try:
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        got = _call(q, k, v, cu, 5, None)
        got.float().sum().backward()
        want = _per_image(q.detach(), k.detach(), v.detach(), [0, 3, 8], None, 0.0)
        return bool(torch.allclose(got.float(), want.float(), atol=2e-2)) and all(
            t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    except Exception:  # noqa: BLE001 - no usable kernel here: per-image SDPA
        return False


def prepare(device) -> None:
    """Run the one-time check now, outside any checkpointed pass (its tensors would differ between a forward and
    its recomputation)."""
    device = torch.device(device)
    if device.type == "cuda" and packed_attention._varlen_kernel() is not None:
        for dtype in (torch.bfloat16, torch.float16):
            _checked(device, dtype)


def max_seqlen(model, grid: torch.Tensor) -> int:
    """The longest image sequence of a call (its patches and the tower's summary tokens), from the host grid."""
    cfg = _vision_config(model)
    prefix = int(getattr(cfg, "num_cls_tokens", 0) or 0) + int(getattr(cfg, "num_registers", 0) or 0)
    return int(grid.prod(-1).max()) + prefix
