"""Two Ray nodes on this machine (a head and a second node process, each with one CPU): the two fsdp2
training ranks land on different nodes, rendezvous across them and take the step one plain rank takes."""

from __future__ import annotations

import random

import pytest

from tiny_models import tiny_path

pytestmark = pytest.mark.slow


def _spec(backend: str):
    from gymv.cluster.workers import WorkerSpec
    from gymv.train.data import EnvSpec

    return WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSpec("circle_count"),
                      trainer={"lr": 1e-3, "eps": 1e-3, "precision": "fp32"}, training_backend=backend)


def _samples():
    from gymv.backends.generation import SamplingParams
    from gymv.cluster.workers import GenerationWorker
    from gymv.train.stats import policy_samples

    gen = GenerationWorker(_spec("torch"))
    env = gen.router.default
    rows = [(i, env.make_row(random.Random(i), env.presets["tiny"], i)) for i in range(2)]
    out = gen.rollouts(rows, group_size=2, params=SamplingParams(max_new_tokens=8), seed=5, max_turns=1,
                       max_rollout_tokens=64, max_seq_len=1024)
    return policy_samples(out["trajectories"], [1.0, -1.0, 0.5, -0.5])


def test_fsdp2_ranks_on_two_ray_nodes_take_the_step_of_one_rank():
    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import TrainingWorker

    samples = _samples()
    single = TrainingWorker(_spec("torch"))
    single.setup()
    one = single.grpo_step([[dict(s) for s in samples]], PolicyLoss())

    from gymv.cluster.ray_cluster import LOOPBACK, loopback_only

    loopback_only(ray)  # both "nodes" listen on 127.0.0.1 only, as a local gymv cluster does
    local = {"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args=local)
    try:
        nodes.add_node(**local)
        ray.init(address=nodes.address)
        nodes.wait_for_nodes()
        cluster = PolicyCluster(_spec("fsdp2"), Placement(num_generation=0, num_training=2, nodes=2), generation=False)
        try:
            on = placement_group_table(cluster._pg)["bundles_to_node_id"]
            two = cluster.grpo_step([samples], PolicyLoss())
        finally:
            cluster.shutdown()
    finally:
        ray.shutdown()
        nodes.shutdown()
    assert len(set(on.values())) == 2  # one rank per node
    assert two["train/num_sequences"] == one["train/num_sequences"] == 4
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
