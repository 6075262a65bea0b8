"""A tiny causal language model (embedding -> GRU -> vocabulary) and its logprob_fn, for trainer tests.

Plain torch, no hub: the trainer must work with any module plus a logprob_fn, and a GRU is causal, so
right-padding never changes the logprobs of real positions.
"""

from __future__ import annotations

import torch

VOCAB = 32


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.rnn = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(input_ids))
        return self.head(h)


def tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def logprob_fn(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [B, T]: entry t scores token t given the ones before it; entry 0 is 0."""
    ids = mb["input_ids"]
    logp_all = torch.log_softmax(model(ids)[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.zeros_like(logp[:, :1])
    return torch.cat([pad, logp], dim=1), torch.cat([pad, ent], dim=1)


def make_samples(n: int, seed: int, min_len: int = 4, max_len: int = 12, prompt_len: int = 2) -> list[dict]:
    """Random sequences whose first `prompt_len` tokens are prompt (loss_mask 0), with a per-sample advantage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt_len:] = True
        out.append({"input_ids": ids, "loss_mask": mask, "advantages": torch.randn((), generator=g)})
    return out
