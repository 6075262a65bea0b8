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


def _cluster(transport: str, *, ranks: int = 1, generators: int = 1, backend: str = "torch"):
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle_count"),
                      generation_dtype="bfloat16", refit=RefitSection(transport=transport, bucket_mb=BUCKET_MB),
                      training=TrainingSection(backend=backend, dtype="float32", weight_decay=0.01))
    return PolicyCluster(spec, Placement(num_generation=generators, num_training=ranks))


def _scramble_generator(cluster, version: int) -> None:
    """Give the generator other weights, so only a refit that delivers everything makes the hashes equal."""
    import ray

    weights = ray.get([cluster.trainers[0].weights.remote()] + cluster._followers())[0]  # a sharded trainer gathers
    ray.get([g.restore.remote({k: v * 0.5 + version for k, v in weights.items()}, version) for g in cluster.generators])


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


def test_two_sharded_ranks_each_broadcast_their_share_and_both_generators_get_the_weights_exactly():
    cluster = _cluster("collective", ranks=2, generators=2, backend="fsdp2")
    try:
        assert cluster._senders == cluster.trainers  # every rank sends: a group of its own with the receivers
        for version in (1, 2):
            _scramble_generator(cluster, version)
            cluster.refit(version)
            trainer, generators = cluster.weight_hashes()
            assert generators == [trainer, trainer]
    finally:
        cluster.shutdown()
