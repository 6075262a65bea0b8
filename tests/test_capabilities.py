"""The capability table: what `gymv train` can run with what is installed, one place for train, lint and smoke."""

from __future__ import annotations

import pytest

from gymv.backends.registry import GENERATION_BACKENDS, TEACHER_BACKENDS, TRAINING_BACKENDS, BackendCapabilities, Package
from gymv.capabilities import NOT_WIRED, family_gaps, gaps, table
from gymv.config import validate_config
from gymv.config.schema import MODELS
from gymv.errors import GymvError


def cfg(**sections):
    return MODELS["vlm_grpo"].model_validate({"algorithm": "vlm_grpo", "vision": {}, **sections})


def keys(c) -> list[str]:
    return [g.key for g in gaps(c)]


def test_the_default_recipe_has_no_gaps():
    assert gaps(cfg()) == []


PLANNED = "the planned trainer is not wired into gymv train yet"


@pytest.fixture
def planned_trainer(monkeypatch):
    """A training backend the table names as planned (every built-in one is wired now)."""
    monkeypatch.setitem(NOT_WIRED, "training.backend", {"planned-trainer": PLANNED})
    return "planned-trainer"


def test_each_planned_value_is_a_gap_named_by_its_key(planned_trainer):
    c = cfg(training={"backend": planned_trainer}, vision={"dedup_payloads": False})
    assert keys(c) == ["training.backend", "vision.dedup_payloads"]


def test_the_megatron_training_backend_is_wired():
    assert gaps(cfg(training={"backend": "megatron"})) == []


def test_trust_remote_code_is_wired():
    assert gaps(cfg(model={"trust_remote_code": True})) == []


def test_tensorboard_and_wandb_are_wired():
    assert gaps(cfg(logger={"tensorboard": True, "wandb": True})) == []


def test_the_vllm_generation_backend_is_wired():
    assert gaps(cfg(generation={"backend": "vllm"})) == []


def test_vllm_teachers_are_wired():
    c = MODELS["vlm_mopd"].model_validate({"algorithm": "vlm_mopd", "vision": {},
                                            "mopd": {"teachers": {"a": {"path": "x", "backend": "vllm"}}}})
    assert gaps(c) == [] and table()["mopd.teachers.*.backend"]["vllm"] == "runs"


def test_vllm_settings_with_another_backend_are_a_gap_since_nothing_reads_them():
    assert keys(cfg(generation={"vllm": {"gpu_memory_utilization": 0.4}})) == ["generation.vllm"]


def test_a_registered_backend_wins_over_its_planned_row():
    class Engine:
        pass

    GENERATION_BACKENDS.register("vllm-test", Engine)
    try:
        assert gaps(cfg(generation={"backend": "vllm-test"})) == []
    finally:
        GENERATION_BACKENDS.unregister("vllm-test")


def test_the_table_lists_what_runs_and_why_the_rest_does_not():
    t = table()
    assert t["generation.backend"] == {"hf": "runs", "vllm": "runs"}
    assert t["training.backend"] == {"fsdp2": "runs", "megatron": "runs", "torch": "runs"}
    assert t["mopd.teachers.*.backend"]["megatron"] == "runs"
    assert t["logger.tensorboard"]["true"].startswith("runs")


def test_the_table_names_where_vllm_cannot_run_nemotron_and_why():
    from gymv.backends.generation.vllm_models import MOE_ON_CPU

    for key in ("generation.backend", "mopd.teachers.*.backend"):
        for family in ("nemotron_h", "nemotron_h_omni"):
            assert table()[f"{key} [{family}]"]["vllm on CPU, with mixture-of-experts layers"] == MOE_ON_CPU


def test_gymv_train_refuses_a_gap_at_the_line_that_wrote_it(tmp_path, planned_trainer):
    from gymv.train import train

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"algorithm: grpo\ntraining:\n  backend: {planned_trainer}\ncluster:\n  gpus_per_node: 1\n")
    with pytest.raises(GymvError) as e:
        train(recipe)
    assert e.value.where.endswith("r.yaml:3") and e.value.message == PLANNED


def test_gymv_train_names_the_megatron_extra_where_megatron_core_is_not_installed(tmp_path):
    from gymv.train import train

    if TRAINING_BACKENDS.capabilities("megatron").needs.installed():
        pytest.skip("megatron-core is installed in this Python")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\ntraining:\n  backend: megatron\n")
    with pytest.raises(GymvError) as e:
        train(recipe)
    assert e.value.where.endswith("r.yaml:3") and "megatron-core" in e.value.message
    assert "gymv[megatron]" in e.value.fix


def test_gymv_train_names_the_vllm_venv_where_vllm_is_not_installed(tmp_path):
    from gymv.train import train

    if GENERATION_BACKENDS.capabilities("vllm").needs.installed():
        pytest.skip("vLLM is installed in this Python")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\ngeneration:\n  backend: vllm\n")
    with pytest.raises(GymvError) as e:
        train(recipe)
    assert e.value.where.endswith("r.yaml:3") and "vllm" in e.value.message
    assert "bash scripts/install.sh vllm" in e.value.fix and "install_vllm.sh --path)/bin/gymv" in e.value.fix


def test_gymv_train_names_the_vllm_venv_for_a_vllm_teacher_where_vllm_is_not_installed(tmp_path):
    from gymv.train import train

    if GENERATION_BACKENDS.capabilities("vllm").needs.installed():
        pytest.skip("vLLM is installed in this Python")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: mopd\nmopd:\n  teachers:\n    a:\n      path: x\n      backend: vllm\n")
    with pytest.raises(GymvError) as e:
        train(recipe)
    assert e.value.where.endswith("r.yaml:6") and e.value.message.startswith("mopd.teachers.a.backend vllm needs")
    assert "bash scripts/install.sh vllm" in e.value.fix and e.value.fix.endswith("or use backend: torch")


def test_a_megatron_teacher_splits_over_tensor_and_expert_parallel_ranks():
    teacher = {"path": "x", "backend": "megatron", "placement": "separate", "gpus": 8, "tensor_parallel_size": 8}
    def mopd(t):
        return MODELS["mopd"].model_validate({"algorithm": "mopd", "mopd": {"teachers": {"a": t}},
                                              "cluster": {"gpus_per_node": 8}})

    assert gaps(mopd(teacher)) == []
    assert gaps(mopd({**teacher, "expert_parallel_size": 8})) == []  # the Super Omni teacher, TP 8 x EP 8


def test_megatron_tensor_parallel_is_wired_and_pipeline_parallel_is_a_gap():
    assert gaps(cfg(training={"backend": "megatron", "parallel": {"tensor": 2}}, cluster={"gpus_per_node": 2})) == []
    c = cfg(training={"backend": "megatron", "parallel": {"pipeline": 2}}, cluster={"gpus_per_node": 2})
    assert keys(c) == ["training.parallel.pipeline"]


class NoSuchEngine:
    """A plugin generation backend that declares the package it needs, which nobody installs."""

    capabilities = BackendCapabilities(needs=Package("gymv-no-such-engine", "gymv_no_such_engine",
                                                     "pip install gymv-no-such-engine"))


def train_refusal(tmp_path, name: str, engine: type) -> GymvError:
    """What `gymv train` says of a GRPO recipe generating with `engine`, registered as `name` meanwhile."""
    from gymv.train import train

    GENERATION_BACKENDS.register(name, engine)
    try:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"algorithm: grpo\ngeneration:\n  backend: {name}\n")
        with pytest.raises(GymvError) as e:
            train(recipe)
        assert e.value.where.endswith("r.yaml:3")
        return e.value
    finally:
        GENERATION_BACKENDS.unregister(name)


def test_a_backend_whose_declared_package_is_missing_is_refused_before_ray_with_its_declared_fix(tmp_path):
    e = train_refusal(tmp_path, "no-such-engine", NoSuchEngine)
    assert e.fix == "pip install gymv-no-such-engine"
    assert e.message.startswith("generation.backend no-such-engine needs the gymv-no-such-engine package")


class LlamaShyTrainer:
    """A plugin training backend that declares a model family it cannot train."""

    capabilities = BackendCapabilities(refused_families={"llama": "no llama twin here"})


def test_a_model_family_a_backend_declares_it_cannot_run_is_a_gap_naming_the_backends_that_can(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    TRAINING_BACKENDS.register("llama-shy", LlamaShyTrainer)
    try:
        [gap] = family_gaps(cfg(training={"backend": "llama-shy"}), tmp_path)
        assert gap.key == "training.backend" and gap.message == "training.backend llama-shy: no llama twin here"
        assert gap.fix == "use training.backend: fsdp2 or megatron or torch"
        assert family_gaps(cfg(), tmp_path) == []
    finally:
        TRAINING_BACKENDS.unregister("llama-shy")


def test_a_plugin_backend_that_declares_nothing_gets_the_defaults():
    GENERATION_BACKENDS.register("plain-engine", type("PlainEngine", (), {}))
    try:
        assert GENERATION_BACKENDS.capabilities("plain-engine") == BackendCapabilities()
        assert keys(cfg(generation={"backend": "plain-engine", "vllm": {"tensor_parallel_size": 2}})) == ["generation.vllm"]
    finally:
        GENERATION_BACKENDS.unregister("plain-engine")


def test_a_registered_teacher_backend_is_a_valid_teacher_and_an_unknown_one_is_refused_naming_the_choices():
    def mopd(backend):
        return {"algorithm": "mopd", "mopd": {"teachers": {"a": {"path": "x", "backend": backend}}}}

    TEACHER_BACKENDS.register("scorer-plugin", type("Scorer", (), {}))
    try:
        assert validate_config(mopd("scorer-plugin")).mopd.teachers["a"].backend == "scorer-plugin"
    finally:
        TEACHER_BACKENDS.unregister("scorer-plugin")
    with pytest.raises(GymvError) as e:
        validate_config(mopd("scorer-plugin"))
    assert e.value.message == "`mopd.teachers.a.backend`: 'scorer-plugin' is not one of 'megatron', 'torch', 'vllm'"


def refuse_every_checkpoint(path, device, dtype, *, text_only=False):
    return f"this engine runs no {device} checkpoint", "use generation.backend: hf"


class PickyEngine:
    """A plugin generation backend that declares which checkpoints it cannot run."""

    capabilities = BackendCapabilities(model_check=f"{__name__}:refuse_every_checkpoint")


def test_a_checkpoint_a_backend_declares_it_cannot_run_is_refused_before_the_run_directory(tmp_path):
    e = train_refusal(tmp_path, "picky-engine", PickyEngine)
    assert e.fix == "use generation.backend: hf" and e.message.endswith("this engine runs no cpu checkpoint")
    assert e.message.startswith("generation.backend picky-engine cannot run ")
