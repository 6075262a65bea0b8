"""The generation interface every backend (HF in-process, vLLM) implements.

Requests carry token ids, not text: the agent loop owns the sequence and appends to it turn by turn, so
a backend must never re-tokenize. Outputs keep the sampled tokens exactly, with the logprob of each under
the policy distribution defined in `gymv.backends.sampling`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gymv.errors import GymvError


@dataclass
class GenerationRequest:
    """One sequence to continue: its prompt ids (image spans already expanded) and its images in order.

    `where` names the row and turn for error messages (e.g. "rows.jsonl line 3, turn 2").
    """

    prompt_token_ids: list[int]
    images: Sequence[Any] = ()
    where: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 is greedy. Stop token ids and stop strings end a sequence and stay in its output;
    the model's end-of-turn token always stops unless `ignore_eos`."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise GymvError(f"temperature must be >= 0, got {self.temperature}", fix="use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise GymvError(f"top_p must be in (0, 1], got {self.top_p}", fix="use 1.0 to disable")
        if self.max_new_tokens < 1:
            raise GymvError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}", fix="use a positive number")


FinishReason = Literal["stop", "length"]


@dataclass
class GenerationOutput:
    """`token_ids` and `logprobs` align one to one; `stop_reason` is the stop token id or string matched."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)


Weights = Mapping[str, Any] | Iterable[tuple[str, Any]]
"""Named tensors in the model's own names: a state dict, or (name, tensor) pairs streamed one by one."""


def named(weights: Weights) -> dict[str, Any]:
    """The (name, tensor) pairs of `weights` as a dict (references, no copy)."""
    return dict(weights.items() if isinstance(weights, Mapping) else weights)


class GenerationBackend(ABC):
    """What a generation worker drives. Built by `create` from a checkpoint folder; `tokenizer`, `adapter`
    and `chat_template` are what the agent loop renders turns with (the backend's own, so that prompts
    and weights always come from the same checkpoint)."""

    tokenizer: Any
    adapter: Any
    chat_template: str | None = None

    @classmethod
    def create(cls, model_path: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
               trust_remote_code: bool = False) -> GenerationBackend:
        """Load the checkpoint at `model_path` onto `device` (one engine; tensor parallel engines span the
        devices their worker was given). `trust_remote_code` (the recipe's model.trust_remote_code) lets the
        checkpoint's own modelling code run; workers pass it only when it is on."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a checkpoint folder")

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        """Continue every request; outputs are in request order."""

    @abstractmethod
    def update_weights(self, weights: Weights) -> None:
        """Load new policy weights (all or some, by the model's own names). All or nothing: a name or shape
        the model does not have raises GymvError before anything is loaded."""

    @abstractmethod
    def reset_encoder_cache(self) -> None:
        """Forget cached image features (call after a refit that changed the vision encoder)."""

    def weights_hash(self) -> str:
        """Content hash of the weights generation runs with (equal to the trainer's after a refit)."""
        raise NotImplementedError(f"{type(self).__name__} does not hash its weights")

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Free what the engine holds (processes, GPU memory)."""
