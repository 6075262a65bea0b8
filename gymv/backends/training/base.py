"""The training backend interface: what the algorithm loop needs from any trainer (torch, later megatron).

A training sample is a dict of tensors for ONE sequence: `input_ids` [L], `loss_mask` [L], per-token
extras [L] (logp_old, logp_behaviour, logp_ref, logp_teacher) and per-sample extras (0-d, e.g.
`advantages`). A collate function turns a list of samples into a micro-batch dict; multimodal adapters
supply their own (images, grids) in the same shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, Protocol

from torch import Tensor

from gymv.algorithms.losses import GlobalCounts

Sample = dict[str, Tensor]
MicroBatch = dict[str, Any]
LogprobFn = Callable[[Any, MicroBatch], "tuple[Tensor, Tensor | None]"]
"""logprob_fn(model, micro_batch) -> (logprobs [B,T], entropy [B,T] or None), aligned with input_ids."""
LossFn = Callable[[MicroBatch, Tensor, "Tensor | None", GlobalCounts], "tuple[Tensor, dict[str, Tensor]]"]
"""loss_fn(micro_batch, logprobs, entropy, global_counts) -> (loss share, metric shares); see loss_fns."""
CollateFn = Callable[[Sequence[Sample]], MicroBatch]
PlanFn = Callable[[Sequence[Sample], int], "list[list[int]]"]
"""plan_fn(samples, micro_batch_tokens) -> index lists, one per micro-batch (default: padded token budget)."""


class TrainingBackend(Protocol):
    """One optimizer step per `train_step`; weights out through `state_dict` (refit) and `save`/`load`."""

    rank: int
    world_size: int

    def train_step(self, samples: Sequence[Sample], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward over this rank's samples in token-budget micro-batches, all-reduce, clip, step.

        Returns `train/...` metrics for the global batch (identical on every rank). Raises GymvError on a
        non-finite loss or gradient, leaving weights and optimizer state untouched.
        """
        ...

    def compute_logprobs(self, samples: Sequence[Sample]) -> list[Tensor]:
        """No-grad logprobs of each sample ([L] each, input order), e.g. logp_old before an update."""
        ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def save(self, path: str | PathLike) -> None: ...

    def load(self, path: str | PathLike) -> None: ...
