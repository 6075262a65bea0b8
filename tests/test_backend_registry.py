"""The backend registries: built-ins, in-process registrations, import paths that resolve in Ray workers,
and a GRPO run through `gymv train` on a second generation backend and a second training backend."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gymv.backends.registry import GENERATION_BACKENDS, REFIT_TRANSPORTS, TRAINING_BACKENDS
from gymv.errors import GymvError
from gymv.registry import Registry


class Thing:
    pass


def test_builtins_load_by_name():
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.cluster.refit import ObjectStoreReceiver, ObjectStoreSender

    assert GENERATION_BACKENDS.load("hf") is HFGenerationBackend
    assert TRAINING_BACKENDS.load("torch") is HFTorchBackend
    assert REFIT_TRANSPORTS.load("object_store") is ObjectStoreSender
    assert ObjectStoreSender.receiver is ObjectStoreReceiver


def test_an_unknown_name_is_one_error_naming_the_key_and_the_choices():
    with pytest.raises(GymvError) as e:
        TRAINING_BACKENDS.load("deepspeed")
    assert e.value.where == "training.backend" and "torch" in e.value.fix


def test_a_registered_class_loads_here_and_locates_as_an_import_path_for_other_processes():
    r = Registry("widget", "gymv.test-widgets", {"builtin": "json:dumps"}, where="widget")
    r.register("mine", Thing)
    assert r.load("mine") is Thing
    assert r.locate("mine") == f"{__name__}:Thing"
    assert r.load(r.locate("mine")) is Thing
    assert r.available() == {"builtin": "builtin", "mine": "registered"}


def test_a_builtin_name_cannot_be_taken_over():
    r = Registry("widget", "gymv.test-widgets", {"builtin": "json:dumps"}, where="widget")
    with pytest.raises(GymvError, match="built in"):
        r.register("builtin", Thing)


def test_a_registered_backend_name_passes_the_schema_and_an_unknown_one_does_not():
    from gymv.config.schema import MODELS

    TRAINING_BACKENDS.register("thing", Thing)
    try:
        assert MODELS["grpo"].model_validate({"algorithm": "grpo", "training": {"backend": "thing"}}).training.backend == "thing"
    finally:
        TRAINING_BACKENDS.unregister("thing")
    with pytest.raises(ValueError, match="unknown training backend 'thing'; known: fsdp2, megatron, torch"):
        MODELS["grpo"].model_validate({"algorithm": "grpo", "training": {"backend": "thing"}})


@pytest.mark.slow
def test_grpo_runs_through_gymv_train_on_a_second_generation_and_training_backend(tmp_path):
    from gymv.train import train
    from tiny_models import tiny_path
    from train_helpers import PLUGIN_DIR, ray_module, tiny_grpo_settings, write_recipe

    model = tmp_path / "model"
    shutil.copytree(tiny_path("tiny-llava"), model)
    with ray_module():
        import sys

        assert str(PLUGIN_DIR) in sys.path
        from gymv_wrapped_backends import WrappedGeneration, WrappedTraining

        GENERATION_BACKENDS.register("wrapped-hf", WrappedGeneration)
        TRAINING_BACKENDS.register("wrapped-torch", WrappedTraining)
        try:
            settings = tiny_grpo_settings(tmp_path, model, **{"grpo.max_steps": 2, "generation.backend": "wrapped-hf",
                                                               "training.backend": "wrapped-torch"})
            summary = train(write_recipe(tmp_path, "grpo-wrapped", "vlm_grpo.yaml", settings))
        finally:
            GENERATION_BACKENDS.unregister("wrapped-hf")
            TRAINING_BACKENDS.unregister("wrapped-torch")
    assert summary["complete"] and summary["step"] == 2
    rows = [json.loads(x) for x in (tmp_path / "runs" / "grpo-wrapped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/wrapped_steps"] for r in rows] == [1.0, 2.0]  # the wrapped trainer took every step
    marks = {p.name.split(".")[1]: int(p.name.rsplit(".", 1)[1]) for p in tmp_path.glob("model.*-backend.*")}
    assert set(marks) == {"generation-backend", "training-backend"}
    assert os.getpid() not in marks.values()  # both were built in Ray workers, from the located import paths
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(summary["final_dir"])  # export went through the interface


def test_capabilities_are_read_by_name_or_by_the_located_path_a_worker_holds():
    declared = GENERATION_BACKENDS.capabilities("vllm")
    assert declared.reads_vllm_section and declared.needs.name == "vllm"
    assert GENERATION_BACKENDS.capabilities(GENERATION_BACKENDS.locate("vllm")) is declared
    r = Registry("widget", "gymv.test-widgets", {"builtin": ("json:dumps", "declared")}, where="widget", default="none")
    r.register("mine", Thing)
    assert r.capabilities("builtin") == "declared" and r.capabilities("mine") == "none"
    assert r.capabilities(r.locate("mine")) == "none"


def _folding() -> Registry:
    return Registry("widget", "gymv.test-widgets", {"built-in": "json:dumps"}, where="widget",
                    normalize=lambda n: n.strip().lower().replace("_", "-"), aliases={"Old_Name": "built-in"})


def test_a_registry_folds_names_its_own_way_and_an_alias_reaches_its_builtin():
    r = _folding()
    assert r.load("Built_In") is r.load("old-name") is json.dumps
    assert "OLD_NAME" in r and list(r.available()) == ["built-in"]


def test_an_alias_of_a_builtin_cannot_be_taken_over():
    with pytest.raises(GymvError, match="built in"):
        _folding().register("old_name", Thing)


def test_a_located_import_path_is_not_folded():
    r = _folding()
    r.register("mine", Thing)
    assert r.load(r.locate("MINE")) is Thing
