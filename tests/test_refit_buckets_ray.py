"""A bucketed collective refit between real Ray actors with the real tiny LLaVA: the generator ends with the
trainer's weights bit for bit, on the first refit and on the streamed one after it, with buckets smaller than
the largest tensor. (object_store's bucketed refit from sharded ranks is in test_train_fsdp.py.)"""

from __future__ import annotations

import pytest

from tiny_models import tiny_path
from train_helpers import ray_module

BUCKET_MB = 0.1  # 52,428 bf16 elements: the 131,072-element embedding spans three buckets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


def _cluster(transport: str):
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.train.data import EnvSpec

    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSpec("circle_count"), generation_dtype="bfloat16",
                      refit_transport=transport, refit_bucket_mb=BUCKET_MB, trainer={"precision": "fp32"})
    return PolicyCluster(spec, Placement(num_generation=1, num_training=1))


def _scramble_generator(cluster, version: int) -> None:
    """Give the generator other weights, so only a refit that delivers everything makes the hashes equal."""
    import ray

    weights = ray.get(cluster.trainers[0].weights.remote())
    ray.get(cluster.generators[0].restore.remote({k: v * 0.5 + version for k, v in weights.items()}, version))


def test_bucketed_collective_refits_give_the_generator_the_trainers_weights_exactly():
    cluster = _cluster("collective")
    try:
        for version in (1, 2):  # the first refit makes the layout; the second streams into buckets
            _scramble_generator(cluster, version)
            trainer, generators = cluster.weight_hashes()
            assert generators != [trainer]
            cluster.refit(version)
            trainer, generators = cluster.weight_hashes()
            assert generators == [trainer]
    finally:
        cluster.shutdown()
