"""doorkey: a grid world seen in a picture after every move; key, locked door, goal; reward for reaching it."""

from __future__ import annotations

import json

import pytest

from envs_scripts import dataset, play, prompt_images, tiny_rows
from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, RowError, ToolCall, get_env
from gymv.envs.circles import COLORS
from gymv.envs.gridworld import World
from gymv.errors import GymvError

# Agent at (1,2), key at (1,3), door at (2,2), goal at (3,1): down (key), up, right (unlock), right, up.
GRID = ["#####",
        "#.#G#",
        "#AD.#",
        "#K#.#",
        "#####"]


@pytest.fixture(scope="module")
def env():
    return get_env("doorkey")


def row_of(grid, size=55):
    return {"responses_create_params": {"input": [{"role": "user", "content": "Go."}]}, "grid": grid,
            "image_size": size}


def moves(*directions):
    return [ModelTurn(tool_calls=[ToolCall("move", json.dumps({"direction": d}), f"c{i}")])
            for i, d in enumerate(directions)]


def test_shortest_path_fetches_the_key_before_the_door():
    assert World.parse(GRID).shortest_path() == ["down", "up", "right", "right", "up"]


def test_gold_episode_reaches_the_goal_for_full_reward_and_ends_there(env):
    state, score = play(env, row_of(GRID), env.gold_turns(row_of(GRID)) + moves("left"))
    assert state.done and state.turns == 5
    assert score.reward == 1.0 and score.extras == {"reached_goal": True, "moves": 5, "has_key": True, "door_open": True}


def test_the_locked_door_blocks_an_agent_without_the_key(env):
    state = env.start(row_of(GRID))
    (res,) = env.step(state, moves("right")[0]).tool_results
    assert "locked" in res.text and state.data["world"].agent == (1, 2)


def test_every_move_answers_with_a_picture_of_the_world_after_it(env):
    state = env.start(row_of(GRID))
    (res,) = env.step(state, moves("down")[0]).tool_results
    img = decode_data_url(res.images[0].url)
    assert img.size == (55, 55)
    # cell (1, 3) now holds the agent (red) carrying the key (a yellow mark at its centre)
    assert img.getpixel((11 + 2, 33 + 5)) == COLORS["red"] and img.getpixel((11 + 5, 33 + 5)) == COLORS["yellow"]


def test_walking_into_a_wall_does_not_move_the_agent(env):
    state = env.start(row_of(GRID))
    (res,) = env.step(state, moves("left")[0]).tool_results
    assert "wall" in res.text and state.data["world"].moves == 0


def test_episode_that_stops_short_of_the_goal_scores_zero(env):
    state, score = play(env, row_of(GRID), moves("down", "up") + [ModelTurn(text="I give up.")])
    assert state.done and score.reward == 0.0 and score.failure_reason == "goal_not_reached"
    assert score.extras["has_key"] and not score.extras["door_open"]


def test_several_moves_in_one_turn_all_count(env):
    calls = [ToolCall("move", json.dumps({"direction": d}), f"c{i}")
             for i, d in enumerate(["down", "up", "right", "right", "up"])]
    state, score = play(env, row_of(GRID), [ModelTurn(tool_calls=calls)])
    assert state.done and state.turns == 1 and score.reward == 1.0


def test_moves_the_tool_refuses_move_nothing_in_the_replay_either(env):
    bad = [ToolCall("move", '{"direction": "north"}', "a"), ToolCall("move", '{"direction": "down", "far": 1}', "b"),
           ToolCall("move", "not json", "c")]
    state, score = play(env, row_of(GRID), [ModelTurn(tool_calls=bad), ModelTurn(text="stop")])
    assert all(item.get("output", "").startswith('{"error"') for item in state.output
               if item.get("type") == "function_call_output")
    assert score.extras["moves"] == 0 and score.failure_reason == "no_moves"


def test_the_turn_budget_ends_an_episode_before_the_goal(env):
    short = get_env("doorkey", max_turns=3)
    state, score = play(short, row_of(GRID), short.gold_turns(row_of(GRID)))
    assert state.done and state.turns == 3 and score.reward == 0.0


def test_rescoring_by_verify_replays_the_moves_from_the_row(env):
    state, live = play(env, row_of(GRID), env.gold_turns(row_of(GRID)))
    assert env.verify({**row_of(GRID), "response": {"output": state.output}})["reward"] == live.reward == 1.0


@pytest.mark.parametrize("grid, message", [
    (["#####", "#A.G#", "#####"], "exactly one 'K'"),
    (["#####", "#AKDG", "#####"], "surrounded by walls"),
    (["#######", "#AK#DG#", "#######"], "cannot be reached"),
])
def test_a_grid_that_is_no_door_key_world_is_the_rows_fault(env, grid, message):
    with pytest.raises(RowError, match=message):
        env.start(row_of(grid))


def test_tiny_rows_are_5_by_5_grids_in_56_pixel_pictures_solvable_in_few_moves(env):
    rows = [r for _, r in tiny_rows(env, 30)]
    assert all(len(r["grid"]) == 5 and decode_data_url(prompt_images(r)[0]).size == (56, 56) for r in rows)
    assert all(1 <= r["optimal_moves"] <= 8 for r in rows)
    assert all(len(env.gold_turns(r)) == r["optimal_moves"] for r in rows)


def test_default_rows_are_8_by_8_and_vary_orientation(env):
    rows = [r for _, r in tiny_rows(env, 20, preset="default")]
    assert {len(r["grid"]) for r in rows} == {8}
    vertical = [any(line.count("#") == 3 for line in r["grid"][1:-1]) for r in rows]
    assert any(vertical) and not all(vertical)
    assert all(play(env, r, env.gold_turns(r))[1].reward == 1.0 for r in rows)


def test_prepare_is_byte_identical_across_worker_counts(env, tmp_path):
    assert dataset(env, tmp_path / "a.jsonl", workers=1) == dataset(env, tmp_path / "b.jsonl", workers=2)


def test_default_train_and_eval_splits_share_no_world(env, tmp_path):
    train = {tuple(json.loads(x)["grid"]) for x in dataset(env, tmp_path / "a.jsonl", preset="default")}
    held_out = {tuple(json.loads(x)["grid"]) for x in dataset(env, tmp_path / "b.jsonl", preset="default", split="eval")}
    assert len(train) == 40 and not train & held_out


def test_grid_smaller_than_5_is_refused(env):
    from gymv.envs.knobs import resolve_knobs

    with pytest.raises(GymvError, match="grid 4:4 must lie within 5:32"):
        resolve_knobs(env, "tiny", ["grid=4"])


def test_pictures_with_cells_of_a_few_pixels_still_render_every_mark():
    world = World.parse(GRID)
    world.move("down")
    for size in (5, 12, 20):
        assert decode_data_url(world.render(size)).size == (size, size)
