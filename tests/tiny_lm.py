"""A tiny causal language model (embedding -> GRU -> vocabulary) and its logprob_fn, for trainer tests.

Plain torch, no hub: the trainer must work with any module plus a logprob_fn, and a GRU is causal, so
right-padding never changes the logprobs of real positions.
"""

from __future__ import annotations

import torch

from gymv.algorithms.logprobs import logprobs_from_logits

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
    return logprobs_from_logits(model(mb["input_ids"]), mb["input_ids"], with_entropy=True)


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
