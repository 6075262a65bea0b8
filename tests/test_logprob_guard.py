"""The run-level watch on train/token_mult_prob_error: the median over a full window above the bound warns once
(again only after it came back), names the causes the recipe makes likely, and with `stop` ends the run after
the step was logged."""

from __future__ import annotations

import json
import shutil

import pytest

from gymv.config import MODELS
from gymv.errors import GymvError
from gymv.train.logprob_guard import LogprobErrorGuard, likely_causes


def guard(said: list, *, stop: bool = False, window: int = 3, causes=("a cause",)) -> LogprobErrorGuard:
    return LogprobErrorGuard(1.05, window, stop, list(causes), "grpo.logprob_error_guard", said.append)


def feed(g: LogprobErrorGuard, values, start: int = 1) -> None:
    for i, v in enumerate(values, start):
        g.check(i, {"train/token_mult_prob_error": v})


def test_nothing_is_judged_before_the_window_is_full():
    said: list = []
    feed(guard(said), [2.0, 2.0])
    assert said == []


def test_a_median_above_the_bound_warns_once_naming_the_steps_and_the_causes():
    said: list = []
    g = guard(said, causes=["cause one", "cause two"])
    feed(g, [1.01, 1.2, 1.3, 1.4, 1.5])
    assert len(said) == 1
    assert said[0].startswith("warning: the median train/token_mult_prob_error of steps 1-3 is 1.2000, above 1.05 "
                              "(grpo.logprob_error_guard.max_median)")
    assert said[0].endswith("likely causes: cause one; cause two")


def test_one_outlier_step_does_not_move_the_median():
    said: list = []
    feed(guard(said), [1.01, 3.0, 1.02, 1.01, 5.0, 1.0])
    assert said == []


def test_it_warns_again_after_the_median_came_back_and_left_again():
    said: list = []
    feed(guard(said), [1.2, 1.2, 1.2, 1.0, 1.0, 1.0, 1.3, 1.3])
    assert len(said) == 2 and "steps 1-3" in said[0] and "steps 6-8" in said[1]


def test_with_stop_the_run_ends_with_one_line_naming_the_key():
    with pytest.raises(GymvError) as e:
        feed(guard([], stop=True), [1.1, 1.1, 1.1])
    assert e.value.where == "grpo.logprob_error_guard.max_median" and e.value.exit_code == 1
    assert "grpo.logprob_error_guard.stop: false" in e.value.fix


def test_steps_without_the_metric_are_not_counted():
    said: list = []
    g = guard(said)
    for step in range(1, 6):
        g.check(step, {"train/loss": 0.0})
    assert said == [] and not g._window


def validate_dict(data: dict):
    return MODELS[data["algorithm"]].model_validate({"vision": {}, **data})


def test_the_causes_follow_the_recipe():
    sync = validate_dict({"algorithm": "vlm_grpo"})
    causes = likely_causes(sync, sync.grpo)
    assert causes[0].startswith("a refit the engine did not fully load")
    asynchronous = validate_dict({"algorithm": "vlm_grpo", "grpo": {"async": {"enabled": True}},
                                  "model": {"dtype": "bfloat16"}, "generation": {"backend": "vllm"}})
    causes = likely_causes(asynchronous, asynchronous.grpo)
    assert causes[0].startswith("asynchronous generation: samples up to 1 steps older")
    assert any("16-bit" in c for c in causes) and any("vllm's kernels" in c for c in causes)


def test_null_turns_the_guard_off():
    cfg = validate_dict({"algorithm": "vlm_grpo", "grpo": {"logprob_error_guard": {"max_median": None}}})
    assert LogprobErrorGuard.for_run(cfg, cfg.grpo, "grpo", print) is None


@pytest.mark.slow
def test_a_run_above_the_bound_stops_after_logging_the_step(tmp_path):
    """A bound of 1.0 that no float computation meets exactly: the run stops at the end of its second step
    (the window), with both steps logged and the second checkpointed."""
    from gymv.train import train
    from tiny_models import tiny_path
    from train_helpers import ray_module, tiny_grpo_settings, write_recipe

    model = shutil.copytree(tiny_path("tiny-llava"), tmp_path / "model")
    settings = tiny_grpo_settings(tmp_path, model, **{
        "grpo.logprob_error_guard.max_median": 1.0, "grpo.logprob_error_guard.window_steps": 2,
        "grpo.logprob_error_guard.stop": True})
    with ray_module(), pytest.raises(GymvError, match=r"the median train/token_mult_prob_error of steps 1-2 is "
                                                      r"1\.\d+, above 1 \(grpo\.logprob_error_guard\.max_median\)"):
        train(write_recipe(tmp_path, "guarded", "vlm_grpo.yaml", settings))
    run = tmp_path / "runs" / "guarded"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "checkpoints" / "step_2").is_dir()
