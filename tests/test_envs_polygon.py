"""polygon-naming: two pictures in the prompt, the third only through get_picture; name every polygon."""

from __future__ import annotations

import json

import pytest

from envs_scripts import dataset, play, prompt_images, tiny_rows
from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, ToolCall, get_env
from gymv.envs.knobs import resolve_knobs
from gymv.errors import GymvError


@pytest.fixture(scope="module")
def env():
    return get_env("polygon-naming")


@pytest.fixture(scope="module")
def row(env):
    return tiny_rows(env, 1, seed=3)[0][1]


def names(row) -> list[str]:
    return [f"{p['color']} {p['shape']}" for p in row["polygons"]]


FETCH = ModelTurn(tool_calls=[ToolCall("get_picture", '{"index": 3}', "c1")])


def test_tiny_prompt_shows_pictures_one_and_two_at_56_pixels_and_offers_the_tool(row):
    images = prompt_images(row)
    assert len(images) == 2
    assert all(decode_data_url(u).size == (56, 56) for u in images)
    assert [t["name"] for t in row["responses_create_params"]["tools"]] == ["get_picture"]


def test_the_third_picture_comes_only_from_the_tool(env, row):
    state = env.start(row)
    result = env.step(state, FETCH)
    (tool,) = result.tool_results
    third = tool.images[0].url
    assert third not in json.dumps(row)  # the row never carries picture 3
    assert third not in prompt_images(row)
    assert third == env.picture(row, 3) and not result.done


def test_the_picture_the_tool_returns_shows_the_third_polygon_color(env, row):
    img = decode_data_url(env.picture(row, 3))
    from gymv.envs.circles import COLORS

    assert img.getpixel((28, 28)) == COLORS[row["polygons"][2]["color"]]


def test_gold_episode_fetches_then_names_all_three_for_full_reward(env, row):
    state, score = play(env, row, env.gold_turns(row))
    assert state.done and state.turns == 2
    assert score.reward == 1.0 and score.failure_reason is None and score.extras["fetched_third"]


def test_each_picture_named_right_earns_a_third(env, row):
    a, b, _ = names(row)
    _, score = play(env, row, [FETCH, ModelTurn(text=f"1: {a}\n2: {b}\n3: pink octagon")])
    assert score.reward == pytest.approx(2 / 3) and score.extras["correct"] == [True, True, False]
    assert score.failure_reason == "wrong_names"


def test_naming_the_third_without_fetching_it_does_not_count(env, row):
    a, b, c = names(row)
    _, score = play(env, row, [ModelTurn(text=f"1: {a}\n2: {b}\n3: {c}")])
    assert score.reward == pytest.approx(2 / 3) and score.failure_reason == "third_not_fetched"


def test_labels_name_pictures_in_any_order_and_unlabelled_pairs_go_by_position(env, row):
    a, b, c = names(row)
    _, labelled = play(env, row, [FETCH, ModelTurn(text=f"3) {c.upper()}; 1. {a}; 2: {b}.")])
    _, plain = play(env, row, [FETCH, ModelTurn(text=f"They are a {a}, a {b} and a {c}.")])
    assert labelled.reward == plain.reward == 1.0


def test_only_the_final_turn_is_read_as_the_answer(env, row):
    a, b, c = names(row)
    early = ModelTurn(text=f"1: {a}\n2: {b}\n3: {c}", tool_calls=[ToolCall("get_picture", '{"index": 3}', "c1")])
    _, score = play(env, row, [early, ModelTurn(text="I am not sure.")])
    assert score.reward == 0.0 and score.failure_reason == "no_answer"


def test_index_outside_one_to_three_is_a_tool_error_the_model_reads(env, row):
    state = env.start(row)
    (res,) = env.step(state, ModelTurn(tool_calls=[ToolCall("get_picture", '{"index": 4}', "c1")])).tool_results
    assert res.error and "at most 3" in res.error and not res.images


def test_rescoring_the_transcript_by_verify_matches_the_live_score(env, row):
    a, b, _ = names(row)
    state, live = play(env, row, [FETCH, ModelTurn(text=f"1: {a}\n2: {b}")])
    verified = env.verify({**row, "response": {"output": state.output}})
    assert verified["reward"] == live.reward == pytest.approx(2 / 3)


def test_default_preset_draws_rotated_polygons_of_any_shape_on_512_pixel_pictures(env):
    rows = [r for _, r in tiny_rows(env, 20, preset="default")]
    assert {decode_data_url(prompt_images(r)[0]).size for r in rows} == {(512, 512)}
    polys = [p for r in rows for p in r["polygons"]]
    assert len({p["shape"] for p in polys}) >= 5 and len({p["rotation"] for p in polys}) > 10
    assert all(len({(p["color"], p["shape"]) for p in r["polygons"]}) == 3 for r in rows)


def test_prepare_is_byte_identical_across_worker_counts(env, tmp_path):
    one = dataset(env, tmp_path / "a.jsonl", workers=1)
    assert one == dataset(env, tmp_path / "b.jsonl", workers=2) and len(one) == 40


def test_default_train_and_eval_splits_share_no_row(env, tmp_path):
    train = dataset(env, tmp_path / "a.jsonl", preset="default")
    assert not set(train) & set(dataset(env, tmp_path / "b.jsonl", preset="default", split="eval"))


def test_knobs_that_cannot_make_three_distinct_polygons_are_refused(env):
    with pytest.raises(GymvError, match="at least 3 distinct polygons"):
        resolve_knobs(env, "tiny", ["shapes=square", "palette=red"])
