"""PolicyCluster.shutdown on a real local Ray with the real tiny LLaVA: afterwards the cluster holds no handle or
ref of its killed workers, so a cluster that stays reachable (a failed run's traceback keeps it, in a reference
cycle) leaves nothing of them to be released later by the cyclic collector, in whichever thread runs it."""

from __future__ import annotations

import pytest

from tiny_models import tiny_path
from train_helpers import ray_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


def ray_objects_held_by(root) -> list:
    """Every ActorHandle and ObjectRef reachable from `root` through its attributes and containers."""
    import ray

    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (ray.actor.ActorHandle, ray.ObjectRef)):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif obj is root or hasattr(obj, "__dataclass_fields__"):
            todo += list(vars(obj).values())
    return found


def test_a_shut_down_cluster_holds_no_handle_or_ref_of_its_workers():
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle_count"),
                      refit=RefitSection(transport="object_store"),
                      training=TrainingSection(dtype="float32"))
    cluster = PolicyCluster(spec, Placement(num_generation=1, num_training=1))
    try:
        cluster.refit(1)  # the refit's sending ranks and its check's refs are kept by the cluster
        assert ray_objects_held_by(cluster)
    finally:
        cluster.shutdown()
    assert ray_objects_held_by(cluster) == []


def test_two_gloo_training_ranks_close_together_and_leave_their_group_cleanly():
    """A rank's close waits at a barrier for its peers: closed one after another, the first would wait out the
    deadline for peers not yet asked (30 s a run) and be killed in the barrier."""
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle_count"),
                      refit=RefitSection(transport="object_store"),
                      training=TrainingSection(backend="fsdp2", dtype="float32"))
    cluster = PolicyCluster(spec, Placement(num_generation=1, num_training=2))
    assert cluster.shutdown() == []
