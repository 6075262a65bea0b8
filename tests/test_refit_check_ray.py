"""Refit checks between real Ray actors with the real tiny LLaVA: over every transport this CPU runs, an engine
that loads nothing, half, or a wrong layout fails that refit with one line naming the tensors and the
transport, and a correct refit passes; the probe check catches the same faults; `gymv train` stops at the
step whose refit failed, synchronous and asynchronous."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from gymv.errors import GymvError
from tiny_models import tiny_path
from train_helpers import ray_module, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow

FAULTY = "faulty-refits"  # tests/train_plugin: entry points of the gymv.generation_backends group
FAULTY_PROBED = "faulty-refits-probed"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A copy of the tiny LLaVA of this module's own, so that its fault file concerns no other test."""
    return shutil.copytree(tiny_path("tiny-llava"), tmp_path_factory.mktemp("faulty") / "model")


def set_fault(model, fault: str) -> None:
    from gymv_faulty_refits import fault_file

    fault_file(model).write_text(fault)


def _cluster(model, transport: str, backend: str = FAULTY):
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection, RefitCheckSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(model), env=EnvSection(name="circle_count"), generation_dtype="bfloat16",
                      generation=GenerationSection(backend=backend),
                      refit=RefitSection(transport=transport, check=RefitCheckSection(first=100)),
                      training=TrainingSection(backend="torch", dtype="float32", lr=1e-3))
    return PolicyCluster(spec, Placement(num_generation=1, num_training=1))


def _step(cluster) -> None:
    """One SFT optimizer step, so that each refit sends weights the engine does not hold yet."""
    import random

    from gymv.algorithms.loss_fns import SFTLoss
    from gymv.envs.circle_count import TINY, CircleCount

    row = CircleCount().make_row(random.Random(0), TINY, 0)
    cluster.sft_step([(0, row, "row 0")], SFTLoss())


@pytest.mark.parametrize("transport", ["object_store", "shm", "collective"])
def test_each_faulty_refit_stops_naming_the_tensors_and_the_transport(model, transport):
    set_fault(model, "")
    cluster = _cluster(model, transport)
    try:
        assert cluster.checks.kind == "digest"
        _step(cluster)
        cluster.refit(1)  # a faithful engine passes
        for version, fault, said in [(2, "nothing", r"\d+ of \d+ tensors differ"), (3, "half", r"\d+ of \d+ tensors differ"),
                                     (4, "layout", r"\d+ of \d+ tensors differ")]:
            set_fault(model, fault)
            _step(cluster)
            with pytest.raises(GymvError, match=rf"step {version}'s refit over {transport}: generation worker 0 does not "
                                                rf"hold the trainer's weights: {said} .*model\.") as e:
                cluster.refit(version)
            assert e.value.where == "refit.check" and e.value.exit_code == 1
        set_fault(model, "")
        cluster.refit(5)  # the engine takes every weight again: checked and passed
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_the_half_loaded_refit_names_only_the_tensors_it_skipped(model):
    set_fault(model, "")
    cluster = _cluster(model, "object_store")
    try:
        _step(cluster)
        set_fault(model, "half")
        with pytest.raises(GymvError) as e:
            cluster.refit(1)
        import ray

        names = sorted(ray.get(cluster.trainers[0].weights.remote()))
        skipped = set(names[1::2])  # the fault loads every other tensor, in name order
        differ, total = map(int, re.search(r"(\d+) of (\d+) tensors differ", e.value.message).groups())
        listed = re.search(r"tensors differ from what the trainer sent: (.*?)( and \d+ more)?$", e.value.message)
        assert total == len(names) and 0 < differ <= len(skipped)  # a skipped tensor the step left alone is equal
        assert set(listed.group(1).split(", ")) <= skipped
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_the_probe_check_catches_the_same_faults(model):
    set_fault(model, "")
    cluster = _cluster(model, "object_store", FAULTY_PROBED)
    try:
        assert cluster.checks.kind == "probe"
        _step(cluster)
        cluster.refit(1)
        for version, fault, said in [(2, "nothing", r"exactly as after step 1|[\d.]+ nats per token away"),
                                     (3, "layout", r"[\d.]+ nats per token away")]:
            set_fault(model, fault)
            _step(cluster)
            with pytest.raises(GymvError, match=rf"step {version}'s refit over object_store: generation worker 0 scores the "
                                                rf"probe sequence ({said})"):
                cluster.refit(version)
        set_fault(model, "")
        cluster.refit(4)
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_an_engine_that_started_from_other_weights_is_stopped_before_the_first_step(model, tmp_path):
    """The engines' initial weights are refit 0: a generation backend that loaded another checkpoint than the
    trainer's fails the start, naming the tensors."""
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection, TrainingSection

    set_fault(model, "")
    spec = WorkerSpec(model_path=str(model), env=EnvSection(name="circle_count"), generation_dtype="bfloat16",
                      generation=GenerationSection(backend="starts-elsewhere"),
                      training=TrainingSection(backend="torch", dtype="float32"))
    with pytest.raises(GymvError, match=r"the engines' initial weights: generation worker 0 does not hold the trainer's weights: "
                                        r"1 of \d+ tensors differ from what the trainer sent: lm_head\.weight"):
        PolicyCluster(spec, Placement(num_generation=1, num_training=1))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_gymv_train_stops_at_the_step_whose_refit_loaded_nothing(model, tmp_path, asynchronous):
    from conftest import run_gymv
    from train_helpers import plugin_env

    set_fault(model, "nothing")
    try:
        settings = tiny_grpo_settings(tmp_path, model, **{"generation.backend": FAULTY})
        if asynchronous:
            settings.update({"grpo.async.max_trajectory_age_steps": 1, "grpo.importance_sampling.kind": "truncated"})
        recipe = write_recipe(tmp_path, "faulty", "vlm_grpo.yaml", settings)
        result = run_gymv("train", str(recipe), *(["--async"] if asynchronous else []), env=plugin_env(), timeout=600)
        assert result.code == 1, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        # the first step whose update changed a weight (a step whose groups all tie changes nothing)
        failed = re.search(r"step (\d)'s refit over object_store: generation worker 0 does not hold the trainer's "
                           r"weights: \d+ of \d+ tensors differ", last)
        assert failed, last
        assert "Traceback" not in result.stderr
        logged = [json.loads(x)["step"] for x in (tmp_path / "runs" / "faulty" / "metrics.jsonl").read_text().splitlines()]
        # synchronous: the step whose refit failed is not logged; asynchronous: no step trains on rollouts of the
        # failed refit's weights (the one taking them stops), though its own step, trained before, is logged
        last_logged = int(failed.group(1)) - (0 if asynchronous else 1)
        assert logged == list(range(1, last_logged + 1))
    finally:
        set_fault(model, "")
