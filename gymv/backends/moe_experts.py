"""Nemotron-H's routed experts (non-gated, relu²) as two grouped matrix products, with no host sync.

transformers' default `NemotronHExperts.forward` loops over the experts in Python: it asks the device which
experts got tokens (a sync per layer) and runs two small matrix products per expert. Here the (token,
expert) pairs are sorted by expert id on the device, each expert's slice found by `searchsorted` over the
sorted ids (offsets stay on the device: nothing is read back, so the forward, the backward and a CUDA
graph capture run without a sync), and the up and down projections of every expert run as one
`torch.nn.functional.grouped_mm` each (CUDA sm80+ in bfloat16; on CPU where the rows are 16-byte aligned),
autograd giving the backward. The routing weight scales each pair's activation (the expert width, narrower
than the model's, in the experts' dtype: a float32 weight times bfloat16 rows made every later pass
float32), and the outputs are put back in token order and summed over each token's top-k, in a fixed order.
No pass uses atomics: the gather of each pair's input row takes its gradient back by the inverse gather and
a sum over the token's k pairs (autograd's would be an `index_add_`). On CUDA the passes between the
products (relu² scaled by the routing weight, the sum over each token's pairs) are Triton kernels
(gymv.backends.moe_kernels: one read and one write each where torch's took three to five). Elsewhere
(float32 on CUDA, odd widths on CPU) the same permutation feeds a loop over the experts' slices: the
reference the grouped path is tested against.

transformers' own `experts_implementation="grouped_mm"` computes the same (sort, `histc`, `grouped_mm`);
gymv keeps its own so that what training, logprobs and the static decoder's CUDA graph run does not move
with the transformers version or the checkpoint's config, and so that one function serves all three
(gymv.backends.generation.static_hybrid uses it too). `install` hooks it into every `NemotronHExperts` of a
model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gymv.backends.kernel_check import verified

EXPERTS = ("NemotronHExperts",)
SWITCH = "GYMV_MOE_KERNELS"


def _mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# pairs up to this many are ranked by one comparison matrix instead of a radix sort (a decode step's 384 took
# a 27 µs sort kernel per MoE layer on an H100; the matrix is n² booleans: 4 MiB at the bound)
SMALL_PAIRS = 2048


def permutation(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k]: the flat (token, slot) pairs sorted by expert id, offsets [E] int32: the end of each
    expert's run in that order), computed on the device: no value is read back."""
    order, offsets, _ = _permutation(top_k_index, num_experts)
    return order, offsets


def _permutation(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`permutation` and its inverse (each pair's place in `order`)."""
    ids = top_k_index.reshape(-1)
    n = ids.numel()
    at = torch.arange(n, device=ids.device)
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=ids.dtype)
    if 0 < n <= SMALL_PAIRS:  # stable: ties by position
        key = ids * n + at
        inverse = (key.unsqueeze(0) < key.unsqueeze(1)).sum(1)
        order = torch.empty_like(inverse).scatter_(0, inverse, at)
        offsets = (ids.unsqueeze(0) < bounds.unsqueeze(1)).sum(1)
        return order, offsets.to(torch.int32), inverse
    sorted_ids, order = torch.sort(ids, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, at)
    return order, torch.searchsorted(sorted_ids, bounds, right=False).to(torch.int32), inverse


def grouped_available(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `grouped_mm` runs on these tensors: CUDA sm80+ in bfloat16, or CPU with every row 16-byte
    aligned (the CPU kernel's requirement)."""
    if _mm() is None:
        return False
    if x.device.type == "cuda":
        return x.dtype == up.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.device.type == "cpu":
        size = up.element_size()
        return all(t.shape[-1] * size % 16 == 0 and t.shape[-2] * size % 16 == 0 for t in (up, down)) \
            and all(t.data_ptr() % 16 == 0 for t in (x, up, down))
    return False


def autocast_weights(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights as autocast would give them to a matrix product: float32 master weights under a
    bfloat16 autocast (the torch and megatron backends on CUDA) come back in bfloat16, so that the grouped
    kernel runs instead of the loop (`grouped_mm` is not an autocast op, and the loop's matmuls were cast one by
    one anyway: the numbers are the same). Gradients reach the float32 weights through the cast."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return up, down
    dtype = torch.get_autocast_dtype(kind)
    if dtype == up.dtype or not up.dtype.is_floating_point:
        return up, down
    return up.to(dtype), down.to(dtype)


def _loop(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm's product (x rows of expert e times weight[e]) one expert at a time: the reference."""
    ends = offsets.tolist()
    parts = [x[a:b] @ weight[e] for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-1])


def kernels_on(t: torch.Tensor) -> bool:
    """Whether the Triton passes (gymv.backends.moe_kernels) run for `t`: on CUDA where triton imports and the
    kernels passed their one-time check on the device (gymv.backends.kernel_check), unless GYMV_MOE_KERNELS=0
    (the torch passes then run, as the benchmark compares)."""
    return t.is_cuda and verified("MoE experts", SWITCH, t.device, _check)


def _check(device: torch.device) -> bool:
    """The kernels against the same passes in torch on small random inputs, forward and backward."""
    from gymv.backends import moe_kernels

    if not moe_kernels.available():
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    a, w, grad = (torch.randn(*shape, generator=g).to(device, torch.bfloat16)
                  for shape in ((70, 300), (70,), (70, 300)))
    inverse = torch.randperm(70, generator=g).to(device)
    r = torch.relu(a.float())
    want = [r * r * w.float()[:, None], 2 * grad.float() * r * w.float()[:, None], (grad.float() * r * r).sum(1),
            F.embedding_bag(inverse.view(-1, 7), a, mode="sum")]
    got = [moe_kernels.relu2_forward(a, w), *moe_kernels.relu2_backward(a, w, grad),
           moe_kernels.sum_pairs(a, inverse, 7)]
    return all(bool(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=5e-2)) for x, y in zip(got, want))


def _sum_pairs(rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """out[t] = Σ_j rows[inverse[t*k + j]]: each token's k pair rows, summed in (token, slot) order, by one
    gather-sum kernel (no [T*k, D] tensor in token order is written, and no atomics): gymv's Triton kernel on
    CUDA, else `embedding_bag`."""
    if kernels_on(rows):
        from gymv.backends import moe_kernels

        return moe_kernels.sum_pairs(rows, inverse, k)
    return F.embedding_bag(inverse.view(-1, k), rows, mode="sum")


class _PairRows(torch.autograd.Function):
    """rows[order // k]: the row of each expert-sorted (token, slot) pair (k = 1: of the pair itself). Backward:
    the pairs' gradients summed over each row's k pairs (`_sum_pairs`)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return hidden.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        back = grad.index_select(0, inverse) if ctx.k == 1 else _sum_pairs(grad, inverse, ctx.k)
        return back, None, None, None


class _SumPairs(torch.autograd.Function):
    """`_sum_pairs` (the experts' outputs back to their tokens); backward: each pair's gradient is its token's,
    one gather. The mirror of `_PairRows`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return _sum_pairs(rows, inverse, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order // ctx.k), None, None, None


class _ScaledRelu2(torch.autograd.Function):
    """w · relu(a)² for each pair's row (a [P, I], w [P], one dtype), keeping only `a` and `w` for the backward:
    the plain ops kept relu's and the square's outputs (two [P, I] tensors), and their backward took six passes
    over [P, I] where this takes four. Under CUDA's autocast the square (a pow) ran in float32 on [P, I]; here
    nothing leaves the experts' dtype."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, w)
        r = torch.relu(a)
        return r.mul_(r).mul_(w.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, w = ctx.saved_tensors
        r = torch.relu(a)
        t = grad * r
        dw = torch.linalg.vecdot(t, r)
        return t.mul_(2 * w.unsqueeze(-1)), dw


def _scaled_relu2(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kernels_on(a):
        from gymv.backends import moe_kernels

        return moe_kernels.scaled_relu2(a, w)
    return _ScaledRelu2.apply(a, w)


def _is_relu2(act: Callable) -> bool:
    return type(act).__name__ == "ReLUSquaredActivation"


def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, up: torch.Tensor,
            down: torch.Tensor, act: Callable, grouped: bool | None = None) -> torch.Tensor:
    """Σ_k w[t, k] · down[e] act(up[e] h_t) for e = top_k_index[t, k]: hidden [T, D], up [E, I, D],
    down [E, D, I] (transformers' (out, in) layout), top_k weights [T, k]. `grouped`: None picks
    `grouped_available`; False runs the loop reference."""
    T, k = top_k_index.shape
    order, offsets, inverse = _permutation(top_k_index, up.shape[0])
    x = _PairRows.apply(hidden, order, inverse, k)
    up, down = autocast_weights(hidden, up, down)
    x = x.to(up.dtype)
    if grouped is None:
        grouped = grouped_available(x, up, down)
    mm = (lambda a, w: _mm()(a, w, offs=offsets)) if grouped else (lambda a, w: _loop(a, w, offsets))  # noqa: E731
    weights = _PairRows.apply(top_k_weights.reshape(-1), order, inverse, 1)
    a = mm(x, up.transpose(-2, -1))
    if _is_relu2(act) and order.numel() > SMALL_PAIRS:  # a decode step's few pairs keep the plain ops (below)
        h = _scaled_relu2(a, weights.to(a.dtype))
    else:  # CUDA's autocast runs relu²'s square (a pow) in float32: the product goes back to the experts' dtype
        h = (act(a) * weights.unsqueeze(-1).to(x.dtype)).to(x.dtype)
    y = mm(h, down.transpose(-2, -1))
    if order.numel() > SMALL_PAIRS:
        return _SumPairs.apply(y, order, inverse, k).to(hidden.dtype)  # T may be 0: an EP rank given no rows
    # a decode step's few pairs: the path its CUDA graph was first proven on
    back = torch.empty_like(y).index_copy(0, order, y)  # each pair back in (token, slot) order: unique indices
    return back.view(T, k, back.shape[-1]).sum(dim=1).to(hidden.dtype)


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """`NemotronHExperts.forward` through `experts`."""
    return experts(hidden_states, top_k_index, top_k_weights, module.up_proj, module.down_proj, module.act_fn)


def install(model) -> int:
    """Route every NemotronH experts module of `model` through `experts_forward` (once); how many there are.
    Experts without fused [E, out, in] weight tensors (older transformers) keep their own forward."""
    n = 0
    for m in model.modules():
        if type(m).__name__ in EXPERTS and isinstance(getattr(m, "up_proj", None), torch.nn.Parameter) \
                and m.up_proj.dim() == 3 and not getattr(m, "gymv_experts", False):
            m.forward = experts_forward.__get__(m)
            m.gymv_experts = True
            n += 1
    return n


def uninstall(model) -> int:
    """Give every experts module `install` routed back its own (transformers') forward; how many."""
    n = 0
    for m in model.modules():
        if getattr(m, "gymv_experts", False):
            del m.forward
            m.gymv_experts = False
            n += 1
    return n
