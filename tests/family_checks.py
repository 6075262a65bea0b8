"""What every model family must do, written once and run on each tiny stand-in (tests/test_model_families.py).

Each check uses the real transformers classes of the family (random-initialised, built locally):
token-in/token-out rollouts with an image per turn (prompt, tool result, follow-up), the placeholder check
before every forward pass, vision tokens never sampled even when the model favours them, generation logprobs
equal to the trainer's, and a GRPO step on a training worker.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.generation import GenerationRequest, SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.cluster.workers import TrainingWorker, WorkerSpec
from gymv.rollout import check_trajectory_images, run_rollouts
from gymv.config.schema import EnvSection, TrainingSection
from rollout_helpers import PictureEnv, ScriptedBackend, picture_row, script
from tiny_models import noise, tiny_path


def picture_rollout(policy):
    """One 3-turn episode: an image in the prompt, one in a tool result, one in a follow-up."""
    backend = ScriptedBackend(policy, script)
    [traj] = run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, PictureEnv(),
                          [(0, picture_row())], group_size=1, params=SamplingParams(max_new_tokens=48), max_turns=3,
                          max_rollout_tokens=1024, max_seq_len=4096, seed=0)
    return traj


@lru_cache(maxsize=None)
def family_rollout(arch: str):
    """The 3-turn picture episode of one family, once per test process (its tokens and images do not depend
    on the weights: the replies are scripted)."""
    from tiny_models import shared_policy

    return picture_rollout(shared_policy(arch))


def continue_with_hf(policy, traj, n: int = 2, max_new_tokens: int = 6, temperature: float = 1.0):
    """Sample `n` continuations of a finished episode with the HF backend: (sequences, images, outputs)."""
    backend = HFGenerationBackend.from_policy(policy, seed=3)
    reqs = [GenerationRequest(list(traj.token_ids), list(traj.images), where=f"row 0 sample {i}") for i in range(n)]
    outs = backend.generate(reqs, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=5))
    return [list(traj.token_ids) + o.token_ids for o in outs], [list(traj.images)] * n, outs


def token_mult_prob_error(gen: torch.Tensor, train: torch.Tensor, mask: torch.Tensor) -> float:
    """exp(|logp_gen - logp_train|) averaged over the generated tokens (1.0 = the two agree exactly)."""
    return float(torch.exp((gen - train).abs())[mask].mean())


def logprob_error(policy, seqs, images, outs, prompt_len: int, temperature: float = 1.0) -> float:
    """token_mult_prob_error of the generator's logprobs against the trainer's on the same tokens."""
    batch = right_pad(seqs, images, policy.tokenizer.pad_token_id or 0, where=[f"s{i}" for i in range(len(seqs))])
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=temperature)
    gen = torch.zeros_like(train)
    mask = torch.zeros_like(train, dtype=torch.bool)
    for b, o in enumerate(outs):
        gen[b, prompt_len:prompt_len + len(o.logprobs)] = torch.tensor(o.logprobs)
        mask[b, prompt_len:prompt_len + len(o.logprobs)] = True
    return token_mult_prob_error(gen, train, mask)


def favour_vision_tokens(policy):
    """Add 1000 to every vision special token's logit (a hook on the LM head): unmasked, the model would
    sample nothing else. Returns the hook handle."""
    ids = list(policy.adapter.vision_token_ids)

    def hook(module, args, out):
        out = out.clone()
        out[..., ids] += 1000.0
        return out

    from gymv.backends.hf_forward import output_head

    return output_head(policy.model).register_forward_hook(hook)


def grpo_step(arch: str, traj) -> tuple[dict, bool]:
    """One GRPO step on a training worker from two continuations of `traj` (advantages +1 / -1)."""
    spec = WorkerSpec(model_path=str(tiny_path(arch)), env=EnvSection(name="arithmetic"),
                      training=TrainingSection(lr=1e-2, weight_decay=0.01, dtype="float32", micro_batch_tokens=8192))
    w = TrainingWorker(spec)
    w.setup()
    policy = w.backend.policy
    seqs, images, outs = continue_with_hf(policy, traj, n=2, max_new_tokens=4)
    before = {k: v.clone() for k, v in w.backend.model.state_dict().items()}
    samples = []
    for i, (ids, o) in enumerate(zip(seqs, outs)):
        n = len(traj.token_ids)
        mask = torch.tensor([0] * n + [1] * (len(ids) - n), dtype=torch.bool)
        lp = torch.zeros(len(ids))
        lp[n:] = torch.tensor(o.logprobs)
        samples.append({"input_ids": torch.tensor(ids), "loss_mask": mask, "logp_behaviour": lp,
                        "advantages": torch.tensor(1.0 if i else -1.0), "images": list(traj.images),
                        "where": f"sample {i}"})
    metrics = w.grpo_step([samples], PolicyLoss())
    after = w.backend.model.state_dict()
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    return metrics, changed


__all__ = ["check_trajectory_images", "continue_with_hf", "family_rollout", "favour_vision_tokens", "grpo_step",
           "logprob_error", "token_mult_prob_error",
           "noise", "picture_rollout"]
