"""The three reference layouts as recipes (the Nano Omni GRPO run, the Super Omni MOPD run and its smoke, in
Megatron): their parallel layout is the reference's key by key, `gymv dry-run` gives the reference drivers'
GPU-hours, and the pre-flight placement check passes on a simulated cluster of their shape (and stops one
that is a node short)."""

from __future__ import annotations

import pytest

from gymv.cluster.preflight import Node, check
from gymv.cluster.roles import run_plans
from gymv.config import load_config
from gymv.errors import GymvError
from gymv.recipes.gpu_hours import plan
from conftest import REPO

RECIPES = REPO / "recipes"
GRPO = "vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-megatron-tp2ep8cp2"
MOPD = "vlm/vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated"
SMOKE = "vlm/vlm_mopd-nemotron3-super-omni-4n8g-megatron-tp8ep16cp2-async-noncolocated-smoke"


def recipe(name):
    return load_config(RECIPES / f"{name}.yaml")


def nodes(n: int) -> list[Node]:
    return [Node(f"{i:02d}" * 20, f"10.0.0.{i}", {"CPU": 64.0, "GPU": 8.0}, {"gymv-node": str(i)}) for i in range(n)]


def preflight(cfg, n: int):
    return check(cfg, run_plans(cfg), nodes(n), cluster="the Ray cluster at 10.0.0.0:6379", where=lambda k: k,
                 recipe="r.yaml")


def layout(cfg) -> dict:
    p, c = cfg.training.parallel, cfg.cluster
    out = {"nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node, "colocated": c.colocated,
           "generation_gpus": c.generation_gpus, "training_gpus": c.training_gpus, "training": cfg.training.backend,
           "tp": p.tensor, "ep": p.expert, "cp": p.context, "pp": p.pipeline,
           "generation": cfg.generation.backend, "generation_tp": cfg.generation.vllm.tensor_parallel_size}
    mopd = getattr(cfg, "mopd", None)
    if mopd is not None:
        out["async"] = (mopd.async_.enabled, mopd.async_.max_trajectory_age_steps, mopd.async_.in_flight_weight_updates)
        out["teachers"] = {a: (t.path == cfg.model.path, t.backend, t.tensor_parallel_size, t.expert_parallel_size,
                               t.placement, t.gpus) for a, t in mopd.teachers.items()}
    return out


def test_the_nano_omni_grpo_recipe_is_vllm_tp8_on_one_node_and_megatron_tp2_ep8_cp2_on_the_other():
    assert layout(recipe(GRPO)) == {
        "nodes": 2, "gpus_per_node": 8, "colocated": False, "generation_gpus": 8, "training_gpus": 8,
        "training": "megatron", "tp": 2, "ep": 8, "cp": 2, "pp": 1, "generation": "vllm", "generation_tp": 8}


def test_the_super_omni_mopd_recipe_is_one_generation_node_one_teacher_node_and_eight_policy_nodes():
    assert layout(recipe(MOPD)) == {
        "nodes": 10, "gpus_per_node": 8, "colocated": False, "generation_gpus": 8, "training_gpus": 64,
        "training": "megatron", "tp": 8, "ep": 16, "cp": 2, "pp": 1, "generation": "vllm", "generation_tp": 4,
        "async": (True, 1, False), "teachers": {"self": (True, "megatron", 8, 8, "separate", 8)}}


def test_its_smoke_keeps_the_layout_on_four_nodes_with_the_references_batch():
    cfg = recipe(SMOKE)
    assert layout(cfg) == {**layout(recipe(MOPD)), "nodes": 4, "training_gpus": 16}
    assert (cfg.mopd.prompts_per_step, cfg.mopd.generations_per_prompt, cfg.mopd.max_steps) == (2, 2, 3)
    assert (cfg.model.max_seq_len, cfg.generation.max_new_tokens) == (4096, 256)


@pytest.mark.parametrize("name, gpu_hours", [(GRPO, 32), (MOPD, 1120), (SMOKE, 256)])
def test_dry_run_gives_the_reference_drivers_gpu_hours(name, gpu_hours):
    run = plan([RECIPES / "drivers" / f"{name}.sh"], RECIPES)
    assert run.total_gpu_minutes == gpu_hours * 60
    assert run.warnings() == []


def test_the_smoke_driver_runs_the_mopd_drivers_steps_on_four_nodes_with_its_own_recipe():
    [d] = plan([RECIPES / "drivers" / f"{SMOKE}.sh"], RECIPES).groups[0].drivers
    assert [p.name for p in d.config.chain][-1] == f"{MOPD.split('/')[1]}.sh"
    assert (d.config.num_nodes, d.config.max_steps, d.config.num_minutes) == (4, 3, 480)
    assert d.config.extras["RECIPE"] == f"recipes/{SMOKE}.yaml"


@pytest.mark.parametrize("name, n, asks", [
    (GRPO, 2, {"generation": "1 bundle of {GPU: 8, CPU: 1}, PACK", "training": "4 bundles of {GPU: 2, CPU: 2}, PACK"}),
    (MOPD, 10, {"generation": "2 bundles of {GPU: 4, CPU: 1}, PACK", "training": "8 bundles of {GPU: 8, CPU: 8}, PACK",
                "teacher self": "1 bundle of {GPU: 8, CPU: 8}, PACK"}),
    (SMOKE, 4, {"generation": "2 bundles of {GPU: 4, CPU: 1}, PACK", "training": "2 bundles of {GPU: 8, CPU: 8}, PACK",
                "teacher self": "1 bundle of {GPU: 8, CPU: 8}, PACK"}),
])
def test_the_preflight_placement_check_passes_on_a_cluster_of_the_layouts_shape(name, n, asks):
    assert dict(preflight(recipe(name), n).asks) == asks


@pytest.mark.parametrize("name, n", [(GRPO, 2), (MOPD, 10), (SMOKE, 4)])
def test_a_cluster_a_node_short_is_refused_before_anything_starts(name, n):
    with pytest.raises(GymvError):
        preflight(recipe(name), n - 1)


def test_the_megatron_teachers_replica_is_eight_ranks_each_with_one_gpu_of_its_nodes_bundle():
    [plan] = [p for p in run_plans(recipe(MOPD)) if p.role == "teacher self"]
    assert [(s.bundle, s.gpus) for s in plan.workers["teacher"]] == [(0, 1.0)] * 8
