"""scripted (alias example-multi-turn-gymnasium): a picture, then scripted follow-ups; NeMo Gym's reward rule."""

from __future__ import annotations

import json
import re

import pytest

from envs_scripts import dataset, play, prompt_images, tiny_rows
from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, RowError, env_for_row, get_env
from gymv.envs.verify import verify_rollouts
from gymv.errors import GymvError
from conftest import invoke_gymv

NEMO = "nemo_gym/example_multi_turn_gymnasium"


@pytest.fixture(scope="module")
def env():
    return get_env("scripted")


def nemo_rows(vectors) -> list[dict]:
    return [json.loads(x) for x in (vectors / NEMO / "example.jsonl").read_text().splitlines()]


def test_nemo_gym_name_and_agent_resolve_to_the_scripted_environment(vectors):
    assert get_env("example-multi-turn-gymnasium").name == get_env("example_multi_turn_gymnasium").name == "scripted"
    assert env_for_row(nemo_rows(vectors)[0]).name == "scripted"


def test_rescoring_nemo_gyms_rollouts_reproduces_every_recorded_reward(vectors):
    report = verify_rollouts(vectors / NEMO / "example_rollouts.jsonl", data=vectors / NEMO / "example.jsonl")
    assert report.scored == report.lines == 5 and report.mismatches == [] and report.errors == []
    assert report.mean_reward == report.recorded_mean_reward


def test_gymv_env_verify_cli_reproduces_the_recorded_rewards(vectors):
    res = invoke_gymv("env", "verify", vectors / NEMO / "example_rollouts.jsonl", "--data", vectors / NEMO / "example.jsonl",
                   "--json", "--fail-on-mismatch")
    assert res.code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["by_env"]["scripted"]["rollouts"] == 5 and out["mismatches"] == []


def _joined(vectors) -> list[dict]:
    rows = nemo_rows(vectors)
    rollouts = [json.loads(x) for x in (vectors / NEMO / "example_rollouts.jsonl").read_text().splitlines()]
    return [{**rows[r["_ng_task_index"]], **r} for r in rollouts]


def test_the_same_rollouts_with_the_answer_removed_from_the_last_turn_score_zero(vectors, env):
    for r in _joined(vectors):
        output = [dict(item) for item in r["response"]["output"]]
        last = output[-1]
        last["content"] = [{"type": "output_text", "text": "I would rather not say.", "annotations": []}]
        result = env.verify({**r, "response": {"output": output}})
        assert result["reward"] == 0.0 and result["failure_reason"] == "answer_not_found"


def test_the_answer_in_an_earlier_turn_does_not_count(vectors, env):
    r = next(r for r in _joined(vectors) if r["expected_answer"] == "Eiffel")
    output = r["response"]["output"]
    moved = [{**output[0], "content": [{"type": "output_text", "text": "Paris, home of the eiffel tower."}]},
             *output[1:-1], {**output[-1], "content": [{"type": "output_text", "text": "A big tower."}]}]
    assert env.verify({**r, "response": {"output": moved}})["reward"] == 0.0


def test_an_episode_cut_before_the_last_follow_up_was_answered_scores_zero(vectors, env):
    r = next(r for r in _joined(vectors) if len(r["follow_ups"]) == 2)
    cut = r["response"]["output"][:-2]  # the last follow-up and its answer never happened
    result = env.verify({**r, "response": {"output": cut}})
    assert result["reward"] == 0.0 and result["failure_reason"] == "unfinished"


def test_a_nemo_row_plays_one_turn_per_question_with_the_follow_ups_in_order(vectors, env):
    row = nemo_rows(vectors)[0]
    state = env.start(row)
    asked = [env.step(state, ModelTurn(text=f"answer {k}")).user_messages for k in range(2)]
    assert [m[0].text for m in asked] == row["follow_ups"] and not state.done
    env.step(state, ModelTurn(text="The eiffel Tower."))
    assert state.done and env.score(state).reward == 1.0


def test_gold_episode_answers_every_question_for_full_reward(env):
    for preset in ("tiny", "default"):
        for _, row in tiny_rows(env, 20, preset=preset):
            turns = env.gold_turns(row)
            state, score = play(env, row, turns)
            assert len(turns) == len(row["follow_ups"]) + 1 == state.turns and state.done and score.reward == 1.0


def test_questions_walk_right_along_the_row_of_shapes(env):
    row = next(r for _, r in tiny_rows(env, 50, preset="default") if len(r["follow_ups"]) == 3)
    shapes = row["shapes"]
    first = row["responses_create_params"]["input"][-1]["content"][1]["text"]
    ordinal = ["first", "second", "third", "fourth", "fifth"].index(re.search(r"the (\w+) one", first).group(1))
    a, b = shapes[ordinal], shapes[ordinal + 1]
    assert row["answers"] == [a["shape"], a["color"], b["shape"], b["color"]]
    assert row["follow_ups"] == ["What color is it?", "What shape is just to its right?", "What color is it?"]


def test_tiny_rows_show_two_shapes_in_a_56_pixel_wide_picture_with_one_follow_up(env):
    for _, row in tiny_rows(env, 20):
        assert decode_data_url(prompt_images(row)[0]).size == (56, 28)
        assert len(row["shapes"]) == 2 and len(row["follow_ups"]) == 1


def test_rows_carry_nemo_gyms_agent_name_and_fields(env):
    row = tiny_rows(env, 1)[0][1]
    assert row["agent_ref"] == {"type": "responses_api_agents", "name": "example_multi_turn_gymnasium_agent"}
    assert isinstance(row["follow_ups"], list) and isinstance(row["expected_answer"], str)


def test_a_nemo_row_has_no_gold_episode_to_train_on(vectors, env):
    with pytest.raises(GymvError, match="no 'answers'"):
        env.gold_turns(nemo_rows(vectors)[0])


def test_follow_ups_that_are_not_strings_are_the_rows_fault(env):
    with pytest.raises(RowError, match="follow_ups"):
        env.start({"responses_create_params": {"input": "hi"}, "follow_ups": [1], "expected_answer": "x"})


def test_prepare_is_byte_identical_across_worker_counts_and_splits_share_no_row(env, tmp_path):
    one = dataset(env, tmp_path / "a.jsonl", preset="default")
    assert one == dataset(env, tmp_path / "b.jsonl", preset="default", workers=2)
    assert not set(one) & set(dataset(env, tmp_path / "c.jsonl", preset="default", split="eval"))


def test_recipes_environment_name_prepares_scripted_rows(tmp_path):
    res = invoke_gymv("prepare", "example-multi-turn-gymnasium", "--preset", "tiny", "--n", "3", "--out",
                   tmp_path / "rows.jsonl", "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["env"] == "scripted" and len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3
