"""One episode in flight: the token sequence as it grows, its images, and the environment state.

The sequence only ever grows by appending: sampled tokens exactly as the backend returned them (mask 1,
their logprobs), and token ids of environment-inserted text (mask 0, logprob 0). Every generate request is
checked to extend the previous request plus what was sampled for it, so a bookkeeping bug can never hand
the model (or the trainer) a conversation that differs from the one that was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gymv.envs.protocol import Environment, EpisodeState
from gymv.errors import GymvError
from gymv.rollout.types import Trajectory


@dataclass
class Episode:
    task_index: int
    sample_index: int
    row: dict
    env: Environment
    where: str
    agent_name: str
    state: EpisodeState | None = None
    tools: list[dict] | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    image_turns: list[int] = field(default_factory=list)
    image_keys: list[str] = field(default_factory=list)
    model_calls: list[dict] = field(default_factory=list)
    generated: int = 0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    finish_reason: str = "stop"
    error: str | None = None
    _last_request: list[int] | None = None
    _last_sampled: list[int] = field(default_factory=list)

    def at(self, turn: int) -> str:
        return f"{self.where}, turn {turn}"

    def append_inserted(self, ids: list[int], images: list[tuple[Any, str]], turn: int) -> None:
        """Environment-inserted tokens (prompt, tool results, follow-ups) and the images they introduce."""
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        for pil, key in images:
            self.images.append(pil)
            self.image_keys.append(key)
            self.image_turns.append(turn)

    def request_ids(self) -> list[int]:
        """The prompt of the next model call, checked to extend the previous call's prompt and sample."""
        ids = list(self.ids)
        prev = self._last_request
        if prev is not None:
            n, m = len(prev), len(self._last_sampled)
            if ids[:n] != prev or ids[n:n + m] != self._last_sampled:
                raise GymvError("the token sequence of this turn does not extend the previous turn's prompt and "
                                "sampled tokens", where=self.where, fix="this is a gymv bug; please report it")
        self._last_request = ids
        return ids

    def append_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise GymvError(f"the backend returned {len(ids)} tokens but {len(logprobs)} logprobs", where=self.where,
                            fix="a generation backend must return one logprob per sampled token")
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.generated += len(ids)
        self._last_sampled = list(ids)

    def finish(self, reason: str, *, truncated: bool = False) -> None:
        self.done, self.finish_reason, self.truncated = True, reason, truncated

    def fail(self, message: str) -> None:
        self.error = message
        self.finish("error")

    def trajectory(self, weights_version: int) -> Trajectory:
        return Trajectory(
            row=self.row, task_index=self.task_index, sample_index=self.sample_index, agent_name=self.agent_name,
            token_ids=self.ids, loss_mask=self.mask, logprobs=self.logprobs, images=self.images,
            image_turns=self.image_turns, image_keys=self.image_keys,
            output=self.state.output if self.state is not None else [], model_calls=self.model_calls,
            turns=self.turns, truncated=self.truncated, finish_reason=self.finish_reason, error=self.error,
            weights_version=weights_version)
