"""The one logprob convention shared by generation and training.

logp[b, t] = log_softmax(logits[b, t-1] / temperature with forbidden ids set to -inf)[input_ids[b, t]],
i.e. entry t scores token t given the tokens before it; entry 0 has no prediction and is 0. Forbidden ids
(image placeholders and other vision special tokens) can never be sampled, so they are removed from the
distribution in both places: otherwise behaviour and training policies differ on every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def logprobs_from_logits(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    forbidden_ids: Sequence[int] | Tensor | None = None,
    *,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(logp [B,T], entropy [B,T] or None) aligned with `input_ids` as described above.

    `logits` is [B,T,V] from a causal LM over `input_ids` [B,T]. Computed in fp32. A forbidden target token
    gets -inf (it cannot have been sampled; losses mask prompt positions, so this only surfaces as an error
    when such a token is marked as generated).
    """
    z = logits[:, :-1, :].float()
    if temperature != 1.0:
        z = z / temperature
    if forbidden_ids is not None and len(forbidden_ids) > 0:
        ids = torch.as_tensor(forbidden_ids, dtype=torch.long, device=z.device)
        z = z.index_fill(-1, ids, float("-inf"))
    logp_all = torch.log_softmax(z, dim=-1)
    targets = input_ids[:, 1:].long().unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    if not with_entropy:
        return logp, None
    p = logp_all.exp()
    ent = -(p * torch.where(torch.isfinite(logp_all), logp_all, torch.zeros_like(logp_all))).sum(-1)
    ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    return logp, ent
