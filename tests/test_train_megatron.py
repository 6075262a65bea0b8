"""`gymv train` with training.backend megatron (Megatron-core's GPTModel on the CPU, gloo) on the tiny Qwen3:
each GRPO step equals the torch backend's on the same rollouts, refits keep the generator in agreement with
the trainer, and the checkpoint is an HF folder of the torch backend's weights; and two tensor-parallel Ray
ranks take one rank's step."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.train import train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import model_weights, ray_module, tiny_grpo_settings, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow
ARCH = "tiny-qwen3"


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def run(tmp, backend: str, steps: int = 3) -> tuple[list[dict], object]:
    settings = tiny_grpo_settings(tmp, tiny_path(ARCH), **{
        "env.name": "even-length-text", "grpo.max_steps": steps, "training.backend": backend,
        "training.dtype": "float32", "training.eps": 1.0e-3})
    train(write_recipe(tmp, f"grpo-{backend}", "grpo.yaml", settings))
    run_dir = tmp / "runs" / f"grpo-{backend}"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/loss" in m], run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {b: run(tmp_path_factory.mktemp(b), b) for b in ("megatron", "torch")}


def test_each_steps_loss_and_gradient_norm_equal_the_torch_backends(runs):
    """Same seed, same rollouts: the steps differ only by fp32 summation order (the first step's GRPO loss is
    0 on policy, so its gradient norm is the sharper check)."""
    megatron, torch_ = runs["megatron"][0], runs["torch"][0]
    assert len(megatron) == len(torch_) == 3
    for m, t in zip(megatron, torch_):
        assert m["train/loss"] == pytest.approx(t["train/loss"], abs=1e-5)
        assert m["train/grad_norm"] > 0
        assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=1e-5)


def test_refits_keep_the_generator_in_agreement_with_the_trainer(runs):
    for m in runs["megatron"][0]:
        assert m["train/token_mult_prob_error"] < 1.05


def test_the_last_checkpoint_is_an_hf_folder_with_the_torch_backends_weights(runs):
    got = model_weights(runs["megatron"][1] / "checkpoints" / "step_3")
    want = model_weights(runs["torch"][1] / "checkpoints" / "step_3")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_two_tensor_parallel_ranks_on_ray_take_one_ranks_step_and_refit_the_generator(tmp_path):
    """TP=2 over two Ray training ranks (the tiny Qwen3's per-head norms included): the step of one rank on
    the same rollouts, the gathered refit reaches the generator intact, the export is an HF folder of the
    trainer's weights, and a resume from its checkpoint repeats the next step exactly."""
    import random

    import ray

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.generation import SamplingParams
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import GenerationWorker, RolloutRequest, TrainingWorker, WorkerSpec
    from gymv.config.schema import EnvSection, ParallelSection, TrainingSection
    from gymv.train.stats import policy_samples

    def spec(tensor_parallel: int = 1):
        training = TrainingSection(backend="megatron", lr=1e-3, eps=1e-3, weight_decay=0.01, dtype="float32",
                                   micro_batch_tokens=512, parallel=ParallelSection(tensor=tensor_parallel))
        return WorkerSpec(model_path=str(tiny_path(ARCH)), env=EnvSection(name="even-length-text"), training=training)

    gen = GenerationWorker(spec())
    env = gen.router.default
    rows = [(i, env.make_row(random.Random(i), env.presets["default"], i)) for i in range(3)]
    out = gen.rollouts(rows, RolloutRequest(group_size=2, params=SamplingParams(max_new_tokens=8), seed=3))
    samples = policy_samples(out["trajectories"], [1.0, -1.0, 0.5, -0.5, 0.25, -0.25])

    one = TrainingWorker(spec())
    one.setup()
    want = one.grpo_step([[dict(s) for s in samples]], PolicyLoss())
    want_weights = one.weights()
    one.close()

    cluster = PolicyCluster(spec(tensor_parallel=2), Placement(num_generation=1, num_training=2))
    try:
        got = cluster.grpo_step([[dict(s) for s in samples]], PolicyLoss())
        weights, *_ = ray.get([cluster.trainers[0].weights.remote()] + cluster._followers())
        cluster.refit(1)
        trainer_hash, generator_hashes = cluster.weight_hashes()
        exported = cluster.export(tmp_path / "export")
        cluster.save(tmp_path / "ckpt")  # then: a second step, a resume from the checkpoint, the second step again
        cluster.grpo_step([[dict(s) for s in samples]], PolicyLoss())
        second, *_ = ray.get([cluster.trainers[0].weights.remote()] + cluster._followers())
        resumed_at = cluster.load(tmp_path / "ckpt")
        cluster.grpo_step([[dict(s) for s in samples]], PolicyLoss())
        again, *_ = ray.get([cluster.trainers[0].weights.remote()] + cluster._followers())
    finally:
        cluster.shutdown()
    assert resumed_at == 1 and sorted(p.name for p in (tmp_path / "ckpt").glob("optimizer*")) == [
        "optimizer_tp0.pt", "optimizer_tp1.pt"]
    for name, tensor in second.items():  # weights and each TP rank's optimizer state came back
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0, msg=name)
    assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6)
    assert want["train/grad_norm"] > 0
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    assert weights.keys() == want_weights.keys()
    for name, tensor in want_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
    assert generator_hashes == [trainer_hash]
    for name, tensor in model_weights(exported).items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=name)
