"""The optimizer phase runs without the host waiting on the device: a non-finite loss or gradient norm cancels
fused AdamW's step on the device (weights, moments and step count bit-identical), the foreach path refuses it
before stepping, and a normal step is plain AdamW after clip_grad_norm_, bit for bit."""

import warnings

import pytest
import torch
import torch.distributed as dist

from gymv.algorithms.loss_fns import PolicyLoss, SFTLoss
from gymv.backends.training.base import GlobalCounts
from gymv.backends.training.micro_batches import pad_collate
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from megatron_helpers import spawn_ranks
from tiny_lm import VOCAB, logprob_fn, make_samples, tiny_lm

CONFIG = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.01, max_grad_norm=0.05, micro_batch_tokens=24,
                         dtype="float32")


class FusedTrainer(TorchTrainer):
    fused = True  # AdamW's fused kernel, as on CUDA, on this CPU


class NaNGradientLoss:
    """The SFT loss plus sqrt(0 * logp): the loss stays finite, its gradient is NaN."""

    def __call__(self, mb, logp, entropy, counts, **extra):
        loss, metrics = SFTLoss()(mb, logp, entropy, counts)
        return loss + torch.sqrt((logp * 0).sum()), metrics


def nan_loss_batch() -> list[dict]:
    bad = make_samples(6, seed=11)
    bad[3]["advantages"] = torch.tensor(float("nan"))
    return bad


def snapshot(t: TorchTrainer) -> tuple[dict, dict]:
    """Weights by name, and AdamW's state (exp_avg, exp_avg_sq, step) by parameter name: this rank's shards."""
    names = {id(p): n for n, p in t.model.named_parameters()}
    local = lambda v: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()  # noqa: E731
    weights = {k: local(v) for k, v in t.model.state_dict().items()}
    state = {names[id(p)]: {k: local(v) for k, v in s.items()} for p, s in t.optimizer.state.items()}
    return weights, state


def assert_identical(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for before, after in zip(a, b):
        assert before.keys() == after.keys()
        for k in before:
            if isinstance(before[k], dict):
                assert before[k].keys() == after[k].keys()
                assert all(torch.equal(before[k][s], after[k][s]) for s in before[k]), k
            else:
                assert torch.equal(before[k], after[k]), k


def test_a_nan_loss_leaves_weights_and_adamw_state_bit_identical_on_the_fused_path():
    t = FusedTrainer(tiny_lm(0), logprob_fn, CONFIG)
    t.train_step(make_samples(6, seed=10), PolicyLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite loss nan in a micro-batch of"):
        t.train_step(nan_loss_batch(), PolicyLoss())
    assert_identical(before, snapshot(t))
    assert all(float(s["step"]) == 1.0 for s in t.optimizer.state.values())
    assert t.steps == 1 and all(p.grad is None for p in t.params)


def test_a_nan_gradient_of_a_finite_loss_leaves_the_fused_state_bit_identical():
    t = FusedTrainer(tiny_lm(0), logprob_fn, CONFIG)
    t.train_step(make_samples(6, seed=10), SFTLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite gradient norm nan"):
        t.train_step(make_samples(6, seed=12), NaNGradientLoss())
    assert_identical(before, snapshot(t))
    assert t.steps == 1


def test_the_foreach_path_refuses_a_nan_gradient_and_leaves_its_state_untouched():
    t = TorchTrainer(tiny_lm(0), logprob_fn, CONFIG)
    assert not t.optimizer.param_groups[0]["fused"]
    t.train_step(make_samples(6, seed=10), SFTLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite gradient norm nan"):
        t.train_step(make_samples(6, seed=12), NaNGradientLoss())
    assert_identical(before, snapshot(t))


def test_a_cancelled_first_step_leaves_no_optimizer_state_and_the_next_step_is_a_first_step():
    t = FusedTrainer(tiny_lm(0), logprob_fn, CONFIG)
    with pytest.raises(GymvError, match="non-finite loss"):
        t.train_step(nan_loss_batch(), PolicyLoss())
    assert len(t.optimizer.state) == 0
    fresh = FusedTrainer(tiny_lm(0), logprob_fn, CONFIG)
    samples = make_samples(6, seed=10)
    t.train_step(samples, PolicyLoss())
    fresh.train_step(samples, PolicyLoss())
    assert_identical(snapshot(fresh), snapshot(t))


@pytest.mark.parametrize("trainer_cls", [TorchTrainer, FusedTrainer], ids=["foreach", "fused"])
def test_a_clipped_step_is_plain_adamw_after_clip_grad_norm_bit_for_bit(trainer_cls):
    samples = sorted(make_samples(6, seed=13), key=lambda s: -len(s["input_ids"]))  # the trainer's row order
    cfg = CONFIG.model_copy(update={"micro_batch_tokens": 10_000})
    t = trainer_cls(tiny_lm(0), logprob_fn, cfg)
    got = t.train_step(samples, SFTLoss())

    model = tiny_lm(0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=trainer_cls is FusedTrainer)
    mb = pad_collate(samples)
    logp, entropy = logprob_fn(model, mb)
    loss, _ = SFTLoss()(mb, logp, entropy, GlobalCounts.of(mb["loss_mask"]))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    opt.step()
    assert float(norm) > 4 * cfg.max_grad_norm  # the clip acts
    assert got["train/grad_norm"] == float(norm)
    for k, v in model.state_dict().items():
        assert torch.equal(t.model.state_dict()[k], v), k


@pytest.mark.parametrize("norm", [float("inf"), float("nan")])
def test_clipping_by_a_non_finite_norm_scales_nothing(norm):
    t = TorchTrainer(tiny_lm(0), logprob_fn, CONFIG)
    for p in t.params:
        p.grad = torch.ones_like(p)
    t._clip_grads(torch.tensor(norm))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in t.params)


def test_one_fsdp2_rank_leaves_sharded_weights_and_state_bit_identical_on_a_nan_loss():
    from gymv.backends.training.fsdp import FSDPTrainer
    from test_trainer_fsdp import tiny_stack

    t = FSDPTrainer(tiny_stack(), logprob_fn, CONFIG)
    t.train_step(make_samples(6, seed=10), PolicyLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite loss"):
        t.train_step(nan_loss_batch(), PolicyLoss())
    assert_identical(before, snapshot(t))


class OneHotStack(torch.nn.Module):
    """Tokens in through a one-hot matmul: nn.Embedding's CUDA backward reads a count on the host, a wait
    that is the model's, not the trainer's."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(VOCAB, dim, bias=False)
        self.layer = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, input_ids):
        h = self.embed((input_ids.unsqueeze(-1) == torch.arange(VOCAB, device=input_ids.device)).float())
        return self.head(h + torch.tanh(self.layer(h)))


@pytest.mark.gpu
def test_a_fused_cuda_step_waits_on_the_device_once():
    torch.manual_seed(0)
    t = TorchTrainer(OneHotStack(), logprob_fn, CONFIG, device="cuda")
    assert t.optimizer.param_groups[0]["fused"]
    samples = make_samples(6, seed=10)  # several micro-batches
    t.train_step(samples, SFTLoss())  # warm-up: lazy state, the caching allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = t.train_step(samples, SFTLoss())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert metrics["train/num_micro_batches"] > 1
    assert len(syncs) == 1, syncs


@pytest.mark.gpu
def test_a_nan_loss_leaves_cuda_fused_state_bit_identical():
    t = TorchTrainer(tiny_lm(0), logprob_fn, CONFIG, device="cuda")
    t.train_step(make_samples(6, seed=10), PolicyLoss())
    before = snapshot(t)
    with pytest.raises(GymvError, match="non-finite loss"):
        t.train_step(nan_loss_batch(), PolicyLoss())
    assert_identical(before, snapshot(t))


def _offloaded_trainer(offload: bool = True):
    from gymv.backends.training.fsdp import FSDPTrainer
    from gymv.sections import FsdpSection
    from test_trainer_fsdp import tiny_stack

    return FSDPTrainer(tiny_stack(), logprob_fn, CONFIG.model_copy(update={"fsdp": FsdpSection(cpu_offload=offload)}),
                       device="cuda")


def _nan_after_offloaded_step(rank: int, world: int, port: int) -> dict:
    from gymv.backends.training.process_group import leave_process_group

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = _offloaded_trainer()
        t.train_step(make_samples(6, seed=10), PolicyLoss())
        before = snapshot(t)
        try:
            t.train_step(nan_loss_batch(), PolicyLoss())
            raised = None
        except GymvError as e:
            raised = str(e)
        return {"raised": raised, "before": before, "after": snapshot(t)}
    finally:
        leave_process_group()


@pytest.mark.gpu
def test_offloaded_fsdp2_shards_stay_bit_identical_on_a_nan_loss():
    (got,) = spawn_ranks(_nan_after_offloaded_step, 1)
    assert "non-finite loss" in got["raised"]
    assert_identical(got["before"], got["after"])


def _weights_with_and_without_offload(rank: int, world: int, port: int) -> dict:
    from gymv.backends.training.process_group import leave_process_group

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        weights = {}
        for offload in (False, True):
            torch.manual_seed(0)
            t = _offloaded_trainer(offload)
            for seed in (10, 11, 12):
                t.train_step(make_samples(6, seed=seed), PolicyLoss())
            weights[offload] = snapshot(t)[0]
        return weights
    finally:
        leave_process_group()


@pytest.mark.gpu
def test_offloaded_fsdp2_steps_land_where_on_device_steps_land():
    (got,) = spawn_ranks(_weights_with_and_without_offload, 1)
    on_device, offloaded = got[False], got[True]
    assert on_device.keys() == offloaded.keys()
    for k in on_device:  # the optimizer steps on the host (foreach) instead of the card (fused): rounding apart
        torch.testing.assert_close(offloaded[k], on_device[k], rtol=1e-5, atol=1e-6, msg=k)
