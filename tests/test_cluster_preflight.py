"""The resource pre-flight and the role plans it checks: a request the machine or the cluster cannot meet
stops the launch with what was asked and what is there; a layout Ray can place passes."""

from __future__ import annotations

import re

import pytest

from gymv.cluster.placement import Pin, Placement, TrainerMesh
from gymv.cluster.preflight import Node, check, label_matches, machine_node
from gymv.cluster.roles import policy_plans, run_plans
from gymv.config.schema import MODELS
from gymv.errors import GymvError


def cfg(algorithm="grpo", **sections):
    data = {"algorithm": algorithm, **sections}
    if algorithm == "mopd":
        data.setdefault("mopd", {"teachers": {"t": {"path": "embedded:tiny-llava"}}})
    return MODELS[algorithm].model_validate(data)


def node(i: int, cpus: float, gpus: float = 0, **labels) -> Node:
    return Node(f"{i:02d}" * 20, f"10.0.0.{i}", {"CPU": cpus, "GPU": gpus}, {"gymv-node": str(i), **labels})


def run_check(c, nodes, cluster="the Ray cluster at 10.0.0.0:6379"):
    return check(c, run_plans(c), nodes, cluster=cluster, where=lambda key: key, recipe="r.yaml")


def test_a_gpu_recipe_on_a_machine_without_gpus_names_the_gpus_and_offers_smoke_tiny():
    c = cfg(cluster={"gpus_per_node": 2})
    with pytest.raises(GymvError) as e:
        run_check(c, [machine_node(2, 0)], cluster="this machine")
    assert "asks for 1 node x 2 GPUs and this machine has 2 CPUs and no GPU" in e.value.message
    assert e.value.where == "cluster.gpus_per_node" and "gymv smoke --tiny r.yaml" in e.value.fix


def test_more_nodes_than_the_cluster_has_is_refused_with_the_nodes_it_has():
    with pytest.raises(GymvError, match=r"asks for 3 nodes \(cluster.num_nodes\) and the Ray cluster .* has 2 nodes"):
        run_check(cfg(cluster={"num_nodes": 3, "gpus_per_node": 8}), [node(0, 16, 8), node(1, 16, 8)])


def test_cpu_training_ranks_beyond_the_clusters_cpus_fail_instead_of_waiting():
    c = cfg(cluster={"num_nodes": 2, "cpu_training_ranks": 8})
    with pytest.raises(GymvError, match=r"training \(8 bundles of \{CPU: 1\}, SPREAD\) needs 8 CPU in all") as e:
        run_check(c, [node(0, 2), node(1, 2)])
    assert e.value.where == "cluster.cpu_training_ranks"


def test_a_role_pinned_to_a_label_no_node_carries_is_refused():
    c = cfg(cluster={"gpus_per_node": 8, "colocated": False, "generation_gpus": 4, "training_gpus": 4,
                     "placement": {"generation": {"labels": {"gymv-node": "in(5)"}}}})
    with pytest.raises(GymvError, match="no node carries label gymv-node=in\\(5\\)") as e:
        run_check(c, [node(0, 16, 8)])
    assert e.value.where == "cluster.placement.generation"


def test_a_tensor_parallel_engine_needs_one_node_with_all_of_its_gpus():
    c = cfg(cluster={"num_nodes": 2, "gpus_per_node": 4, "colocated": False, "generation_gpus": 8, "training_gpus": 0},
            generation={"backend": "vllm", "vllm": {"tensor_parallel_size": 8}})
    with pytest.raises(GymvError, match=r"no node holds a bundle of 8 GPU"):
        run_check(c, [node(0, 16, 4), node(1, 16, 4)])


def test_strict_pack_must_fit_on_one_node():
    c = cfg(cluster={"num_nodes": 2, "gpus_per_node": 8, "colocated": False, "generation_gpus": 12,
                     "training_gpus": 4, "placement": {"generation": {"strategy": "STRICT_PACK"}}})
    with pytest.raises(GymvError, match="STRICT_PACK needs every bundle on one node"):
        run_check(c, [node(0, 32, 8), node(1, 32, 8)])


def test_the_four_node_mopd_layout_of_docs_cluster_md_passes():
    teachers = {a: {"path": "embedded:tiny-llava", "placement": "separate", "gpus": 8, "data_parallel_size": 2,
                    "backend": "vllm"} for a in ("counting", "clicking")}
    c = cfg("mopd", mopd={"teachers": teachers},
            generation={"backend": "vllm", "vllm": {"tensor_parallel_size": 2}},
            training={"backend": "megatron", "parallel": {"tensor": 2}},
            cluster={"num_nodes": 4, "gpus_per_node": 8, "colocated": False, "generation_gpus": 8, "training_gpus": 8,
                     "placement": {"generation": {"labels": {"gymv-node": "0"}},
                                   "training": {"labels": {"gymv-node": "1"}},
                                   "teachers": {"labels": {"gymv-node": "in(2,3)"}}}})
    got = run_check(c, [node(i, 64, 8) for i in range(4)])
    assert dict(got.asks) == {"generation": "4 bundles of {GPU: 2, CPU: 1}, PACK",
                              "training": "4 bundles of {GPU: 2, CPU: 2}, PACK",
                              "teacher counting": "2 bundles of {GPU: 4, CPU: 1}, PACK",
                              "teacher clicking": "2 bundles of {GPU: 4, CPU: 1}, PACK"}
    with pytest.raises(GymvError, match="training .* no node carries label gymv-node=1"):
        run_check(c, [node(i, 64, 8) for i in (0, 2, 3, 4)])  # the training node is missing


def test_roles_together_may_not_ask_for_more_than_the_cluster_has():
    teachers = {"t": {"path": "embedded:tiny-llava", "placement": "separate", "gpus": 4}}
    c = cfg("mopd", mopd={"teachers": teachers}, cluster={"gpus_per_node": 8})  # 8 colocated + 4 for the teacher
    with pytest.raises(GymvError, match="together ask for 12 GPU"):
        run_check(c, [node(0, 64, 8)])


@pytest.mark.parametrize(("selector", "value", "ok"), [
    ("a", "a", True), ("a", "b", False), ("a", None, False), ("!a", "b", True), ("!a", None, True),
    ("in(1,2)", "2", True), ("in(1,2)", "3", False), ("!in(1, 2)", "3", True), ("!in(1,2)", "1", False)])
def test_label_selectors_read_as_ray_reads_them(selector, value, ok):
    assert label_matches(selector, value) is ok


def test_separate_gpus_give_each_tensor_parallel_group_one_bundle():
    p = Placement(num_generation=2, num_training=4, gpus=8, colocated=False, generation_tp=2,
                  mesh=TrainerMesh(tensor=2, data=2))
    gen, train = policy_plans(p)
    assert gen.bundles == ({"GPU": 2.0, "CPU": 1.0},) * 2 and [s.gpus for s in gen.workers["generation"]] == [2, 2]
    assert train.bundles == ({"GPU": 2.0, "CPU": 2.0},) * 2
    assert [(s.bundle, s.gpus) for s in train.workers["training"]] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_a_pinned_cpu_role_asks_for_its_labels_and_resources_on_each_worker():
    from gymv.cluster.ray_placement import actor_options

    p = Placement(generation_pin=Pin(labels=(("gymv-node", "1"),), resources=(("gen", 0.5),)))
    gen = policy_plans(p)[0]
    opts = actor_options(gen, gen.workers["generation"][0], None)
    assert opts == {"num_cpus": 0, "label_selector": {"gymv-node": "1"}, "resources": {"gen": 0.5}}



def test_gymv_train_of_a_gpu_recipe_on_this_cpu_machine_stops_before_ray_and_writes_nothing(tmp_path):
    import torch

    from gymv.train import train
    from gymv.train.launch import ray_running
    from train_helpers import REPO

    if torch.cuda.is_available() or ray_running():
        pytest.skip("needs a machine without GPUs and no Ray session in this process")
    recipe = REPO / "recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n2g-fsdp2.yaml"
    with pytest.raises(GymvError, match="asks for 1 node x 2 GPUs and this machine has .* no GPU") as e:
        train(recipe, [f"checkpoint.dir={tmp_path / 'runs'}"])
    assert re.search(r"`gymv smoke --tiny \S*1n2g-fsdp2\.yaml`", e.value.fix) and e.value.where.endswith("1n2g-fsdp2.yaml:27")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("labels", [{"gymv-node": "in(1,2"}, {"gymv-node": "a b"}, {"bad key!": "1"}])
def test_a_label_selector_ray_would_refuse_is_refused_when_the_recipe_loads(labels):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="label"):
        cfg(cluster={"placement": {"training": {"labels": labels}}})
    cfg(cluster={"placement": {"training": {"labels": {"example.com/zone": "!in(a, b)", "gymv-node": "0"}}}})
