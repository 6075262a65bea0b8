"""Generation logprobs equal the trainer's in bf16 on a GPU, for every model family (the CPU tests check fp32).

Each family's tiny stand-in (random-initialised, built locally) continues its 3-image episode with the HF
backend on CUDA in bfloat16; the trainer's logprobs of the same tokens, in the same dtype, must agree:
token_mult_prob_error < 1.05. Text-only families continue an arithmetic prompt.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from family_checks import continue_with_hf, family_rollout, logprob_error
from test_model_families import TEXT_FAMILIES, VLM_FAMILIES
from tiny_models import tiny_path

pytestmark = pytest.mark.gpu


def _gpu_policy(arch: str):
    from gymv.backends.policy import load_policy

    return load_policy(tiny_path(arch), device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl", *sorted(VLM_FAMILIES), *sorted(TEXT_FAMILIES)])
def test_bf16_generation_logprobs_equal_the_trainers_on_cuda(arch):
    policy = _gpu_policy(arch)
    if arch in VLM_FAMILIES:
        traj = family_rollout(arch)  # token ids and images do not depend on the weights (scripted replies)
        prompt, images = list(traj.token_ids), list(traj.images)
    else:
        prompt, images = policy.tokenizer.encode("What is 12 + 30? Answer:", add_special_tokens=False), []

    start = SimpleNamespace(token_ids=prompt, images=images)  # what continue_with_hf reads of a trajectory
    seqs, imgs, outs = continue_with_hf(policy, start, n=8, max_new_tokens=16, temperature=1.0)
    error = logprob_error(policy, seqs, imgs, outs, len(prompt))
    print(f"{arch}: token_mult_prob_error {error:.4f} (bf16, cuda)")
    assert error < 1.05
