"""Data parallel over two real gloo processes on 127.0.0.1: the step equals single-process training on the
concatenated batch, and a NaN on one rank stops the step on every rank."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.training.micro_batches import plan_micro_batches
from gymv.backends.training.torch_trainer import TorchTrainer, TrainerConfig
from gymv.errors import GymvError
from tiny_lm import logprob_fn, make_samples, tiny_lm

pytestmark = pytest.mark.slow

CONFIG = TrainerConfig(lr=1e-2, weight_decay=0.01, micro_batch_tokens=24)
LOSSES = [PolicyLoss(), PolicyLoss(aggregation="seq_mean_token_mean")]
SPLIT = 5  # rank 0 gets 5 samples, rank 1 gets 3: different micro-batch counts per rank


def batches():
    return [make_samples(8, seed=20 + i, max_len=14) for i in range(len(LOSSES))]


def nan_batch():
    bad = make_samples(8, seed=30)
    bad[6]["advantages"] = torch.tensor(float("nan"))  # lands on rank 1 only
    return bad


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = TorchTrainer(tiny_lm(seed=rank), logprob_fn, CONFIG)  # rank 1 starts elsewhere: rank 0's weights must win
        metrics = []
        for samples, loss in zip(batches(), LOSSES):
            metrics.append(t.train_step(samples[:SPLIT] if rank == 0 else samples[SPLIT:], loss))
        weights = {k: v.clone() for k, v in t.state_dict().items()}
        bad = nan_batch()
        try:
            t.train_step(bad[:SPLIT] if rank == 0 else bad[SPLIT:], PolicyLoss())
            raised = None
        except GymvError as e:
            raised = str(e)
        untouched = all(torch.equal(weights[k], v) for k, v in t.state_dict().items())
        torch.save({"metrics": metrics, "weights": weights, "raised": raised, "untouched": untouched}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single_process():
    t = TorchTrainer(tiny_lm(seed=0), logprob_fn, CONFIG)
    metrics = [t.train_step(samples, loss) for samples, loss in zip(batches(), LOSSES)]
    return {"metrics": metrics, "weights": t.state_dict()}


def test_data_parallel_weights_equal_single_process_training(dp_results, single_process):
    for rank in dp_results:
        for k, v in single_process["weights"].items():
            assert torch.allclose(rank["weights"][k], v, atol=1e-6, rtol=0), k


def test_data_parallel_metrics_equal_single_process_metrics(dp_results, single_process):
    for step, expected in enumerate(single_process["metrics"]):
        for rank in dp_results:
            got = rank["metrics"][step]
            for k, v in expected.items():
                if k.startswith("timing/") or k == "train/num_micro_batches":
                    continue
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_the_two_ranks_run_different_numbers_of_micro_batches():
    # guards the setup above: equality must not depend on ranks doing the same number of backward passes
    for samples in batches():
        plans = [plan_micro_batches([len(s["input_ids"]) for s in part], CONFIG.micro_batch_tokens) for part in (samples[:SPLIT], samples[SPLIT:])]
        assert len(plans[0]) != len(plans[1])


def test_nan_on_one_rank_stops_the_step_on_every_rank(dp_results):
    assert "non-finite loss" in dp_results[1]["raised"]
    assert "another data-parallel rank" in dp_results[0]["raised"]
    assert all(r["untouched"] for r in dp_results)
