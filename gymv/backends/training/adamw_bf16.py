"""AdamW with its two moments kept in bfloat16, written back by stochastic rounding.

Why: float32 moments cost 8 bytes per parameter, about 66 GB for an 8B vision-language model, which with
float32 weights and gradients (8 more bytes) leaves a single 141 GB GPU no room for activations. In bfloat16
the moments take 4 bytes. Round-to-nearest would freeze the second moment: with beta2 = 0.999 one update
moves it by about 0.1%, below bfloat16's resolution of 0.4%, so it would round back to where it was. Rounding
each new value up or down with probability proportional to its distance keeps every moment an unbiased
estimate of its float32 value. (Megatron-core's precision-aware optimizer offers the same trade.)

The arithmetic is float32: weights, gradients and the update are as in `torch.optim.AdamW`; only the stored
moments are bfloat16. On CUDA one Triton kernel per parameter reads the weight, gradient and moments once and
writes them once; it honours a `found_inf` flag on the device (the step leaves everything as it was), so the
trainer's step needs no host sync, as with AdamW's fused kernel. On a CPU the same step runs as tensor
operations. The rounding noise is a pure function of (seed, step, parameter index, element), so a run is
reproducible on a given device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gymv.backends.training.base import local_shard as _local
from gymv.sections import TrainingSection, default

_M32 = 0xFFFFFFFF


_MIX = 0x45D9F3B
_GOLDEN = 0x9E3779B1 - 2**32  # as a signed 32-bit value: the same bits


def _as_int32(u: int) -> int:
    """The signed 32-bit value with the bits of unsigned `u` (mod 2**32)."""
    u &= _M32
    return u - 2**32 if u >= 2**31 else u


def _shift16_(x: Tensor, scratch: Tensor) -> Tensor:
    """x ^= x >>> 16 (a logical shift: the arithmetic one's sign bits masked off), in place."""
    torch.bitwise_right_shift(x, 16, out=scratch)
    scratch.bitwise_and_(0xFFFF)
    return x.bitwise_xor_(scratch)


def round_stochastic(x: Tensor, key: int, start: int = 0) -> Tensor:
    """bfloat16 of float32 `x`, rounded away from or towards zero with probability proportional to the
    distance (so its expectation is `x`); the 16 random bits per element are hashed from (key, index), the
    index counted from `start` (a chunk of a larger tensor draws the bits the whole tensor would).

    The hash is unsigned 32-bit arithmetic done in int32 tensors, in place: two's-complement products, sums
    and XORs keep the low 32 bits an unsigned product would (10.5x faster on a CPU than the int64 arithmetic it
    replaces, bit for bit the same; the offloaded AdamW step runs it on every moment)."""
    n = x.numel()
    if start + n < 2**31:
        h = torch.arange(start, start + n, dtype=torch.int32, device=x.device)
    else:
        h = torch.arange(start, start + n, dtype=torch.int64, device=x.device).to(torch.int32)  # mod 2**32
    h.mul_(_GOLDEN).add_(_as_int32(key))
    scratch = torch.empty_like(h)
    _shift16_(h, scratch).mul_(_MIX)
    _shift16_(h, scratch).mul_(_MIX)
    noise = _shift16_(h, scratch).bitwise_and_(0xFFFF)
    bits = x.contiguous().view(torch.int32).reshape(-1)
    rounded = noise.add_(bits).bitwise_and_(_as_int32(0xFFFF0000))
    rounded = torch.where(torch.isfinite(x.reshape(-1)), rounded, bits)  # inf/NaN pass through as they are
    return rounded.view(torch.float32).to(torch.bfloat16).view(x.shape)


_KERNEL = None


def _triton_kernel():
    """The fused CUDA step (compiled on first use; Triton ships with CUDA builds of PyTorch)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_bf16_step(p_ptr, g_ptr, m_ptr, v_ptr, skip_ptr, bc1_ptr, bc2_sqrt_ptr, n, lr, beta1, beta2, eps,
                        decay, seed, BLOCK: tl.constexpr):
        if tl.load(skip_ptr) != 0:
            return
        bc1 = tl.load(bc1_ptr)
        bc2_sqrt = tl.load(bc2_sqrt_ptr)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * decay - lr * (m / bc1) / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        r0, r1, _, _ = tl.randint4x(seed, offs)
        m_bits = (m.to(tl.uint32, bitcast=True) + (r0 & 0xFFFF)) & 0xFFFF0000
        v_bits = (v.to(tl.uint32, bitcast=True) + (r1 & 0xFFFF)) & 0xFFFF0000
        tl.store(m_ptr + offs, m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
        tl.store(v_ptr + offs, v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)

    _KERNEL = adamw_bf16_step
    return _KERNEL


CPU_CHUNK = 1 << 18


def _chunks(weight: Tensor, grad: Tensor, m: Tensor, v: Tensor):
    """(first element, weight, gradient, moments) in slices of CPU_CHUNK elements. Why: the CPU step's
    temporaries (float32 moments, the rounding's bits) are then a few MB, which stay in a core's cache through
    the step's two dozen passes (2.2x faster on 2 cores than slices of 4M elements, whose passes each went to
    memory), not ten times the largest parameter (an 8B VLM's 545M-element embedding: over 20 GB at once, in
    the host memory an offloaded run's weights, gradients and moments already fill). One slice where a tensor
    is not contiguous."""
    tensors = (weight, grad, m, v)
    if not all(t.is_contiguous() for t in tensors) or weight.numel() <= CPU_CHUNK:
        yield (0, *tensors)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, weight.numel(), CPU_CHUNK):
        yield (start, *(f[start:start + CPU_CHUNK] for f in flat))


@torch.no_grad()  # grad mode is per thread: a pool's threads do not inherit the step's
def _cpu_slice_step(piece: tuple, hyper: tuple) -> None:
    (start, w, g, mc, vc), (beta1, beta2, eps, decay, step_size, bc2_sqrt, key) = piece, hyper
    m32 = mc.float().mul_(beta1).add_(g.float(), alpha=1.0 - beta1)
    v32 = vc.float().mul_(beta2).addcmul_(g.float(), g.float(), value=1.0 - beta2)
    denom = (v32.sqrt() / bc2_sqrt).add_(eps)
    w.mul_(decay).addcdiv_(m32, denom, value=-step_size)
    mc.copy_(round_stochastic(m32, key, start))
    vc.copy_(round_stochastic(v32, key ^ 0x5BD1E995, start))


def _run_across_cores(fn, work: list[tuple]) -> None:
    """fn(*item) for every item, each slice on one core: torch's own threading splits every operation of a
    slice across the cores and joins them after it, two dozen times a slice; a slice per thread keeps each
    core on its own slice, in its own cache. Elementwise, so the result is the same bits in any order."""
    threads = torch.get_num_threads()
    if threads <= 1 or len(work) <= 1:
        for item in work:
            fn(*item)
        return
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(work))) as pool:
            for f in [pool.submit(fn, *item) for item in work]:
                f.result()
    finally:
        torch.set_num_threads(threads)


class AdamWBf16State(torch.optim.Optimizer):
    """`torch.optim.AdamW` semantics (decoupled weight decay, bias correction), moments in bfloat16.

    `found_inf` (set as an attribute by the caller, as GradScaler does for the fused AdamW): where it holds
    a nonzero value the step changes no weight, moment or step count."""

    honours_found_inf = True

    def __init__(self, params, lr: float = default(TrainingSection, "lr"),
                 betas: tuple[float, float] = tuple(default(TrainingSection, "betas")),
                 eps: float = default(TrainingSection, "eps"), weight_decay: float = default(TrainingSection, "weight_decay"),
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.seed = int(seed)
        self.calls = 0  # steps asked for, cancelled ones included: with the parameter index, the noise's key

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        self.calls += 1
        index = 0
        slices: list = []  # the CPU parameters' work, run across the cores once all are gathered
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._state(p)
                slices += self._update(p, state, group, beta1, beta2, index, found_inf)
        _run_across_cores(_cpu_slice_step, slices)
        return loss

    def _update(self, p: Tensor, state: dict, group: dict, beta1: float, beta2: float, index: int,
                found_inf: Tensor | None) -> list[tuple]:
        """Steps a CUDA parameter now; returns a CPU parameter's slices for _cpu_slice_step."""
        weight, grad = _local(p), _local(p.grad)
        m, v, step = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"]
        lr, eps, decay = group["lr"], group["eps"], 1.0 - group["lr"] * group["weight_decay"]
        if weight.device.type == "cuda":
            # the step count stays on the device: bias corrections from it without a host read
            skip = found_inf.to(device=weight.device, dtype=torch.float32) if found_inf is not None \
                else torch.zeros((), device=weight.device)
            step.add_(1.0 - skip)
            count = torch.clamp(step, min=1.0)
            bc1 = (1.0 - torch.pow(beta1, count)).reshape(1)
            bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, count)).reshape(1)
            self._cuda_step(weight, grad, m, v, skip, lr, beta1, beta2, eps, decay, bc1, bc2_sqrt, index)
            return []
        if found_inf is not None and float(found_inf) != 0.0:
            return []
        step.add_(1.0)
        n = float(step)
        hyper = (beta1, beta2, eps, decay, lr / (1.0 - beta1**n), math.sqrt(1.0 - beta2**n), self._key(index))
        return [(piece, hyper) for piece in _chunks(weight, grad, m, v)]

    def _key(self, index: int) -> int:
        return (self.seed * 0x01000193 + self.calls * 0x9E3779B1 + index * 0x85EBCA6B) & 0x7FFFFFFF

    def _cuda_step(self, weight, grad, m, v, skip, lr, beta1, beta2, eps, decay, bc1, bc2_sqrt, index) -> None:
        n = weight.numel()
        if n:
            block = 2048
            _triton_kernel()[(-(-n // block),)](weight, grad, m, v, skip, bc1, bc2_sqrt, n, lr, beta1, beta2, eps,
                                                decay, self._key(index), BLOCK=block)
