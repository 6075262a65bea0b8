"""A run directory for the report tests, written by gymv's own writers (RunDir, MetricsLog, write_rollouts).

The rollouts are real circle-click episodes: rows from the environment's generator, model turns and tool
calls as the protocol records them, the click tool run by the environment, a zoom tool result carrying an
image (gymv tools may return images), and the environment's own reward. Nothing here is a stand-in for a
file format: it is the format, produced by the code that produces it during training.
"""

from __future__ import annotations

import random
from pathlib import Path

from gymv.config import load_recipe
from gymv.envs import get_env
from gymv.envs.protocol import Image, ModelTurn, ToolCall, ToolResult
from gymv.runs.rollout_log import attach_model_call_tokens, make_rollout_record
from gymv.runs.run_dir import RunDir
from conftest import REPO

RECIPE = REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
TOOL_TEXT = "zoomed in on the region around the click"


def _zoom_image(row: dict) -> Image:
    """A crop of the row's own prompt image, as a tool would return it."""
    prompt = next(p for m in row["responses_create_params"]["input"] if isinstance(m.get("content"), list)
                  for p in m["content"] if p.get("type") == "input_image")
    img = Image(prompt["image_url"]).pil()
    return Image.from_pil(img.crop((0, 0, img.width // 2, img.height // 2)))


def episode(env, row: dict, task: int, sample: int, hit: bool) -> dict:
    """One two-turn circle-click rollout: click (and a zoom whose result is an image), then a final answer."""
    state = env.start(row)
    target = next(c for c in row["circles"] if c["color"] == row["target_color"])
    x, y = (target["x"], target["y"]) if hit else (0, 0)
    click = ToolCall("click", f'{{"x": {x}, "y": {y}}}')
    zoom = ToolCall("zoom", f'{{"x": {x}, "y": {y}}}', call_id="call_zoom")
    turn1 = ModelTurn(text="Let me look closer.", tool_calls=[click, zoom])
    calls = attach_model_call_tokens(turn1.to_items(), [1, 2, 3], [4, 5], [-0.5, -0.25])
    zoomed = ToolResult(call_id=zoom.call_id, name="zoom", text=TOOL_TEXT, images=[_zoom_image(row)])
    output = [*calls, env.execute(state, click).to_item(), zoomed.to_item()]
    final = ModelTurn(text="I clicked the <b>target</b> circle.").to_items()
    attach_model_call_tokens(final, [1, 2, 3, 4, 5, 6], [7], [-0.1])
    output += final
    score = env.score_output(row, output)  # its extras go into the record, as in training (gymv.rollout.record)
    return make_rollout_record(row, output, score.reward, task_index=task, rollout_index=sample,
                               extras={**score.extras, "failure_reason": score.failure_reason, "_gymv": {"agent_name": row["agent_ref"]["name"], "turns": 2,
                                                 "finish_reason": "stop", "error": None,
                                                 "advantage": 1.0 if hit else -1.0}})  # G=2, one hit: leave-one-out


def make_run(path: Path, *, steps: int = 4, checks: tuple[str, ...] = (), truncated_tail: bool = False) -> Path:
    """A GRPO run directory with `steps` steps of metrics (plus a step-0 validation) and rollouts each step."""
    overrides = ["grpo.max_steps=40"] + ([f"checks={list(checks)!r}"] if checks else [])
    cfg = load_recipe(RECIPE, overrides).validated.to_dict()
    run = RunDir.create(path, cfg)
    env = get_env("circle-click")
    knobs = env.presets["tiny"]
    rows = [env.make_row(random.Random(i), knobs, i) for i in range(2)]
    with run.metrics_log() as log:
        log.log(0, {"val/reward_mean": 0.1, "val/accuracy": 0.1})
        for s in range(1, steps + 1):
            log.log(s, {
                "train/reward_mean": 0.1 * s, "train/reward_std": 0.05, "train/accuracy": 0.2 * s / steps,
                "train/reward_mean/circle_click_simple_agent": 0.1 * s,
                "train/loss": 1.0 / s, "train/pg_loss": 0.8 / s, "train/kl_ref": 0.01 * s, "train/entropy": 2.0 - 0.1 * s,
                "train/token_mult_prob_error": 1.0 + 0.01 * s,
                "train/grad_norm": 3.0 / s, "train/lr": 1e-4 * min(1.0, s / 2), "train/gen_length_mean": 20.0 + s,
                "train/zero_std_group_fraction": 0.0,
                "timing/step_s": 10.0, "timing/generation_s": 5.0, "timing/env_s": 1.0, "timing/logprobs_s": 1.0,
                "timing/training_s": 2.5, "timing/refit_s": 0.5,
            })
            run.write_rollouts(s, [episode(env, rows[i], i, g, hit=(g == 0)) for i in range(2) for g in range(2)])
    if truncated_tail:
        with open(run.metrics_path, "a") as f:
            f.write('{"step": %d, "train/reward_mean": 0.9' % (steps + 1))
    return path
