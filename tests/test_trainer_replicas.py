"""Megatron's data-parallel replicas (ReplicaTrainer) over two real gloo processes on 127.0.0.1: the step equals
single-process training on the concatenated batch, and a NaN on one rank stops the step on every rank."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gymv.backends.training.process_group import leave_process_group
from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.training.megatron_tp import ReplicaTrainer
from gymv.backends.training.micro_batches import plan_micro_batches
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from tiny_lm import logprob_fn, make_samples, tiny_lm

pytestmark = pytest.mark.slow

# Adam divides by |g| + eps: with the default eps 1e-8 a float32 summation-order difference of 1e-9 in a
# near-zero gradient entry moves the update by up to lr * 1e-9 / 1e-8. eps 1e-3 keeps that below 1e-8.
CONFIG = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.01, micro_batch_tokens=24, dtype="float32")
LOSSES = [PolicyLoss(), PolicyLoss(aggregation="seq_mean_token_mean")]
SPLIT = 5  # rank 0 gets 5 samples, rank 1 gets 3: different micro-batch counts per rank


def batches():
    return [make_samples(8, seed=20 + i, max_len=14) for i in range(len(LOSSES))]


def nan_batch():
    bad = make_samples(8, seed=30)
    bad[6]["advantages"] = torch.tensor(float("nan"))  # lands on rank 1 only
    return bad


def _worker(rank: int, world: int, port: int, out: str, backend: str = "gloo") -> None:
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cudnn.allow_tf32 = False
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = ReplicaTrainer(tiny_lm(seed=rank), logprob_fn, CONFIG, device=device)  # rank 1 starts elsewhere: rank 0's weights must win
        metrics = []
        for samples, loss in zip(batches(), LOSSES):
            metrics.append(t.train_step(samples[:SPLIT] if rank == 0 else samples[SPLIT:], loss))
        weights = {k: v.detach().cpu().clone() for k, v in t.state_dict().items()}
        bad = nan_batch()
        try:
            t.train_step(bad[:SPLIT] if rank == 0 else bad[SPLIT:], PolicyLoss())
            raised = None
        except GymvError as e:
            raised = str(e)
        untouched = all(torch.equal(weights[k], v.cpu()) for k, v in t.state_dict().items())
        torch.save({"metrics": metrics, "weights": weights, "raised": raised, "untouched": untouched}, f"{out}/rank{rank}.pt")
    finally:
        leave_process_group()


def spawn_two(out, backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(out), backend), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def train_single(device="cpu"):
    t = TorchTrainer(tiny_lm(seed=0), logprob_fn, CONFIG, device=device)
    metrics = [t.train_step(samples, loss) for samples, loss in zip(batches(), LOSSES)]
    return {"metrics": metrics, "weights": {k: v.cpu() for k, v in t.state_dict().items()}}


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    return spawn_two(tmp_path_factory.mktemp("dp"), "gloo")


@pytest.fixture(scope="module")
def single_process():
    return train_single()


def test_replicas_end_with_the_weights_of_single_process_training(dp_results, single_process):
    for rank in dp_results:
        for k, v in single_process["weights"].items():
            assert torch.allclose(rank["weights"][k], v, atol=1e-6, rtol=0), k


def test_replicas_report_the_metrics_of_single_process_training(dp_results, single_process):
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


@pytest.mark.gpu
def test_nccl_replicas_on_two_gpus_equal_single_gpu_training(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.backends.cudnn.allow_tf32 = False
    single = train_single("cuda:0")
    ranks = spawn_two(tmp_path, "nccl")
    for rank in ranks:
        for k, v in single["weights"].items():
            assert torch.allclose(rank["weights"][k], v, atol=1e-6, rtol=0), k
    assert "non-finite loss" in ranks[1]["raised"] and all(r["untouched"] for r in ranks)
