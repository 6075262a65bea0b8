"""What `gymv train` asks of a vLLM engine: the recipe's generation.vllm section itself, and every logit back
where top_p < 1 (so that logprobs keep the trainer's definition, taken before the nucleus cut); engine_kwargs
(NeMo RL's vllm_kwargs) as written, except the engine arguments gymv sets itself."""

from __future__ import annotations

import pytest

from conftest import REPO
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.registry import GENERATION_BACKENDS, BackendCapabilities
from gymv.capabilities import gaps
from gymv.cluster.workers import WorkerSpec
from gymv.config import load_config, load_recipe
from gymv.config.lint import lint_paths
from gymv.config.schema import MODELS
from gymv.errors import GymvError
from gymv.sections import VllmSection
from tiny_models import tiny_path


class SectionReader(HFGenerationBackend):
    """A plugin generation backend whose registry entry declares that it reads generation.vllm (as the vllm
    backend's does): the HF engine, keeping what its create() was handed."""

    @classmethod
    def create(cls, model_path: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
               vllm: VllmSection, full_logits: bool) -> SectionReader:
        backend = super().create(model_path, device=device, dtype=dtype, seed=seed)
        backend.vllm, backend.full_logits = vllm, full_logits
        return backend


@pytest.fixture(scope="module")
def section_reader():
    GENERATION_BACKENDS.register("section-reader", SectionReader,
                                 capabilities=BackendCapabilities(reads_vllm_section=True))
    yield "section-reader"
    GENERATION_BACKENDS.unregister("section-reader")


def built(**generation):
    """(the generation section of a recipe, the backend a generation worker builds from it)."""
    cfg = MODELS["vlm_grpo"].model_validate({"algorithm": "vlm_grpo", "vision": {}, "generation": generation})
    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=cfg.env, generation=cfg.generation)
    return cfg.generation, spec.build_generation(device="cpu", seed=0)


@pytest.mark.parametrize("top_p, full_logits", [(0.9, True), (1.0, False)])
def test_a_backend_reading_generation_vllm_gets_the_section_itself_and_full_logits_below_top_p_one(
        section_reader, top_p, full_logits):
    vllm = {"gpu_memory_utilization": 0.4, "engine_kwargs": {"mamba_ssm_cache_dtype": "float32"}}
    generation, backend = built(backend=section_reader, top_p=top_p, vllm=vllm)
    assert backend.vllm is generation.vllm  # the typed section as the recipe gave it, engine_kwargs as written
    assert backend.full_logits is full_logits


def test_an_hf_engine_is_built_without_vllm_keywords():
    _, backend = built(backend="hf")  # HFGenerationBackend.create takes no vllm or full_logits keyword
    assert type(backend) is HFGenerationBackend


# ---- generation.vllm.engine_kwargs: NeMo RL's vllm_kwargs ---------------------------------------------------

def recipe(tmp_path, body: str, parent: str = "grpo.yaml"):
    path = tmp_path / "r.yaml"
    path.write_text(f"defaults: {REPO / 'recipes' / parent}\n{body}")
    return path


def test_engine_kwargs_must_be_a_mapping():
    with pytest.raises(GymvError, match="generation.vllm.engine_kwargs"):
        load_config(REPO / "recipes" / "grpo.yaml", ["generation.vllm.engine_kwargs=[mamba_ssm_cache_dtype]"])


def test_an_engine_argument_gymv_sets_is_refused_at_its_line_naming_the_key_that_sets_it(tmp_path):
    path = recipe(tmp_path, "generation:\n  vllm:\n    engine_kwargs:\n      mamba_ssm_cache_dtype: float32\n"
                            "      tensor_parallel_size: 2\n")
    with pytest.raises(GymvError) as e:
        load_recipe(path)
    assert e.value.where.endswith("r.yaml:6") and "generation.vllm.engine_kwargs.tensor_parallel_size" in e.value.message
    assert e.value.fix == "set generation.vllm.tensor_parallel_size instead"


def test_an_engine_argument_only_gymv_decides_is_refused_with_what_it_is():
    with pytest.raises(GymvError) as e:
        load_config(REPO / "recipes" / "grpo.yaml", ["generation.vllm.engine_kwargs={worker_extension_cls: x.Y}"])
    assert "weight-sync worker extension" in e.value.message and e.value.fix == "remove worker_extension_cls: gymv decides it"


def test_a_teachers_engine_kwargs_are_refused_with_the_teachers_own_key(tmp_path):
    path = recipe(tmp_path, "mopd:\n  teachers:\n    teacher:\n      backend: vllm\n      engine_kwargs: {model: /x}\n",
                  "mopd.yaml")
    with pytest.raises(GymvError) as e:
        load_recipe(path)
    assert e.value.fix == "set mopd.teachers.teacher.path instead"


def test_engine_kwargs_on_a_teacher_backend_that_reads_none_is_a_gap():
    cfg = MODELS["mopd"].model_validate({"algorithm": "mopd", "mopd": {"teachers": {"t": {
        "path": "embedded:tiny-llava", "engine_kwargs": {"max_num_seqs": 4}}}}})
    assert [g.key for g in gaps(cfg)] == ["mopd.teachers.t.engine_kwargs"]


def test_nemo_rls_vllm_kwargs_are_named_as_gymvs_engine_kwargs_at_their_key(tmp_path):
    path = recipe(tmp_path, "policy:\n  generation:\n    vllm_kwargs:\n      mamba_ssm_cache_dtype: float32\n"
                            "      max_num_batched_tokens: 16384\n")
    found = [f for f in lint_paths([str(path)]).findings if "vllm_kwargs" in f.message]
    assert len(found) == 1 and found[0].line == 4
    assert "gymv's is `generation.vllm.engine_kwargs`" in found[0].fix


def test_a_prompt_vllm_expanded_differently_is_refused_naming_the_row_and_both_lengths():
    from gymv.backends.generation.vllm import check_expansion

    check_expansion([1, 7, 7, 2], (1, 7, 7, 2), where="row 3", fix="use hf")  # the same ids pass
    with pytest.raises(GymvError) as e:
        check_expansion([1, 7, 7, 7, 2], [1, 7, 7, 2], where="row 3", fix="use hf")
    assert e.value.where == "row 3" and "5 prompt ids, gymv has 4" in e.value.message
