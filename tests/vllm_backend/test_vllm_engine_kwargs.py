"""`generation.vllm.engine_kwargs` (NeMo RL's `policy.generation.vllm_kwargs`) reach `vllm.LLM` as they are: the
Nemotron Omni reference runs' `mamba_ssm_cache_dtype: float32` shows in the config of the engine a generation
worker builds from the section. The arguments gymv sets for the model or device, and names vLLM's engine does
not have, are refused before an engine is built.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from gymv.backends.generation.vllm import VllmGenerationBackend  # noqa: E402
from gymv.cluster.workers import WorkerSpec  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from gymv.sections import EnvSection, GenerationSection, VllmSection  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from vllm_helpers import dense_omni_twin  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_omni_reference_runs_mamba_cache_dtype_reaches_the_engine_a_generation_worker_builds(tmp_path):
    """The worker's spec hands the engine generation.vllm itself, and full_logits where top_p < 1."""
    path = dense_omni_twin(tmp_path / "dense")
    generation = GenerationSection(backend="vllm", top_p=0.9, vllm=VllmSection(
        engine_kwargs={"mamba_ssm_cache_dtype": "float32", "max_num_seqs": 7}))
    spec = WorkerSpec(model_path=str(path), env=EnvSection(), generation=generation, generation_dtype="bfloat16")
    engine = spec.build_generation(device="cpu", seed=0)
    try:
        config = engine.llm.llm_engine.vllm_config
        assert config.cache_config.mamba_ssm_cache_dtype == "float32"  # vLLM's default: auto (the model's dtype)
        assert config.scheduler_config.max_num_seqs == 7
        assert engine.full_logits and engine.logprobs_mode == "raw_logits"
    finally:
        engine.close()


def test_an_argument_gymv_sets_on_a_cpu_is_refused_naming_what_sets_it():
    with pytest.raises(GymvError) as e:
        VllmGenerationBackend.create(str(tiny_path("tiny-llava")), seed=0,
                                     vllm=VllmSection(engine_kwargs={"enable_chunked_prefill": True}))
    assert e.value.where == "generation.vllm.engine_kwargs.enable_chunked_prefill"
    assert "on a CPU: whole prefills" in e.value.message and e.value.fix == "remove enable_chunked_prefill: gymv decides it"


def test_an_argument_vllms_engine_does_not_have_is_refused():
    with pytest.raises(GymvError) as e:
        VllmGenerationBackend.create(str(tiny_path("tiny-llava")), seed=0,
                                     vllm=VllmSection(engine_kwargs={"mamba_cache_dtyp": "float32"}))
    assert e.value.where == "generation.vllm.engine_kwargs.mamba_cache_dtyp" and "no argument" in e.value.message


def test_a_vllm_teachers_engine_kwargs_reach_its_engine_under_the_teachers_key():
    from gymv.backends.teacher_spec import TeacherSpec
    from gymv.backends.teacher_vllm import VllmTeacher
    from gymv.sections import TeacherSection

    llava = str(tiny_path("tiny-llava"))
    with pytest.raises(GymvError) as e:
        VllmTeacher(TeacherSpec("count", llava, llava, section=TeacherSection(
            path=llava, backend="vllm", engine_kwargs={"max_logprobs": 3})))
    assert e.value.where == "mopd.teachers.count.engine_kwargs.max_logprobs"
