"""Refit checks between real Ray actors with the real tiny LLaVA: over every transport this CPU runs, an engine
that loads nothing, half, or a wrong layout fails that refit with one line naming the tensors and the
transport, and a correct refit passes; the probe check catches the same faults; `gymv train` stops at the
step whose refit failed, synchronous and asynchronous."""

from __future__ import annotations

import json
import re

import pytest

from gymv.errors import GymvError
from refit_faults import FAULTY, FAULTY_PROBED, faulty_cluster, one_step, set_fault
from train_helpers import ray_module, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


@pytest.mark.parametrize("transport", ["object_store", "shm", "collective"])
def test_each_faulty_refit_stops_naming_the_tensors_and_the_transport(faulty_model, transport):
    import ray

    set_fault(faulty_model, "")
    cluster = faulty_cluster(faulty_model, transport)
    try:
        assert cluster.checks.kind == "digest"
        one_step(cluster)
        cluster.refit(1)  # a faithful engine passes
        messages = {}
        for version, fault in [(2, "nothing"), (3, "half"), (4, "layout")]:
            set_fault(faulty_model, fault)
            one_step(cluster)
            with pytest.raises(GymvError, match=rf"step {version}'s refit over {transport}: generation worker 0 does not "
                                                r"hold the trainer's weights: \d+ of \d+ tensors differ .*model\.") as e:
                cluster.refit(version)
            assert e.value.where == "refit.check" and e.value.exit_code == 1
            messages[fault] = e.value.message
        set_fault(faulty_model, "")
        cluster.refit(5)  # the engine takes every weight again: checked and passed
        # the half-loaded refit names only tensors it skipped (every other one, in name order)
        names = sorted(ray.get(cluster.trainers[0].weights.remote()))
        skipped = set(names[1::2])
        differ, total = map(int, re.search(r"(\d+) of (\d+) tensors differ", messages["half"]).groups())
        listed = re.search(r"tensors differ from what the trainer sent: (.*?)( and \d+ more)?$", messages["half"])
        assert total == len(names) and 0 < differ <= len(skipped)  # a skipped tensor the step left alone is equal
        assert set(listed.group(1).split(", ")) <= skipped
    finally:
        set_fault(faulty_model, "")
        cluster.shutdown()


def test_the_probe_check_catches_the_same_faults(faulty_model):
    set_fault(faulty_model, "")
    cluster = faulty_cluster(faulty_model, "object_store", FAULTY_PROBED)
    try:
        assert cluster.checks.kind == "probe"
        one_step(cluster)
        cluster.refit(1)
        for version, fault, said in [(2, "nothing", r"exactly as after step 1|[\d.]+ nats per token away"),
                                     (3, "layout", r"[\d.]+ nats per token away")]:
            set_fault(faulty_model, fault)
            one_step(cluster)
            with pytest.raises(GymvError, match=rf"step {version}'s refit over object_store: generation worker 0 scores the "
                                                rf"probe sequence ({said})"):
                cluster.refit(version)
        set_fault(faulty_model, "")
        cluster.refit(4)
    finally:
        set_fault(faulty_model, "")
        cluster.shutdown()


def test_an_engine_that_started_from_other_weights_is_stopped_before_the_first_step(faulty_model, tmp_path):
    """The engines' initial weights are refit 0: a generation backend that loaded another checkpoint than the
    trainer's fails the start, naming the tensors."""
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection, TrainingSection

    set_fault(faulty_model, "")
    spec = WorkerSpec(model_path=str(faulty_model), env=EnvSection(name="circle_count"), generation_dtype="bfloat16",
                      generation=GenerationSection(backend="starts-elsewhere"),
                      training=TrainingSection(backend="torch", dtype="float32"))
    with pytest.raises(GymvError, match=r"the engines' initial weights: generation worker 0 does not hold the trainer's weights: "
                                        r"1 of \d+ tensors differ from what the trainer sent: lm_head\.weight"):
        PolicyCluster(spec, Placement(num_generation=1, num_training=1))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_gymv_train_stops_at_the_step_whose_refit_loaded_nothing(faulty_model, tmp_path, asynchronous):
    from gymv.train import train

    set_fault(faulty_model, "nothing")
    try:
        settings = tiny_grpo_settings(tmp_path, faulty_model, **{"generation.backend": FAULTY})
        if asynchronous:
            settings.update({"grpo.async.enabled": True, "grpo.async.max_trajectory_age_steps": 1,
                             "grpo.importance_sampling.kind": "truncated"})
        with pytest.raises(GymvError) as e:
            train(write_recipe(tmp_path, "faulty", "vlm_grpo.yaml", settings))
        # the first step whose update changed a weight (a step whose groups all tie changes nothing)
        failed = re.match(r"step (\d)'s refit over object_store: generation worker 0 does not hold the trainer's "
                          r"weights: \d+ of \d+ tensors differ", e.value.message)
        assert failed and e.value.exit_code == 1, e.value.one_line()
        logged = [json.loads(x)["step"] for x in (tmp_path / "runs" / "faulty" / "metrics.jsonl").read_text().splitlines()]
        # synchronous: the step whose refit failed is not logged; asynchronous: no step trains on rollouts of the
        # failed refit's weights (the one taking them stops), though its own step, trained before, is logged
        last_logged = int(failed.group(1)) - (0 if asynchronous else 1)
        assert logged == list(range(1, last_logged + 1))
    finally:
        set_fault(faulty_model, "")
