"""The rollout agent loop: turns, tool calls, token bookkeeping and per-turn images (see docs/rollout.md)."""

from gymv.rollout.images import ImageCache
from gymv.rollout.loop import build_sft_sample, run_rollouts
from gymv.rollout.parse import parse_turn
from gymv.rollout.record import to_rollout_record
from gymv.rollout.spans import check_trajectory_images
from gymv.rollout.types import FINISH_REASONS, Trajectory

__all__ = ["FINISH_REASONS", "ImageCache", "Trajectory", "build_sft_sample", "check_trajectory_images", "parse_turn",
           "run_rollouts", "to_rollout_record"]
