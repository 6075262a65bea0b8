"""`gymv env verify`: re-scoring NeMo Gym's recorded rollouts, joins by _ng_task_index, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gymv.envs.verify import verify_rollouts
from gymv.errors import GymvError
from conftest import invoke_gymv

EXTRAS = {"circle_count": ("predicted_count", "expected_count", "correct"),
          "circle_click": ("clicked_x", "clicked_y", "hit")}


def nemo(vectors: Path, env: str) -> tuple[Path, Path]:
    return vectors / "nemo_gym" / env / "example_rollouts.jsonl", vectors / "nemo_gym" / env / "example.jsonl"


@pytest.mark.parametrize("env", ["circle_count", "circle_click"])
def test_rescoring_nemo_gym_rollouts_reproduces_every_recorded_reward_and_extra(vectors, env, tmp_path):
    rollouts, data = nemo(vectors, env)
    report = verify_rollouts(rollouts, data=data, out=tmp_path / "scored.jsonl")
    assert (report.scored, report.mismatches, report.errors) == (5, [], [])
    recorded = [json.loads(x) for x in rollouts.read_text().splitlines()]
    scored = [json.loads(x) for x in (tmp_path / "scored.jsonl").read_text().splitlines()]
    for theirs, ours in zip(recorded, scored):
        assert ours["reward"] == theirs["reward"]
        assert {k: ours[k] for k in EXTRAS[env]} == {k: theirs[k] for k in EXTRAS[env]}


def test_cli_json_report_has_means_counts_and_failures_by_reason(vectors):
    rollouts, data = nemo(vectors, "circle_click")
    r = invoke_gymv("env", "verify", rollouts, "--data", data, "--json", "--fail-on-mismatch")
    assert r.code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["by_env"]["circle-click"] == {"rollouts": 5, "mean_reward": 0.4, "recorded_mean_reward": 0.4,
                                                "mismatches": 0}
    assert report["failures"] == {"bad_click_arguments": 3}


def test_cli_table_summarises_the_file(vectors):
    rollouts, data = nemo(vectors, "circle_count")
    r = invoke_gymv("env", "verify", rollouts, "--data", data)
    assert r.code == 0 and "circle-count" in r.stdout and "wrong_count" in r.stdout


def test_rollouts_without_verifier_fields_need_the_data_rows(vectors):
    rollouts, _ = nemo(vectors, "circle_count")
    r = invoke_gymv("env", "verify", rollouts)
    assert r.code == 2 and ":1: rollout has no verifier fields" in r.stderr and "--data" in r.stderr


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _rollout(text: str, **row) -> str:
    base = {"circles": [{"x": 5, "y": 5, "radius": 3, "color": "red"}], "target_color": "red",
            "response": {"output": [{"type": "message", "role": "assistant",
                                     "content": [{"type": "output_text", "text": text}]}]}}
    return json.dumps({**base, **row})


def test_malformed_line_fails_naming_its_line_number(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_rollout("\\boxed{1}"), "{not json", _rollout("\\boxed{1}")])
    r = invoke_gymv("env", "verify", path, "--env", "circle-count")
    assert r.code == 2 and f"{path}:2: malformed JSON line" in r.stderr and "Traceback" not in r.stderr


def test_malformed_line_is_skipped_and_counted_with_on_error_skip(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_rollout("\\boxed{1}"), "{not json", _rollout("\\boxed{1}")])
    report = verify_rollouts(path, env="circle-count", on_error="skip")
    assert (report.lines, report.scored, report.mean_reward) == (3, 2, 1.0)
    assert [e["line"] for e in report.errors] == [2]


def test_row_missing_verifier_fields_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "r.jsonl", [json.dumps({"target_color": "red", "response": {"output": []}})])
    with pytest.raises(GymvError, match=r"r\.jsonl:1: rollout is missing the verifier field 'circles'"):
        verify_rollouts(path, env="circle-count")


def test_data_row_missing_verifier_fields_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "r.jsonl", [json.dumps({"_ng_task_index": 0, "response": {"output": []}})])
    data = _write(tmp_path / "d.jsonl", [json.dumps({"circles": []})])
    with pytest.raises(GymvError, match="row is missing the verifier field 'target_color'"):
        verify_rollouts(path, data=data, env="circle-count")


def test_model_output_with_no_answer_scores_zero_with_its_reason(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_rollout("I am not sure."), _rollout("\\boxed{1}")])
    report = verify_rollouts(path, env="circle-count")
    assert (report.scored, report.mean_reward, dict(report.failures)) == (2, 0.5, {"no_boxed_answer": 1})


def test_task_index_outside_the_data_rows_is_a_clear_error(vectors, tmp_path):
    _, data = nemo(vectors, "circle_count")
    path = _write(tmp_path / "r.jsonl", [json.dumps({"_ng_task_index": 99, "response": {"output": []}})])
    with pytest.raises(GymvError, match="_ng_task_index=99 is not a row"):
        verify_rollouts(path, data=data)


def test_a_skipped_malformed_data_row_keeps_its_index_so_later_rows_join_to_their_own(tmp_path):
    row = {"circles": [{"x": 5, "y": 5, "radius": 3, "color": "red"}], "target_color": "red"}
    data = _write(tmp_path / "d.jsonl", ["{not json", "", json.dumps(row)])
    answer = {"output": [{"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": "\\boxed{1}"}]}]}
    path = _write(tmp_path / "r.jsonl", [json.dumps({"_ng_task_index": i, "response": answer}) for i in (1, 0)])
    report = verify_rollouts(path, data=data, env="circle-count", on_error="skip")
    assert (report.scored, report.mean_reward) == (1, 1.0)
    assert [e["line"] for e in report.errors] == [2] and "d.jsonl:1: malformed JSON line" in report.errors[0]["error"]


def test_rollout_of_an_unknown_environment_asks_for_env(tmp_path):
    path = _write(tmp_path / "r.jsonl", [json.dumps({"response": {"output": []}, "_ng_task_index": 0})])
    data = _write(tmp_path / "d.jsonl", [json.dumps({"question": "?"})])
    with pytest.raises(GymvError, match="pass --env"):
        verify_rollouts(path, data=data)


def test_recorded_reward_that_gymv_disagrees_with_is_reported_as_a_mismatch(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_rollout("\\boxed{1}", reward=0.0)])
    r = invoke_gymv("env", "verify", path, "--env", "circle-count", "--fail-on-mismatch")
    assert r.code == 1 and "line 1: recorded reward 0.0, gymv 1.0" in r.stdout


def test_missing_rollout_file_is_a_one_line_error(tmp_path):
    r = invoke_gymv("env", "verify", tmp_path / "nope.jsonl")
    assert r.code == 2 and "file not found" in r.stderr
