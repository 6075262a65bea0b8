"""What one rollout produces: the token sequence the trainer consumes and the transcript the env scored.

The token side (`token_ids`, `loss_mask`, `logprobs`, images) is what training needs; the transcript side
(`output`, reward, extras) is what NeMo Gym tooling reads. `model_calls` ties them together: it says which
token span each model call saw and generated, so a rollout log can carry per-call token fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Why an episode ended. "length": a token budget (max_new_tokens, max_rollout_tokens or max_seq_len) cut it;
# "max_images": the next turn would bring more images than allowed; "max_turns": the loop's turn cap ended
# an episode the environment would have continued; "error": an environment call failed (see `error`).
FINISH_REASONS = ("stop", "length", "max_turns", "max_images", "error")


@dataclass
class Trajectory:
    """One episode of one row. `error` set means an infrastructure failure: exclude it from training."""

    row: dict
    task_index: int
    sample_index: int
    agent_name: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    image_turns: list[int] = field(default_factory=list)
    image_keys: list[str] = field(default_factory=list)
    output: list[dict] = field(default_factory=list)
    model_calls: list[dict] = field(default_factory=list)
    reward: float = 0.0
    extras: dict = field(default_factory=dict)
    failure_reason: str | None = None
    turns: int = 0
    truncated: bool = False
    finish_reason: str = "stop"
    error: str | None = None
    weights_version: int = 0

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def prompt_length(self) -> int:
        """Tokens before the first generated token (the whole sequence when nothing was generated)."""
        return self.model_calls[0]["generation_start"] if self.model_calls else len(self.token_ids)
