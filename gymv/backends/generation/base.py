"""The generation interface every backend (HF in-process, vLLM) implements.

Requests carry token ids, not text: the agent loop owns the sequence and appends to it turn by turn, so
a backend must never re-tokenize. Outputs keep the sampled tokens exactly, with the logprob of each under
the policy distribution defined in `gymv.backends.sampling`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gymv.errors import GymvError
from gymv.sections import GenerationSection, default


@dataclass
class GenerationRequest:
    """One sequence to continue: its prompt ids (image spans already expanded) and its images in order.

    `where` names the row and turn for error messages (e.g. "rows.jsonl line 3, turn 2"). `seed`, when set,
    is this request's own sampling seed, used instead of (`SamplingParams.seed`, its index in the call): its
    samples then depend on it alone, whatever call or slot serves it. `max_new_tokens`, when set, caps this
    request below `SamplingParams.max_new_tokens` (an episode near its budget).
    """

    prompt_token_ids: list[int]
    images: Sequence[Any] = ()
    where: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 is greedy. Stop token ids and stop strings end a sequence and stay in its output;
    the model's end-of-turn token always stops unless `ignore_eos`."""

    temperature: float = default(GenerationSection, "temperature")
    top_p: float = default(GenerationSection, "top_p")
    max_new_tokens: int = default(GenerationSection, "max_new_tokens")
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


class RequestFeed:
    """Requests that become ready one by one while a backend decodes (`GenerationBackend.serve`).

    The producer (the agent loop) `put`s (key, request) pairs and `close`s the feed when no more can come;
    `cancel` also tells the backend to stop early (the producer failed). The backend `take`s: without
    blocking whenever it has a free slot, blocking only when nothing is live. Thread-safe; first in, first out.
    `open_keys`, when the producer sets it, is how many keys (episodes) may still send a request, those
    being served included: a backend may shrink its batch to fit them.
    """

    def __init__(self, items: Iterable[tuple[Hashable, GenerationRequest]] = (), *, closed: bool = False):
        self._cond = threading.Condition()
        self._items: deque[tuple[Hashable, GenerationRequest]] = deque(items)
        self._closed = closed
        self.cancelled = False
        self.open_keys: int | None = None

    def put(self, key: Hashable, request: GenerationRequest) -> None:
        with self._cond:
            if self._closed:
                raise GymvError("a request was fed after the feed was closed", where=request.where,
                                fix="close the feed only once no more requests can come")
            self._items.append((key, request))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = self._closed = True
            self._items.clear()
            self._cond.notify_all()

    def take(self, n: int, *, block: bool) -> list[tuple[Hashable, GenerationRequest]]:
        """Up to `n` ready requests, oldest first; with `block`, waits until one is ready or the feed closes."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._items or self._closed)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def exhausted(self) -> bool:
        """Closed and drained: nothing more will come."""
        with self._cond:
            return self._closed and not self._items


OnOutput = Callable[[Hashable, GenerationOutput], None]
"""Called by `serve` with each finished request's key and output, as soon as the backend has read it out."""


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

    serves_continuously: bool = False
    """Whether `serve` admits a request into the running batch (continuous batching) rather than falling back
    to one `generate` call per group of ready requests. The agent loop streams turns by default only then."""

    def serve(self, feed: RequestFeed, params: SamplingParams, on_output: OnOutput, *,
              max_seq_len: int | None = None, slots: int | None = None) -> None:
        """Serve the requests of `feed` until it is exhausted, handing each output to `on_output` as it is read.

        `max_seq_len` (a prompt plus its new tokens never exceed it) and `slots` (how many requests may be live
        at once, at most) are sizing hints. This default degrades to batched `generate`: it waits for at least
        one request, takes every ready one, generates them in one call (the longest of their own caps;
        outputs are cut to each cap), and repeats. Per-request seeds then shape that call's seed, so its
        samples depend on how requests happened to be grouped; `serves_continuously` backends honour each
        request's seed alone."""
        params.validate()
        while True:
            batch = feed.take(slots or 1 << 30, block=True)
            if not batch or feed.cancelled:
                return
            reqs = [r for _, r in batch]
            caps = [min(params.max_new_tokens, r.max_new_tokens or params.max_new_tokens) for r in reqs]
            seeds = [r.seed for r in reqs]
            seed = params.seed if None in seeds else hash(tuple(seeds)) % (2**63 - 1)
            outs = self.generate(reqs, replace(params, max_new_tokens=max(caps), seed=seed))
            for (key, _), cap, out in zip(batch, caps, outs):
                on_output(key, _cut(out, cap, self.tokenizer))

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

    def held_digests(self, names: Collection[str], dtype: str | None = None, method: str | None = None) -> dict[str, str]:
        """{name: gymv.backends.weights.tensor_digest} of the named weights as this engine holds them now, read
        from the tensors its forward pass uses, in checkpoint names and layout, floating ones cast to `dtype`
        (the one they were sent in: an engine may keep a layer in a wider type), by `method` (the trainer's); a
        name it does not hold is left out. The `digest` refit check (gymv.cluster.refit_check) compares them with what the trainer sent."""
        raise NotImplementedError(f"{type(self).__name__} cannot digest its weights in checkpoint names")

    def probe_logprobs(self, token_ids: Sequence[int], images: Sequence[Any] = ()) -> list[float]:
        """The raw logprob (log-softmax of the logits: temperature 1, no token masked) of each token after the
        first given the ones before it, `len(token_ids) - 1` values: the `probe` refit check scores one fixed
        sequence this way on both sides."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a probe sequence")

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Free what the engine holds (processes, GPU memory)."""


def _cut(out: GenerationOutput, cap: int, tokenizer) -> GenerationOutput:
    """`out` cut to its first `cap` tokens (finish "length") when it ran past them."""
    if len(out.token_ids) <= cap:
        return out
    toks = out.token_ids[:cap]
    return GenerationOutput(toks, out.logprobs[:cap], tokenizer.decode(toks, skip_special_tokens=True), "length",
                            None, out.metrics)
