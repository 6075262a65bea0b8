"""AdamW with bfloat16 moments (`training.optimizer_state_dtype: bfloat16`): stochastic rounding is unbiased,
the step follows float32 AdamW closely, a cancelled step changes nothing, the state survives a checkpoint, and
the trainers (torch and one fsdp2 rank) build and step it; on CUDA its Triton kernel matches the CPU step."""

import pytest
import torch

from gymv.algorithms.loss_fns import PolicyLoss, SFTLoss
from gymv.backends.training.adamw_bf16 import AdamWBf16State, round_stochastic
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from test_trainer_guarded_step import NaNGradientLoss, assert_identical, nan_loss_batch, snapshot
from tiny_lm import logprob_fn, make_samples, tiny_lm

CONFIG = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.01, max_grad_norm=0.05, micro_batch_tokens=24,
                         dtype="float32", optimizer_state_dtype="bfloat16")


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not():
    x = torch.full((200_000,), 1.001)  # between the bfloat16 neighbours 1.0 and 1.0078125
    rounded = round_stochastic(x, key=7).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    assert abs(float(rounded.mean()) - 1.001) < 1e-4
    assert float(x.to(torch.bfloat16).float().mean()) == 1.0


def test_stochastic_rounding_keeps_bfloat16_values_signs_and_non_finite_values():
    x = torch.tensor([0.0, -2.5, 1.0078125, float("inf"), float("-inf"), -1.001])
    y = round_stochastic(x, key=3).float()
    assert y[:5].tolist() == [0.0, -2.5, 1.0078125, float("inf"), float("-inf")]
    assert y[5] in (-1.0, -1.0078125)
    assert torch.isnan(round_stochastic(torch.tensor([float("nan")]), key=1)).all()


def test_the_same_key_gives_the_same_rounding():
    x = torch.randn(1000)
    assert torch.equal(round_stochastic(x, 5), round_stochastic(x, 5))
    assert not torch.equal(round_stochastic(x, 5), round_stochastic(x, 6))


def _reference_rounding(value: float, key: int, index: int) -> int:
    """The rounding of one element in plain Python integers (unsigned 32-bit): bfloat16 bits."""
    import struct

    m32 = 0xFFFFFFFF

    def mix(h: int) -> int:
        return h ^ (h >> 16)

    h = (index * 0x9E3779B1 + key) & m32
    h = mix((mix(mix(h) * 0x45D9F3B & m32) * 0x45D9F3B) & m32)
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (((bits + (h & 0xFFFF)) & 0xFFFF0000) >> 16) & 0xFFFF


@pytest.mark.parametrize("start", [0, 2**31 - 3, 2**32 + 11])
def test_each_elements_rounding_is_the_32_bit_hash_of_key_and_index(start):
    x = torch.randn(7) * 1e3
    key = 0x9ABCDEF1
    got = round_stochastic(x, key, start).view(torch.int16).tolist()
    want = [_reference_rounding(float(v), key, start + i) for i, v in enumerate(x)]
    assert [g & 0xFFFF for g in got] == want


def _regression(optimizer_cls, steps: int = 300, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(64))
    target = torch.randn(64)
    feats = torch.randn(256, 64)
    opt = optimizer_cls([w], lr=1e-2, weight_decay=0.01, **kw)
    for _ in range(steps):
        opt.zero_grad()
        ((feats @ (w - target)) ** 2).mean().backward()
        opt.step()
    return w.detach(), target, opt


def test_bfloat16_moments_follow_float32_adamw_closely():
    w16, target, opt = _regression(AdamWBf16State)
    w32, _, _ = _regression(torch.optim.AdamW)
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert float(state["step"]) == 300
    assert float((w16 - w32).norm() / w32.norm()) < 1e-2
    # as far along towards the optimum as float32 AdamW
    assert abs(float((w16 - target).norm()) - float((w32 - target).norm())) < 0.02 * float(target.norm())


def test_the_cpu_step_in_slices_is_bit_identical_to_one_pass(monkeypatch):
    import gymv.backends.training.adamw_bf16 as adamw_bf16

    w_whole, _, opt_whole = _regression(AdamWBf16State, steps=20)
    monkeypatch.setattr(adamw_bf16, "CPU_CHUNK", 24)  # 64 elements in slices of 24, 24 and 16
    w_sliced, _, opt_sliced = _regression(AdamWBf16State, steps=20)
    assert torch.equal(w_whole, w_sliced)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(next(iter(opt_whole.state.values()))[key], next(iter(opt_sliced.state.values()))[key])


def test_the_cpu_step_with_its_slices_across_threads_is_bit_identical_to_one_thread(monkeypatch):
    import gymv.backends.training.adamw_bf16 as adamw_bf16

    monkeypatch.setattr(adamw_bf16, "CPU_CHUNK", 24)  # 64 elements: three slices
    torch.manual_seed(0)
    grads = [torch.randn(64) for _ in range(20)]

    def steps(threads: int) -> tuple[torch.Tensor, dict]:
        w = torch.nn.Parameter(torch.zeros(64))
        opt = AdamWBf16State([w], lr=1e-2, weight_decay=0.01)
        torch.set_num_threads(threads)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        assert torch.get_num_threads() == threads  # the step hands torch its threads back
        return w.detach(), opt.state[w]

    before = torch.get_num_threads()
    try:
        (w_one, s_one), (w_three, s_three) = steps(1), steps(3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(w_one, w_three)
    assert torch.equal(s_one["exp_avg"], s_three["exp_avg"]) and torch.equal(s_one["exp_avg_sq"], s_three["exp_avg_sq"])


def test_a_nan_gradient_cancels_the_step_and_leaves_weights_moments_and_count_bit_identical():
    t = TorchTrainer(tiny_lm(0), logprob_fn, CONFIG)
    assert isinstance(t.optimizer, AdamWBf16State)
    t.train_step(make_samples(6, seed=10), SFTLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite gradient norm nan"):
        t.train_step(make_samples(6, seed=12), NaNGradientLoss())
    assert_identical(before, snapshot(t))
    assert all(float(s["step"]) == 1.0 for s in t.optimizer.state.values())


def test_a_checkpoint_resumes_the_bfloat16_state_exactly(tmp_path):
    a = TorchTrainer(tiny_lm(0), logprob_fn, CONFIG)
    a.train_step(make_samples(6, seed=10), PolicyLoss())
    a.save(tmp_path / "ckpt")
    b = TorchTrainer(tiny_lm(1), logprob_fn, CONFIG)
    b.load(tmp_path / "ckpt")
    b.optimizer.calls = a.optimizer.calls  # the rounding noise's key follows the step count of the run
    assert_identical(snapshot(a), snapshot(b))
    for t in (a, b):
        t.train_step(make_samples(6, seed=11), PolicyLoss())
    assert_identical(snapshot(a), snapshot(b))


def test_one_fsdp2_rank_steps_sharded_weights_with_bfloat16_moments():
    from gymv.backends.training.fsdp import FSDPTrainer
    from test_trainer_fsdp import tiny_stack

    t = FSDPTrainer(tiny_stack(), logprob_fn, CONFIG)
    before = snapshot(t)[0]
    t.train_step(make_samples(6, seed=10), PolicyLoss())
    weights, state = snapshot(t)
    assert any(not torch.equal(before[k], weights[k]) for k in weights)
    assert {v["exp_avg"].dtype for v in state.values()} == {torch.bfloat16}
    with pytest.raises(GymvError, match="non-finite loss"):
        t.train_step(nan_loss_batch(), PolicyLoss())
    assert_identical((weights, state), snapshot(t))


@pytest.mark.gpu
def test_the_cuda_kernel_matches_the_cpu_step_within_one_bfloat16_rounding():
    torch.manual_seed(0)
    w = torch.randn(10_000)
    grads = [torch.randn(10_000) for _ in range(3)]
    out = {}
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(w.clone().to(device))
        opt = AdamWBf16State([p], lr=1e-2, weight_decay=0.01)
        for g in grads:
            p.grad = g.to(device)
            opt.step()
        out[device] = (p.detach().cpu(), opt.state[p]["exp_avg"].float().cpu(), opt.state[p]["exp_avg_sq"].float().cpu())
    # the two devices draw different rounding noise: each moment differs by at most about one bfloat16 step
    # of the largest values it went through, and the weights by the update that difference makes
    for cpu, cuda in zip(out["cpu"], out["cuda"]):
        assert float((cpu - cuda).abs().max()) <= 2e-2 * float(cpu.abs().max()), (cpu - cuda).abs().max()
    assert float((out["cpu"][0] - out["cuda"][0]).abs().max()) < 1e-3


@pytest.mark.gpu
def test_the_cuda_step_honours_found_inf_without_a_host_read():
    p = torch.nn.Parameter(torch.randn(4096, device="cuda"))
    opt = AdamWBf16State([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.found_inf = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        del opt.found_inf
    assert torch.equal(before[0], p.detach())
    assert all(torch.equal(before[1][k], opt.state[p][k]) for k in before[1])
