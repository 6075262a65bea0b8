"""Two Ray nodes on this machine, shared by every test here: a head and a second node process, one CPU each,
both on 127.0.0.1, labelled `gymv-node` 0 and 1 (as `gymv cluster` labels an allocation's nodes), and with
Ray's token authentication on. The driver joins them by address, as `gymv train --ray-address` does."""

from __future__ import annotations

import json
import os
import random
import secrets

import pytest

from gymv.errors import GymvError
from gymv.train import Reporter, train
from tiny_models import tiny_path
from train_helpers import REPO, plugin_on_path, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow

TOKEN = secrets.token_hex(16)


@pytest.fixture(scope="module")
def nodes():
    import ray
    from ray.cluster_utils import Cluster

    from gymv.cluster.ray_cluster import LOOPBACK, loopback_only, start_ray, stop_ray

    from ray._private.authentication_test_utils import reset_auth_token_state

    if ray.is_initialized():  # this module's driver joins its own two nodes, not a session's local cluster
        stop_ray()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)  # the nodes' processes inherit it
    reset_auth_token_state()  # and this process reads it again
    loopback_only(ray)
    local = {"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False}
    with plugin_on_path():
        # the head notices a lost node within seconds (Ray's default: about half a minute of missed checks)
        quick = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 2}
        cluster = Cluster(initialize_head=True,
                          head_node_args={**local, "labels": {"gymv-node": "0"}, "_system_config": quick})
        try:
            cluster.add_node(**local, labels={"gymv-node": "1"})
            start_ray(cluster.address)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            stop_ray()
            cluster.shutdown()
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            reset_auth_token_state()


class Listener(Reporter):
    def __init__(self):
        self.messages: list[str] = []

    def on_message(self, text):
        self.messages.append(text)


def _run(tmp_path, name: str, reporter=None, **settings):
    base = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"grpo.max_steps": 2, "cluster.num_nodes": 2})
    recipe = write_recipe(tmp_path, name, "vlm_grpo.yaml", {**base, **settings})
    return train(recipe, reporter=reporter), tmp_path / "runs" / name


PINNED = {"cluster.placement.generation.labels": {"gymv-node": "1"},
          "cluster.placement.training.labels": {"gymv-node": "0"}}


def _labels_of(nodes_: list[dict]) -> dict[str, str]:
    return {n["node_id"]: n["labels"].get("gymv-node") for n in nodes_}


def test_pinned_roles_land_on_their_labelled_nodes_and_auto_refits_through_the_object_store(nodes, tmp_path):
    said = Listener()
    summary, run = _run(tmp_path, "pinned", reporter=said, **PINNED, **{"refit.transport": "auto", "grpo.max_steps": 1})
    placed = json.loads((run / "placement.json").read_text())
    label = _labels_of(placed["nodes"])
    assert [label[w["node_id"]] for w in placed["roles"]["generation"]["workers"]] == ["1"]
    assert [label[w["node_id"]] for w in placed["roles"]["training"]["workers"]] == ["0"]
    assert placed["refit_transport"] == "object_store"  # the two roles sit on different nodes
    assert any(m.startswith("placement: generation") for m in said.messages)
    assert summary["complete"]


def test_shared_memory_refits_across_the_two_nodes_are_refused_naming_both(nodes, tmp_path):
    with pytest.raises(GymvError, match=r"'shm' works within one host, but training rank 0 is on node 127\.0\.0\.1 "
                                        r"\(\w{8}\) and generation worker 0 on node 127\.0\.0\.1 \(\w{8}\)"):
        # the recipe says one node, so only where the workers really landed shows the two
        _run(tmp_path, "shm", **PINNED, **{"refit.transport": "shm", "cluster.num_nodes": 1})


def test_more_cpu_ranks_than_the_cluster_has_cpus_fail_before_any_worker_starts(nodes, tmp_path):
    with pytest.raises(GymvError, match=r"training \(8 bundles of \{CPU: 1\}, SPREAD\) needs 8 CPU in all; the Ray "
                                        r"cluster at 127\.0\.0\.1:\d+ has 2 nodes") as e:
        _run(tmp_path, "too-many", **{"training.backend": "fsdp2", "cluster.cpu_training_ranks": 8})
    assert "too-many.yaml" in e.value.where  # the line that set cluster.cpu_training_ranks


def test_a_placement_ray_cannot_meet_now_stops_at_its_deadline(nodes, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": 1}] * 2, strategy="SPREAD")  # another job holds both CPUs
    ray.get(held.ready(), timeout=60)
    try:
        with pytest.raises(GymvError, match=r"Ray could not place training \(2 bundles of \{CPU: 1\}, SPREAD\) within 2 s"):
            _run(tmp_path, "held", **{"training.backend": "fsdp2", "cluster.cpu_training_ranks": 2,
                                      "cluster.placement_timeout_s": 2})
    finally:
        remove_placement_group(held)


class LoseNode(Reporter):
    """At one refit, the node of the training rank goes away and the scheduler brings a replacement with the
    same label (Ray's own test cluster stands in for the scheduler)."""

    def __init__(self, cluster, node, at: int):
        self.cluster, self.node, self.at = cluster, node, at
        self.messages: list[str] = []

    def on_refit(self, step, cluster):
        if step == self.at and self.node is not None:
            self.cluster.remove_node(self.node, allow_graceful=False)
            self.node = None
            self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False,
                                  labels={"gymv-node": "2"})

    def on_message(self, text):
        self.messages.append(text)


def test_a_lost_node_is_named_and_the_run_resumes_from_its_newest_checkpoint(nodes, tmp_path):
    third = nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False, labels={"gymv-node": "2"})
    nodes.wait_for_nodes()
    lose = LoseNode(nodes, third, at=2)
    summary, run = _run(tmp_path, "lost", reporter=lose, **{"grpo.max_steps": 2, "cluster.max_restarts": 1,
                                                             "cluster.placement.training.labels": {"gymv-node": "2"}})
    restart = next(m for m in lose.messages if m.startswith("restart 1/1"))
    assert "training rank 0 on node 127.0.0.1" in restart and "was lost" in restart, restart
    assert "newest complete checkpoint is" in restart and "step_1" in restart
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["complete"] and steps == [1, 2]  # step 2 was lost before its checkpoint: run again


def test_joining_without_the_clusters_token_names_the_cause_and_the_fix(nodes, tmp_path, monkeypatch):
    from conftest import run_gymv  # a process of its own, as a user's gymv joining the cluster

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key)  # the subprocess inherits this process's environment
    r = run_gymv("train", REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", "grpo.max_steps=1", "--ray-address",
             nodes.address, env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert r.code == 2 and "requires token authentication and no token was given" in r.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run directory was written
    assert "RAY_AUTH_TOKEN" in r.stderr and "Traceback" not in r.stderr


def _spec(backend: str, **extra):
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, TrainingSection

    return WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle_count"),
                      training=TrainingSection(backend=backend, lr=1e-3, eps=1e-3, weight_decay=0.01, dtype="float32"),
                      **extra)


def _samples():
    from gymv.backends.generation import SamplingParams
    from gymv.cluster.workers import GenerationWorker, RolloutRequest
    from gymv.train.stats import policy_samples

    gen = GenerationWorker(_spec("torch"))
    env = gen.router.default
    rows = [(i, env.make_row(random.Random(i), env.presets["tiny"], i)) for i in range(2)]
    out = gen.rollouts(rows, RolloutRequest(group_size=2, params=SamplingParams(max_new_tokens=8), seed=5))
    return policy_samples(out["trajectories"], [1.0, -1.0, 0.5, -0.5])


def test_fsdp2_ranks_on_two_nodes_take_one_ranks_step_and_each_sends_its_share_of_the_refit(nodes):
    import ray
    from ray.util import placement_group_table

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import TrainingWorker
    from gymv.config.schema import RefitSection

    samples = _samples()
    single = TrainingWorker(_spec("torch"))
    single.setup()
    one = single.grpo_step([[dict(s) for s in samples]], PolicyLoss())

    spec = _spec("fsdp2", refit=RefitSection(bucket_mb=0.5))  # several buckets, shared between the two ranks
    cluster = PolicyCluster(spec, Placement(num_generation=1, num_training=2, nodes=2))
    try:
        on = placement_group_table(cluster._pgs["training"])["bundles_to_node_id"]
        two = cluster.grpo_step([samples], PolicyLoss())
        cluster.refit(1)  # connects the transport; the next publish is inspected
        parts, followers = cluster._publish()
        shares = ray.get(parts + followers)[:len(parts)]
        ray.get(cluster.generators[0].receive.remote(parts[0], 2, *parts[1:]))
        trainer_hash, generator_hashes = cluster.weight_hashes()
    finally:
        cluster.shutdown()
    assert len(set(on.values())) == 2  # one rank per node
    assert two["train/num_sequences"] == one["train/num_sequences"] == 4
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    owned = [set(s["owned"]) for s in shares]
    assert len(shares) == 2 and all(owned) and not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(range(len(shares[0]["spans"])))
    assert generator_hashes == [trainer_hash]
