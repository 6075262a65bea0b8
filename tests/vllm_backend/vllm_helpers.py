"""Shared pieces of the vLLM backend tests: engines built once per module, a tiny text-only Llama, and the
HF references the vLLM outputs are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from gymv.backends.generation.base import GenerationOutput, GenerationRequest
from gymv.backends.logprobs import right_pad, sequence_logprobs
from rollout_helpers import LOOK, RecordingBackend, turn_of


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


class ToolFirst(RecordingBackend):
    """The real backend answers every turn (recorded); the episode itself says the scripted tool call on
    turn 0 and 'Red.' on turn 1 (a random tiny model never calls a tool), then the real answer on turn 2."""

    SCRIPT = {0: LOOK, 1: "Red.<|im_end|>"}

    def __init__(self, inner, tokenizer):
        super().__init__(inner)
        self.tokenizer = tokenizer

    def generate(self, requests, params):
        outs = super().generate(requests, params)
        for i, r in enumerate(requests):
            line = self.SCRIPT.get(turn_of(r.where))
            if line is not None:
                ids = self.tokenizer.encode(line, add_special_tokens=False)
                outs[i] = GenerationOutput(ids, [0.0] * len(ids), line, "stop", ids[-1])
        return outs


def mult_prob_error(policy, requests: list[GenerationRequest], outputs: list[GenerationOutput],
                    temperature: float = 1.0) -> float:
    """`token_mult_prob_error` of `outputs` against the trainer's logprobs of the same tokens."""
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(requests, outputs)],
                      [list(r.images) for r in requests], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=temperature).cpu()
    deltas = []
    for b, (r, o) in enumerate(zip(requests, outputs)):
        start = len(r.prompt_token_ids)
        deltas.append(train[b, start:start + len(o.token_ids)] - torch.tensor(o.logprobs))
    return torch.exp(torch.cat(deltas).abs()).mean().item()


def max_logprob_gap(a: list[GenerationOutput], b: list[GenerationOutput]) -> float:
    return max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))


def dense_omni_twin(out: Path) -> Path:
    """The tiny Nemotron 3 Omni with each mixture-of-experts layer a dense MLP (seeded), every other weight and
    file the tiny model's own: vLLM's CPU build cannot run the family's MoE layers
    (gymv.backends.generation.vllm_models.MOE_ON_CPU), and everything else of the family runs on it."""
    if (out / "config.json").exists():
        return out
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText

    from tiny_models import tiny_path

    src = tiny_path("tiny-nemotron-omni")
    config = AutoConfig.from_pretrained(src)
    kinds = config.text_config.layers_block_type
    config.text_config.layers_block_type = ["mlp" if k == "moe" else k for k in kinds]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = AutoModelForImageTextToText.from_config(config)
    tiny = AutoModelForImageTextToText.from_pretrained(src)
    moe = {i for i, kind in enumerate(kinds) if kind == "moe"}
    model.load_state_dict({k: v for k, v in tiny.state_dict().items() if _layer(k) not in moe}, strict=False)
    model.generation_config = tiny.generation_config
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def _layer(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else -1
