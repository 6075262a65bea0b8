"""FSDP2 over two real gloo processes: several steps equal single-process training of the whole batch (loss,
metrics and weights), a NaN on one rank refuses the step everywhere, and a sharded checkpoint written by two
ranks resumes on one rank exactly where an uninterrupted run would be. The plain (one-rank) TorchTrainer
refuses the same two-rank group."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gymv.backends.training.process_group import leave_process_group
from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.training.fsdp import FSDPTrainer
from gymv.backends.training.units import decoder_units
from gymv.backends.training.micro_batches import plan_micro_batches
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from tiny_lm import VOCAB, logprob_fn, make_samples

pytestmark = pytest.mark.slow

CONFIG = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.01, micro_batch_tokens=24, dtype="float32")
STEPS = 3
SAVE_AFTER = 2
SPLIT = 5  # rank 0 gets 5 samples, rank 1 gets 3: different micro-batch counts per rank


class TinyStack(torch.nn.Module):
    """Embedding, a list of position-wise blocks (each its own FSDP unit), head: causal, padding-proof."""

    def __init__(self, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def tiny_stack() -> TinyStack:
    torch.manual_seed(0)
    return TinyStack()


def batches():
    return [make_samples(8, seed=40 + i, max_len=14) for i in range(STEPS)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, resume_from: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = FSDPTrainer(tiny_stack(), logprob_fn, CONFIG)
        reference = FSDPTrainer(tiny_stack(), logprob_fn, CONFIG, trainable=False)
        first = 0
        if resume_from:
            t.load(resume_from)
            first = t.steps
        metrics = []
        for step, samples in enumerate(batches()):
            if step < first:
                continue
            part = samples if world == 1 else (samples[:SPLIT] if rank == 0 else samples[SPLIT:])
            metrics.append(t.train_step(part, PolicyLoss()))
            if t.steps == SAVE_AFTER and not resume_from:
                t.save(f"{out}/ckpt")
        weights = {k: v.cpu().clone() for k, v in t.state_dict().items()}
        mine = batches()[0][:SPLIT] if rank == 0 else batches()[0][SPLIT:]
        logprobs = t.compute_logprobs(mine)
        ref_logprobs = reference.compute_logprobs(mine)
        raised, untouched, plain = None, None, None
        if world > 1:
            try:
                TorchTrainer(tiny_stack(), logprob_fn, CONFIG)
            except GymvError as e:
                plain = (str(e), e.where, e.fix)
        if not resume_from:
            bad = make_samples(8, seed=30)
            bad[6]["advantages"] = torch.tensor(float("nan"))  # lands on rank 1 only
            try:
                t.train_step(bad[:SPLIT] if rank == 0 else bad[SPLIT:], PolicyLoss())
            except GymvError as e:
                raised = str(e)
            untouched = all(torch.equal(weights[k], v.cpu()) for k, v in t.state_dict().items())
        torch.save({"metrics": metrics, "weights": weights, "logprobs": logprobs, "ref_logprobs": ref_logprobs,
                    "ref_params": sum(p.numel() for p in reference.model.parameters() if p.requires_grad),
                    "raised": raised, "plain": plain,
                    "untouched": untouched, "steps": t.steps}, f"{out}/rank{rank}.pt")
    finally:
        leave_process_group()


def spawn(out, world: int, resume_from=None):
    mp.spawn(_worker, args=(world, _port(), str(out), resume_from), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, spawn(out, 2)


@pytest.fixture(scope="module")
def single_process():
    t = TorchTrainer(tiny_stack(), logprob_fn, CONFIG)
    metrics = [t.train_step(samples, PolicyLoss()) for samples in batches()]
    return {"metrics": metrics, "weights": {k: v.detach().clone() for k, v in t.state_dict().items()},
            "logprobs": t.compute_logprobs(batches()[0]),
            "initial_logprobs": TorchTrainer(tiny_stack(), logprob_fn, CONFIG).compute_logprobs(batches()[0])}


def _same_weights(got, expected):
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.allclose(got[k], v, atol=1e-6, rtol=0), k


def test_each_block_of_a_module_list_is_its_own_unit():
    assert [n for n, _ in decoder_units(tiny_stack())] == ["layers.0", "layers.1"]


def test_the_two_ranks_run_different_numbers_of_micro_batches():
    for samples in batches():
        plans = [plan_micro_batches([len(s["input_ids"]) for s in part], CONFIG.micro_batch_tokens)
                 for part in (samples[:SPLIT], samples[SPLIT:])]
        assert len(plans[0]) != len(plans[1])


def test_two_fsdp_ranks_end_with_the_weights_of_single_process_training(fsdp_run, single_process):
    for rank in fsdp_run[1]:
        _same_weights(rank["weights"], single_process["weights"])


def test_two_fsdp_ranks_report_the_loss_and_metrics_of_single_process_training(fsdp_run, single_process):
    for step, expected in enumerate(single_process["metrics"]):
        for rank in fsdp_run[1]:
            got = rank["metrics"][step]
            for k, v in expected.items():
                if k.startswith("timing/") or k == "train/num_micro_batches":
                    continue
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_fsdp_logprobs_equal_single_process_logprobs(fsdp_run, single_process):
    got = fsdp_run[1][0]["logprobs"] + fsdp_run[1][1]["logprobs"]
    for a, b in zip(got, single_process["logprobs"]):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_frozen_sharded_reference_scores_like_the_initial_policy(fsdp_run, single_process):
    ranks = fsdp_run[1]
    got = ranks[0]["ref_logprobs"] + ranks[1]["ref_logprobs"]
    for a, b in zip(got, single_process["initial_logprobs"]):
        assert torch.allclose(a, b, atol=1e-6)
    assert all(r["ref_params"] == 0 for r in ranks)  # nothing in it trains


def test_nan_on_one_fsdp_rank_refuses_the_step_on_every_rank(fsdp_run):
    ranks = fsdp_run[1]
    assert "non-finite loss" in ranks[1]["raised"]
    assert "another data-parallel rank" in ranks[0]["raised"]
    assert all(r["untouched"] for r in ranks)


def test_the_plain_trainer_refuses_two_ranks_naming_the_backend_key_and_fsdp2(fsdp_run):
    for rank in fsdp_run[1]:
        message, where, fix = rank["plain"]
        assert "trains on one rank, not 2" in message and where == "training.backend" and "fsdp2" in fix


def test_a_checkpoint_of_two_ranks_resumes_on_one_rank_as_if_uninterrupted(fsdp_run, single_process, tmp_path):
    out, _ = fsdp_run
    (resumed,) = spawn(tmp_path, 1, resume_from=str(out / "ckpt"))
    assert resumed["steps"] == STEPS
    assert len(resumed["metrics"]) == STEPS - SAVE_AFTER
    _same_weights(resumed["weights"], single_process["weights"])
    assert resumed["metrics"][-1]["train/loss"] == pytest.approx(single_process["metrics"][-1]["train/loss"], rel=1e-5)


def test_a_checkpoint_of_one_rank_resumes_on_two_ranks_as_if_uninterrupted(single_process, tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    spawn(tmp_path / "one", 1)
    resumed = spawn(tmp_path / "two", 2, resume_from=str(tmp_path / "one" / "ckpt"))
    for rank in resumed:
        assert rank["steps"] == STEPS
        assert len(rank["metrics"]) == STEPS - SAVE_AFTER
        _same_weights(rank["weights"], single_process["weights"])
        assert rank["metrics"][-1]["train/loss"] == pytest.approx(single_process["metrics"][-1]["train/loss"], rel=1e-5)
