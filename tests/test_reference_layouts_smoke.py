"""`gymv smoke --tiny` of the reference layouts' recipes: the Nano Omni GRPO run and the Super Omni MOPD smoke
run on the CPU as the tiny Omni in Megatron, keeping what of their layout a CPU runs at tiny size (the
student's tensor and context parallelism at 2 over four gloo ranks, its expert parallelism at 4 folded over
those ranks, the Megatron teacher's replica of two ranks with its experts split over them) and naming the rest."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_gymv

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

GRPO = REPO / "recipes/vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-megatron-tp2ep8cp2.yaml"
SMOKE = REPO / "recipes/vlm/vlm_mopd-nemotron3-super-omni-4n8g-megatron-tp8ep16cp2-async-noncolocated-smoke.yaml"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    r = run_gymv("smoke", GRPO, SMOKE, "--tiny", "--steps", "2", "--out", out, "--json", cwd=REPO, timeout=1200)
    return r, {res["recipe"].rsplit("/", 1)[-1]: res for res in json.loads(r.stdout)["results"]}


def test_both_layouts_pass_their_smoke_on_the_cpu_in_megatron(results):
    r, by_name = results
    assert r.code == 0
    for res in by_name.values():
        assert res["status"] == "PASS" and res["steps"] == 2, res
        assert not any(c.startswith("training.backend") for c in res["tiny_changes"])  # megatron itself


def test_the_student_keeps_tensor_parallel_2_and_the_teacher_a_replica_of_2_ranks_of_tp2_x_ep2(results):
    from gymv.backends.registry import TRAINING_BACKENDS

    _, by_name = results
    ranks = 2 * (2 if "context" in TRAINING_BACKENDS.capabilities("megatron").model_parallel else 1)  # TP x CP
    changes = by_name[SMOKE.name]["tiny_changes"]
    assert "training.parallel.tensor: 8 -> 2" in changes and f"cluster.cpu_training_ranks: 1 -> {ranks}" in changes
    assert "mopd.teachers.self.tensor_parallel_size: 8 -> 2" in changes
    assert "mopd.teachers.self.expert_parallel_size: 8 -> 2" in changes  # its experts split over its 2 ranks
    grpo = by_name[GRPO.name]["tiny_changes"]
    assert not any(c.startswith("training.parallel.tensor") for c in grpo)  # TP 2 is tiny already: kept
    assert f"cluster.cpu_training_ranks: 1 -> {ranks}" in grpo


def test_the_student_keeps_expert_parallel_4_folded_over_its_tensor_and_context_ranks(results):
    _, by_name = results  # experts whole (expert TP 1): one EP group of the four TP2 x CP2 ranks, an expert each
    assert "training.parallel.expert: 16 -> 4" in by_name[SMOKE.name]["tiny_changes"]
    assert "training.parallel.expert: 8 -> 4" in by_name[GRPO.name]["tiny_changes"]
