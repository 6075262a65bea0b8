"""Attention over packed rows that computes each sequence's own causal block and nothing else.

transformers finds packed sequences from restarting position ids, but then builds a dense [N, N] mask: the
attention of a packed row of N tokens costs N^2 (a 16k-token row of ~600-token sequences: ~27x the work of
its sequences' own blocks, more than the rest of the layer). gymv registers its own attention
implementation, "gymv_packed", with transformers' attention and mask registries and switches a model's text
side to it (`install`). A packed forward passes the row's segments (gymv.backends.packing) as the keyword
`gymv_packing`, which transformers hands to every attention call; with it, each segment attends causally to
its own keys (itself, or a shared prompt and itself) through torch's variable-length flash kernel on CUDA
(`torch.nn.attention.varlen`), else one SDPA call per segment. Without it (padded batches, the shared-prefix
cache path, the vision tower), the call is transformers' own SDPA with its own mask: nothing else changes.

A model whose text side uses sliding windows, attention soft-capping or bidirectional spans is not switched
(`supports` says why): transformers' dense packed mask keeps those exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from functools import lru_cache

import torch

from gymv.backends.packed_gather import gather
from gymv.backends.packing import PackedAttentionArgs
from gymv.errors import GymvError

NAME = "gymv_packed"
KEYWORD = "gymv_packing"  # a gymv.backends.packing.PackedAttentionArgs
calls = 0  # packed attention calls so far: a packed forward that adds none never reached it (see check_reached)
varlen_calls = 0  # those that ran the variable-length flash kernel


def _text_config(model):
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def supports(model) -> str | None:
    """None when `install` may switch this model; else why not."""
    cfg = _text_config(model)
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(cfg, "_attn_implementation", None) not in (None, "sdpa", "eager", NAME):
        return f"attention implementation {cfg._attn_implementation!r}"
    return None


def install(model) -> bool:
    """Switch the model's text side to packed attention (registering it once); False where unsupported."""
    if supports(model) is not None:
        return False
    _register()
    _text_config(model)._attn_implementation = NAME
    return True


@lru_cache(maxsize=None)
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, **kwargs):
        # a packed row carries no 2-D mask and no cache: its attention needs no dense mask at all
        if kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length") \
                and not kwargs.get("q_offset") and not kwargs.get("kv_offset"):
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(NAME, packed_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, mask)


def active(model) -> bool:
    return getattr(_text_config(model), "_attn_implementation", None) == NAME


_in_packed_forward: contextvars.ContextVar[bool] = contextvars.ContextVar("gymv_packed_forward", default=False)


@contextlib.contextmanager
def packed_forward():
    """Around a packed forward of a model switched to packed attention: transformers' packed-sequence detection
    (`find_packed_sequence_indices`, which reads the device once per forward to decide whether positions
    restart) gives None without looking, since the mask it would feed is never built here (`_register`'s
    mask function returns none for a row without a 2-D mask)."""
    _skip_packed_detection()
    token = _in_packed_forward.set(True)
    try:
        yield
    finally:
        _in_packed_forward.reset(token)


@lru_cache(maxsize=None)
def _skip_packed_detection() -> None:
    from transformers import masking_utils

    found = masking_utils.find_packed_sequence_indices

    @functools.wraps(found)
    def find_packed_sequence_indices(position_ids):
        return None if _in_packed_forward.get() else found(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers' attention signature: query [1, H, N, D], key/value [1, Hkv, N, D]; returns [1, N, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    args = kwargs.pop(KEYWORD, None)
    if args is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _packed(query, key, value, attention_mask, args, dropout if module.training else 0.0, scaling)


def _packed(query, key, value, attention_mask, args, dropout: float, scaling: float | None):
    """Eager even inside a compiled decoder layer (training.compile, through `eager_under_compile`): segment
    bounds are read on the host."""
    global calls, varlen_calls
    if query.shape[0] != 1 or attention_mask is not None:
        raise RuntimeError("packed attention expects one packed row and no attention mask")
    calls += 1
    out = None
    if query.is_cuda and dropout == 0.0:
        out = _varlen(query, key, value, args, scaling)
        varlen_calls += out is not None
    if out is None:
        out = _per_segment(query, key, value, args, scaling, dropout)
    return out, None


def eager_under_compile() -> None:
    """Make the packed attention call a graph break of torch.compile. Done by the code that compiles
    (gymv.backends.training.compile), not at import: `torch.compiler.disable` imports the rest of torch._dynamo,
    about 0.6 s of every training process's start (measured on 2 cores), compiled or not."""
    global _packed
    if not getattr(_packed, "gymv_eager", False):
        _packed = torch.compiler.disable(_packed)
        _packed.gymv_eager = True


def _per_segment(query, key, value, args, scaling, dropout):
    gqa = query.shape[1] != key.shape[1]
    q_bounds, k_bounds = args.bounds or (args.cu_q.tolist(), args.cu_k.tolist())
    if args.keys is not None:  # [1, H, Nk, D]
        key, value = (t.transpose(0, 2) for t in gather(args.keys, key.transpose(0, 2), value.transpose(0, 2)))
    parts = []
    for s in range(len(q_bounds) - 1):
        q0, q1, k0, k1 = q_bounds[s], q_bounds[s + 1], k_bounds[s], k_bounds[s + 1]
        k, v = key[:, :, k0:k1], value[:, :, k0:k1]
        q = query[:, :, q0:q1]
        lq, lk = q1 - q0, k1 - k0
        mask = None
        if lk != lq:  # the segment's queries are the last lq of its keys: causal, aligned bottom-right
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


@lru_cache(maxsize=None)
def _varlen_kernel():
    """(torch's varlen_attn, its keyword parameters), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(query, key, value, args, scaling):
    """Flash varlen attention where this torch has a kernel that passed the one-time check on this device and
    dtype (`_varlen_checks`); a segment whose keys start with a shared prompt also needs its causal mask
    aligned bottom-right. None: use per-segment SDPA."""
    found = _varlen_kernel()
    dtype = _half_dtype(query)
    if found is None or dtype is None:
        return None
    square, bottom_right = _varlen_checks(query.device, dtype)
    if not square or (args.keys is not None and not bottom_right):
        return None
    gqa, views = _varlen_inputs(query.device, dtype)
    return _call_varlen(query.to(dtype), key.to(dtype), value.to(dtype), args, scaling, gqa=gqa, views=views)


def _half_dtype(query) -> torch.dtype | None:
    """The 16-bit dtype the kernel runs in: the query's, or under autocast the autocast dtype (SDPA would run
    there too). A float32 query under autocast is common: rotary embeddings computed in float32 upcast it."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device)
    return None


def with_grad(check):
    """Run a one-time kernel check with autograd on: the first to ask may be a logprob pass under no_grad or
    inference mode (a GRPO step scores before it trains), where the check's backward cannot run and its
    failure would be cached, leaving the kernel unused for the whole run."""
    @functools.wraps(check)
    def run(*args):
        with torch.inference_mode(False), torch.enable_grad():
            return check(*args)
    return run


@lru_cache(maxsize=None)
@with_grad
def _varlen_checks(device, dtype) -> tuple[bool, bool]:
    """(the kernel runs forward and backward and matches SDPA on two causal sequences, and it lets query i of
    a segment with more keys than queries see the keys up to i + keys - queries), each compared once with
    SDPA on small random inputs (3 queries over 7 keys for the second)."""
    def close(got, want) -> bool:
        return got is not None and bool(torch.allclose(got.float(), want.float(), atol=2e-2))

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 64, generator=g).to(device, dtype) for _ in range(3))
    try:
        q.requires_grad_(True)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
        got = _call_varlen(q, k[:, :2], v[:, :2], PackedAttentionArgs(cu, None, cu, 4, 4), None)
        got.float().sum().backward()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        want = torch.cat([sdpa(q[:, :, a:b], k[:, :2, a:b], v[:, :2, a:b], is_causal=True, enable_gqa=True)
                          for a, b in ((0, 3), (3, 7))], dim=2).transpose(1, 2)
        square = close(got, want) and q.grad is not None and bool(torch.isfinite(q.grad).all())
    except Exception:  # noqa: BLE001 - no usable kernel here: per-segment SDPA
        return False, False
    try:
        q3 = q.detach()[:, :, :3]
        cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 7], dtype=torch.int32, device=device)
        got = _call_varlen(q3, k, v, PackedAttentionArgs(cu_q, None, cu_k, 3, 7), None)
        mask = torch.ones(3, 7, dtype=torch.bool, device=device).tril(4)
        want = torch.nn.functional.scaled_dot_product_attention(q3, k, v, attn_mask=mask).transpose(1, 2)
        return square, close(got, want)
    except Exception:  # noqa: BLE001
        return square, False


@lru_cache(maxsize=None)
@with_grad
def _varlen_inputs(device, dtype) -> tuple[bool, bool]:
    """(the kernel takes grouped-query keys and values with their own, fewer heads; it takes [N, H, D] views of
    [1, H, N, D] tensors without a copy): each compared once, output and gradients, with the path that widens
    the heads and copies (both copies cost about 1 ms per layer and micro-batch at 65K tokens on an H200)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, h, 9, 64, generator=g).to(device, dtype) for h in (4, 2, 2))
    weight = torch.randn(1, 9, 4, 64, generator=g).to(device, torch.float32)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    args = PackedAttentionArgs(cu, None, cu, 5, 5)

    def run(gqa: bool, views: bool) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = _call_varlen(*leaves, args, None, gqa=gqa, views=views)
        (out.float() * weight).sum().backward()
        return [out, *(t.grad for t in leaves)]

    def same(gqa: bool, views: bool) -> bool:
        try:
            got = run(gqa, views)
        except Exception:  # noqa: BLE001 - the kernel refuses this layout: keep the copies
            return False
        return all(a is not None and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                   for a, b in zip(got, want))

    try:
        want = run(False, False)
    except Exception:  # noqa: BLE001
        return False, False
    return same(True, False), same(False, True)


def _call_varlen(query, key, value, args, scaling, *, gqa: bool = False, views: bool = False, causal: bool = True):
    """`gqa`: pass fewer key/value heads as they are (else widened to the query's); `views`: pass the [N, H, D]
    views as they are (else contiguous copies); `causal` False: each segment attends to all its keys (a vision
    tower's images, gymv.backends.vision_attention)."""
    fn, params = _varlen_kernel()
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [N, H, D]; a view both ways
    if not views:
        q = q.contiguous()
    if args.keys is not None:
        k, v = gather(args.keys, k, v)
    kwargs: dict = {}
    if scaling is not None and "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6:
        return None  # this kernel cannot take the model's scale
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif not gqa:
            k, v = (repeat_heads(t, q.shape[1] // k.shape[1]) for t in (k, v))
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        return None
    if not views:
        k, v = k.contiguous(), v.contiguous()
    out = fn(q, k, v, args.cu_q, args.cu_k, args.max_q, args.max_k, **kwargs)
    return out.unsqueeze(0)  # [1, N, H, D]


def prepare(device) -> None:
    """Run the kernel's one-time checks for `device` now, before a packed forward pass: inside one, under
    activation checkpointing, the checks' own saved tensors would differ between the forward and its
    recomputation (and their reads would wait on the device mid-pass)."""
    device = torch.device(device)
    if device.type != "cuda" or _varlen_kernel() is None:
        return
    for dtype in (torch.bfloat16, torch.float16):
        if _varlen_checks(device, dtype)[0]:
            _varlen_inputs(device, dtype)


ATTENTION_KINDS = ("attention", "full_attention", "sliding_attention")


def attends(model) -> bool:
    """False for a decoder whose layer kinds name no attention layer (a slice of a hybrid model that is all
    Mamba and MoE layers): no call can reach packed attention there, and none needs to."""
    cfg = _text_config(model)
    kinds = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None)
    return kinds is None or any(k in ATTENTION_KINDS for k in kinds)


def check_reached(before: int, model) -> None:
    """Refuse a packed forward whose attention layers never got the packing keyword (a model that does not
    pass keywords through to attention would otherwise attend across the packed sequences, silently)."""
    if calls == before and attends(model):
        raise GymvError("this model's attention layers did not receive gymv's packing arguments, so its "
                        "sequences cannot be packed safely", where="training.sequence_packing",
                        fix="set training.sequence_packing: false")


def repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """`t.repeat_interleave(groups, dim=1)` for [N, Hkv, D] keys or values, for a kernel without grouped-query
    attention. Its forward is one stacking copy, and its backward adds each group's slices, where autograd's
    expand and sum ran at a fraction of memory speed on an H200 (about 1 ms per layer for both, at 100K keys)."""
    return _RepeatHeads.apply(t, groups)


class _RepeatHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, groups: int) -> torch.Tensor:
        ctx.groups = groups
        n, h, d = t.shape
        return torch.stack([t] * groups, dim=2).view(n, h * groups, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, heads, d = grad.shape
        parts = grad.reshape(n, heads // ctx.groups, ctx.groups, d).unbind(2)
        out = parts[0] + parts[1] if ctx.groups > 1 else parts[0].clone()
        for part in parts[2:]:
            out.add_(part)
        return out, None
