"""What `gymv train` asks of a vLLM engine: the recipe's generation.vllm keywords, and every logit back where
top_p < 1 (so that logprobs keep the trainer's definition, taken before the nucleus cut)."""

from __future__ import annotations

from gymv.cluster.workers import WorkerSpec
from gymv.config.schema import MODELS


def options(**generation) -> dict:
    cfg = MODELS["vlm_grpo"].model_validate({"algorithm": "vlm_grpo", "vision": {},
                                             "generation": {"backend": "vllm", **generation}})
    return WorkerSpec(model_path="unused", env=cfg.env, generation=cfg.generation).generation_options()


def test_top_p_below_one_asks_the_engine_for_full_logits():
    assert options(top_p=0.9)["full_logits"] is True


def test_top_p_one_keeps_vllms_own_logprobs_and_the_recipes_keywords():
    opts = options(vllm={"gpu_memory_utilization": 0.4})
    assert opts["full_logits"] is False and opts["gpu_memory_utilization"] == 0.4


def test_an_hf_engine_gets_no_vllm_keywords():
    cfg = MODELS["vlm_grpo"].model_validate({"algorithm": "vlm_grpo", "vision": {}})
    assert WorkerSpec(model_path="unused", env=cfg.env, generation=cfg.generation).generation_options() == {}
