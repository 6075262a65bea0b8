"""The fsdp2 training backend on a real local Ray with the real tiny LLaVA: two sharded ranks (one with
image rows, one text-only) take the step one plain rank takes, their group listens on loopback only, a refit reaches
the generator intact, the sharded checkpoint resumes on one rank, and the export is a Hugging Face folder of the
same weights."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

from net_listeners import descendants, is_loopback, listeners
from tiny_models import tiny_path
from train_helpers import ray_module

pytestmark = pytest.mark.slow
BUCKET_MB = 0.1  # 52,428 bf16 elements a refit bucket: the 131,072-element embedding spans three


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def _spec(backend: str, generation_dtype: str = "float32", *, kl_reference: bool = True, **training):
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, TrainingSection

    # Adam's eps is large so float32 summation-order noise between 1 and 2 ranks cannot move the update.
    training = TrainingSection(backend=backend, lr=1e-3, eps=1e-3, weight_decay=0.01, dtype="float32",
                               micro_batch_tokens=512, **training)
    return WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle_count"),
                      kl_reference=kl_reference, training=training, generation_dtype=generation_dtype)


@pytest.fixture(scope="module")
def image_samples():
    from gymv.backends.generation import SamplingParams
    from gymv.cluster.workers import GenerationWorker, RolloutRequest
    from gymv.train.stats import policy_samples

    gen = GenerationWorker(_spec("torch"))
    env = gen.router.default
    rows = [(i, env.make_row(random.Random(i), env.presets["tiny"], i)) for i in range(3)]
    out = gen.rollouts(rows, RolloutRequest(group_size=2, params=SamplingParams(max_new_tokens=8), seed=3))
    samples = policy_samples(out["trajectories"], [1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    assert len(samples) == 6 and all(s.get("images") for s in samples)
    # rank 1 gets the last three, cut to text only: one rank embeds image features, the other does not
    return samples[:3] + [_text_only(s) for s in samples[3:]]


def _text_only(sample: dict) -> dict:
    """The sample from four tokens before its first scored one (after the image): no image left."""
    start = list(sample["loss_mask"]).index(1) - 4
    n = len(sample["input_ids"])
    out = {k: (v[start:] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in sample.items()}
    out["images"] = []
    return out


@pytest.fixture(scope="module")
def single_step(image_samples):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.cluster.workers import TrainingWorker

    single = TrainingWorker(_spec("torch"))
    single.setup()
    metrics = single.grpo_step([[dict(s) for s in image_samples]], PolicyLoss())
    return metrics, single.weights()


@pytest.fixture(scope="module")
def fsdp_cluster(image_samples, tmp_path_factory):
    import ray

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.config.schema import RefitSection

    tmp = tmp_path_factory.mktemp("fsdp")
    # a bf16 generator: the gathered weights are cast one by one on their way to it, in buckets smaller
    # than the largest tensor
    spec = replace(_spec("fsdp2", "bfloat16"), refit=RefitSection(bucket_mb=BUCKET_MB))
    cluster = PolicyCluster(spec, Placement(num_generation=1, num_training=2))
    try:
        metrics = cluster.grpo_step([image_samples], PolicyLoss())
        listening = listeners(descendants(os.getpid()))  # Ray's and the rank group's rendezvous included
        weights, *_ = ray.get([cluster.trainers[0].weights.remote()] + cluster._followers())
        cluster.refit(1)
        hashes = cluster.weight_hashes()
        # the second refit streams each gathered tensor into the buckets; other weights in the generator
        # first, so only a complete refit makes the hashes equal again
        ray.get(cluster.generators[0].restore.remote({k: v * 0.5 for k, v in weights.items()}, 1))
        scrambled = cluster.weight_hashes()
        cluster.refit(2)
        streamed = cluster.weight_hashes()
        parts = ray.get([t.publish.remote() for t in cluster.trainers])  # each rank ships the buckets it owns
        refs = [ref for part in parts for ref in part["buckets"]]
        buckets = {"refs": all(isinstance(ref, ray.ObjectRef) for ref in refs), "nbytes": [ray.get(r).nbytes for r in refs],
                   "owned": sorted(k for part in parts for k in part["owned"]), "numel": parts[0]["layout"].numel}
        cluster.save(tmp / "ckpt")
        exported = cluster.export(tmp / "export")
    finally:
        cluster.shutdown()
    return {"metrics": metrics, "listening": listening, "weights": weights, "hashes": hashes, "scrambled": scrambled, "streamed": streamed,
            "buckets": buckets, "ckpt": tmp / "ckpt", "export": exported}


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_two_fsdp_ranks_take_the_step_of_one_plain_rank(fsdp_cluster, single_step):
    one, reference = single_step
    two = fsdp_cluster["metrics"]
    assert two["train/num_sequences"] == one["train/num_sequences"] == 6
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    assert _close(fsdp_cluster["weights"], reference) < 0.05 * 1e-3  # float noise, well under lr per weight


def test_the_ranks_and_their_group_listen_on_loopback_only(fsdp_cluster):
    assert fsdp_cluster["listening"]
    assert [(addr, port) for _, addr, port in fsdp_cluster["listening"] if not is_loopback(addr)] == []


def test_two_fsdp_ranks_with_activation_checkpointing_take_the_same_step(image_samples, single_step):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.cluster.group import Placement, PolicyCluster

    one, _ = single_step
    spec = _spec("fsdp2", kl_reference=False, gradient_checkpointing=True)
    cluster = PolicyCluster(spec, Placement(num_generation=0, num_training=2), generation=False)
    try:
        two = cluster.grpo_step([image_samples], PolicyLoss())
    finally:
        cluster.shutdown()
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)


def test_a_refit_from_sharded_ranks_gives_the_generator_the_trainers_weights(fsdp_cluster):
    trainer, generators = fsdp_cluster["hashes"]
    assert generators == [trainer]


def test_a_streamed_bucketed_refit_from_sharded_ranks_gives_the_generator_the_trainers_weights(fsdp_cluster):
    trainer, generators = fsdp_cluster["scrambled"]
    assert generators != [trainer]
    trainer, generators = fsdp_cluster["streamed"]
    assert generators == [trainer]


def test_the_object_store_refit_is_one_stored_object_per_bucket_each_shipped_by_one_rank(fsdp_cluster):
    buckets = fsdp_cluster["buckets"]
    count = -(-buckets["numel"] * 2 // int(BUCKET_MB * 2**20))
    assert buckets["refs"] and len(buckets["nbytes"]) == count and buckets["owned"] == list(range(count))
    assert max(buckets["nbytes"]) <= BUCKET_MB * 2**20 and sum(buckets["nbytes"]) == buckets["numel"] * 2


def test_the_sharded_checkpoint_of_two_ranks_loads_on_one_rank(fsdp_cluster):
    from gymv.cluster.workers import TrainingWorker

    one = TrainingWorker(_spec("fsdp2"))
    one.setup()
    try:
        assert one.load(str(fsdp_cluster["ckpt"])) == 1
        assert _close(one.weights(), fsdp_cluster["weights"]) == 0.0
    finally:
        one.close()


def test_the_export_loads_with_from_pretrained_and_holds_the_trained_weights(fsdp_cluster):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(fsdp_cluster["export"])
    trained = fsdp_cluster["weights"]
    got = model.state_dict()
    for k, v in trained.items():
        assert torch.equal(got[k], v), k


def test_gymv_train_runs_fsdp2_on_two_cpu_ranks_and_resumes_from_its_sharded_checkpoint_on_one(tmp_path):
    import json

    from gymv.train import train
    from train_helpers import tiny_grpo_settings, write_recipe

    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"training.backend": "fsdp2", "grpo.max_steps": 2,
                                                                        "cluster.cpu_training_ranks": 2})
    recipe = write_recipe(tmp_path, "fsdp2-e2e", "vlm_grpo.yaml", settings)
    first = train(recipe)
    run = tmp_path / "runs" / "fsdp2-e2e"
    assert first["complete"] and list(run.rglob("dcp/.metadata"))
    assert len({p.name for p in run.rglob("dcp/*.distcp")}) == 2  # each of the two ranks wrote its shards
    second = train(None, ["grpo.max_steps=3", "cluster.cpu_training_ranks=1"], resume_dir=str(run))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert second["complete"] and steps == [1, 2, 3]  # resumed after step 2, nothing repeated
