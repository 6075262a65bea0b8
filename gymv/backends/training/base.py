"""The training backend interface: what a training worker drives (torch, FSDP2 and Megatron-core: gymv.backends.registry).

A training sample is a dict of tensors for ONE sequence: `input_ids` [L], `loss_mask` [L], per-token
extras [L] (logp_old, logp_behaviour, logp_ref, logp_teacher) and per-sample extras (0-d, e.g.
`advantages`). A collate function turns a list of samples into a micro-batch dict; multimodal adapters
supply their own (images, grids) in the same shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch
from torch import Tensor

from gymv.backends.weights import weights_hash
from gymv.sections import TrainingSection


def local_shard(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(frozen=True)
class GlobalCounts:
    """Valid tokens and sequences with at least one valid token, over the whole (global) batch: what a
    trainer counts across its ranks before a step, and every loss normalises by."""

    tokens: float
    sequences: float

    @staticmethod
    def of(mask: Tensor) -> GlobalCounts:
        m = mask if mask.dtype == torch.bool else mask != 0
        return GlobalCounts(tokens=float(m.sum()), sequences=float(m.any(dim=-1).sum()))


Sample = dict[str, Tensor]
MicroBatch = dict[str, Any]
LogprobFn = Callable[[Any, MicroBatch], "tuple[Tensor, ...]"]
"""logprob_fn(model, micro_batch) -> (logprobs [B,T], entropy [B,T] or None[, candidate logprobs [B,T,k]
or None]), aligned with input_ids (gymv.backends.logprobs.TokenScores); it never writes into the batch."""
LossFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]
"""loss_fn(micro_batch, logprobs, entropy, global_counts[, candidates=...]) -> (loss share, metric shares);
`candidates` is passed when the logprob function returned some (see loss_fns)."""
CollateFn = Callable[[Sequence[Sample]], MicroBatch]
PlanFn = Callable[[Sequence[Sample], int], "list[list[int]]"]
"""plan_fn(samples, micro_batch_tokens) -> index lists, one per micro-batch (default: padded token budget)."""
ImagesFn = Callable[[Any, Sequence[Sample], "list[list[int]]"], Any]
"""images_fn(model, samples, plan) -> the step's images encoded once (gymv.backends.step_images.StepImages)
or None; called before the first micro-batch, under the trainer's autocast."""


@dataclass(frozen=True)
class TrainingSetup:
    """Everything a training backend needs to build one rank, pickled into each worker: the recipe's
    `training:` section as it is, and the run's facts around it."""

    model_path: str
    training: TrainingSection  # optimizer, schedule, precision, packing, compile, fsdp, parallel, moe
    device: str = "cpu"
    seed: int = 0
    temperature: float = 1.0  # logprobs are of the sampling distribution at this temperature
    total_steps: int = 0  # optimizer steps of the whole run (the schedule's end)
    kl_reference: bool = False  # also hold a frozen copy of the initial policy for `reference=True` logprobs
    trust_remote_code: bool = False  # model.trust_remote_code: the checkpoint's own modelling code may run


class TrainingBackend(ABC):
    """One rank of a trainer. `tokenizer`, `adapter` and `chat_template` are what SFT samples are laid
    out with. Ranks of one trainer are built together and called together (collective calls)."""

    rank: int = 0
    world_size: int = 1
    # True: `named_weights` gathers shards with collectives, so every rank iterates it together (the
    # workers of ranks other than 0 follow rank 0's refits, hashes and exports)
    gathers_weights: bool = False
    tokenizer: Any
    adapter: Any
    chat_template: str | None = None

    @classmethod
    @abstractmethod
    def create(cls, setup: TrainingSetup, *, device: Any, rank: int = 0, world_size: int = 1) -> TrainingBackend:
        """Build this rank. With world_size > 1 the default torch.distributed group is already up."""

    @property
    @abstractmethod
    def steps(self) -> int:
        """Optimizer steps taken (restored by `load`)."""

    @abstractmethod
    def learning_rate(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based), warm-up and schedule applied."""

    @abstractmethod
    def train_step(self, samples: Sequence[Sample], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's samples at `learning_rate(steps + 1)`.

        Returns `train/...` metrics for the global batch (identical on every rank). Raises GymvError on a
        non-finite loss or gradient, leaving weights and optimizer state untouched.
        """

    @abstractmethod
    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[Tensor]:
        """No-grad logprobs of each sample ([L] each, input order): the policy's, or the frozen reference's."""

    @abstractmethod
    def sum_over_ranks(self, value: float) -> float:
        """`value` summed over the trainer's data-parallel ranks."""

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's full weights in the generator's names, one tensor at a time (a sharded trainer
        gathers each on the fly); meaningful on rank 0, which publishes refits. Tensors may be live views:
        consume each before the next optimizer step."""

    def probe_logprobs(self, sample: Sample) -> Tensor:
        """Raw logprobs (log-softmax of the logits: temperature 1, no token masked) of the sample's loss-masked
        tokens, [L] with 0 elsewhere: the trainer's side of the `probe` refit check. A collective where
        `compute_logprobs` is one: every rank calls it."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a refit probe")

    def weights_hash(self, dtype: Any = None) -> str:
        """Content hash of `named_weights` cast to `dtype` (the generator's): equal to its hash after a refit."""
        return weights_hash(dict(self.named_weights()), dtype)

    @abstractmethod
    def parameter_count(self) -> int: ...

    def checkpoint_bytes(self) -> int | None:
        """About the bytes `save` writes on this rank (0 where the rank writes nothing), for the launch's check
        that the checkpoint disk holds them; None where the backend cannot tell."""
        return None

    @abstractmethod
    def save(self, path: str | PathLike) -> None:
        """Write this rank's training state (weights, optimizer, step count) into folder `path`."""

    @abstractmethod
    def load(self, path: str | PathLike) -> None: ...

    @abstractmethod
    def export_hf(self, path: str | PathLike) -> None:
        """Write a Hugging Face folder (weights, config, tokenizer, processor) that loads with
        `from_pretrained` and as another run's model.path; called on every rank, rank 0 writes."""

    def close(self) -> None:
        """Free what the rank holds."""
