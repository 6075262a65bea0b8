"""What `gymv train` asks of a vLLM engine: the recipe's generation.vllm keywords, and every logit back where
top_p < 1 (so that logprobs keep the trainer's definition, taken before the nucleus cut)."""

from __future__ import annotations

from gymv.config.schema import MODELS
from gymv.train.setup import _vllm_options


def cfg(**generation):
    return MODELS["vlm_grpo"].model_validate({"algorithm": "vlm_grpo", "vision": {},
                                             "generation": {"backend": "vllm", **generation}})


def test_top_p_below_one_asks_the_engine_for_full_logits():
    assert _vllm_options(cfg(top_p=0.9))["full_logits"] is True


def test_top_p_one_keeps_vllms_own_logprobs_and_the_recipes_keywords():
    opts = _vllm_options(cfg(vllm={"gpu_memory_utilization": 0.4}))
    assert opts["full_logits"] is False and opts["gpu_memory_utilization"] == 0.4
