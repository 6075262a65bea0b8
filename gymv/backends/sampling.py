"""The one definition of the sampling distribution, used by generation and by the trainer alike.

Behaviour and training policies must be the same function of the logits, or importance ratios and the
`token_mult_prob_error` health metric measure the mismatch instead of the policy change. Both sides call
:func:`policy_logits`: vision special tokens are set to -inf, then the logits are divided by the
temperature. The logprob of a token is `log_softmax(policy_logits)[token]`, taken before top-p truncation
(top-p only decides which tokens may be drawn). Temperature 0 means greedy decoding; its logprobs are those
of temperature 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch


def forbidden_mask(vocab_size: int, forbidden_ids: Sequence[int], device) -> torch.Tensor | None:
    """[V] bool, True at the forbidden ids; one shared tensor per (vocabulary, ids, device): read it, never
    write it. Built once, because a copy from host memory waits for the device's queue to drain."""
    return _forbidden_mask(vocab_size, tuple(int(i) for i in forbidden_ids), torch.device(device))


@lru_cache(maxsize=64)
def _forbidden_mask(vocab_size: int, forbidden_ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    ids = [i for i in forbidden_ids if 0 <= i < vocab_size]
    if not ids:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(ids)] = True
    return mask.to(device)


def policy_logits(logits: torch.Tensor, temperature: float, forbidden: torch.Tensor | None) -> torch.Tensor:
    """float32 logits with forbidden ids at -inf, divided by the temperature (0 counts as 1)."""
    z = logits.float()
    if forbidden is not None:
        z = z.masked_fill(forbidden, float("-inf"))
    t = float(temperature)
    return z / t if t > 0 and t != 1.0 else z


def sample(z: torch.Tensor, top_p: float, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from policy logits `z` [B, V] (nucleus truncation applied here only)."""
    if greedy:
        return z.argmax(-1)
    probs = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
