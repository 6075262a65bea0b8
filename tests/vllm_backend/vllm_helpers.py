"""Shared pieces of the vLLM backend tests: engines built once per module, a tiny text-only Llama, and the
HF references the vLLM outputs are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from gymv.backends.generation.base import GenerationOutput, GenerationRequest
from gymv.backends.logprobs import right_pad, sequence_logprobs


def vllm_backend(path):
    from gymv.backends.generation.vllm import VllmGenerationBackend

    return VllmGenerationBackend.create(str(path), seed=0)


def tiny_text_llama(out: Path) -> Path:
    """A text-only LlamaForCausalLM with the tiny LLaVA's tokenizer and text sizes (head_dim 32, which vLLM's
    CPU attention supports)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from gymv.models.tiny import _text_kwargs, knobs_for
    from tiny_models import tiny_path

    tok = AutoTokenizer.from_pretrained(tiny_path("tiny-llava"))
    config = LlamaConfig(**_text_kwargs(knobs_for("tiny-llava"), len(tok), tok))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def mult_prob_error(policy, requests: list[GenerationRequest], outputs: list[GenerationOutput],
                    temperature: float = 1.0) -> float:
    """`token_mult_prob_error` of `outputs` against the trainer's logprobs of the same tokens."""
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(requests, outputs)],
                      [list(r.images) for r in requests], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=temperature)
    deltas = []
    for b, (r, o) in enumerate(zip(requests, outputs)):
        start = len(r.prompt_token_ids)
        deltas.append(train[b, start:start + len(o.token_ids)] - torch.tensor(o.logprobs))
    return torch.exp(torch.cat(deltas).abs()).mean().item()


def max_logprob_gap(a: list[GenerationOutput], b: list[GenerationOutput]) -> float:
    return max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
