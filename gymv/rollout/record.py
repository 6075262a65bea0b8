"""A trajectory as a NeMo Gym rollout row (what rollouts/step_<N>.jsonl holds)."""

from __future__ import annotations

import math

from gymv.rollout.types import Trajectory
from gymv.runs.rollout_log import attach_model_call_tokens, make_rollout_record


def to_rollout_record(traj: Trajectory, *, model: str | None = None, advantage: float | None = None) -> dict:
    """The row, `response.output` with each model call's token fields on its last item, reward and extras.

    NeMo Gym's gymnasium rollouts carry `truncated` at top level, so it sits there too; gymv's own
    bookkeeping (turns, finish reason, infrastructure error, policy version, image turns) goes under `_gymv`.
    """
    output = [dict(item) for item in traj.output]
    for call in traj.model_calls:
        k = call.get("output_index")
        if k is None or not 0 <= k < len(output):
            continue
        s, e = call["generation_start"], call["generation_end"]
        attach_model_call_tokens(output[k:k + 1], traj.token_ids[:s], traj.token_ids[s:e], traj.logprobs[s:e])
    generated = sum(traj.loss_mask)
    usage = {"input_tokens": len(traj.token_ids) - generated, "output_tokens": generated,
             "total_tokens": len(traj.token_ids)}
    extras = {**traj.extras, "failure_reason": traj.failure_reason, "truncated": traj.truncated,
              "_gymv": {"agent_name": traj.agent_name, "turns": traj.turns, "finish_reason": traj.finish_reason,
                        "error": traj.error, "weights_version": traj.weights_version,
                        "image_turns": list(traj.image_turns)}}
    if advantage is not None:  # GRPO: what this rollout's tokens were trained with (the report shows it)
        extras["_gymv"]["advantage"] = float(advantage) if math.isfinite(advantage) else None
    return make_rollout_record(traj.row, output, traj.reward, model=model, extras=extras,
                               task_index=traj.task_index, rollout_index=traj.sample_index, usage=usage)
