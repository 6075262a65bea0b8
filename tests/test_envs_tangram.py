"""tangram: one question about a picture of colored tangram pieces, answered in \\boxed{}."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from envs_scripts import dataset, play, prompt_images, tiny_rows
from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, RowError, get_env
from gymv.envs.circles import COLORS
from gymv.envs.knobs import resolve_knobs
from gymv.envs.shapes import Canvas
from gymv.envs.tangram import PIECES


@pytest.fixture(scope="module")
def env():
    return get_env("tangram")


def row_with(env, answer="red", kind="color_of"):
    return {"responses_create_params": {"input": [{"role": "user", "content": "What color is the square?"}]},
            "pieces": [{"piece": "square", "color": "red", "points": []}], "question_kind": kind,
            "expected_answer": answer}


def test_the_seven_pieces_tile_the_square_exactly():
    # Each piece drawn alone at 100 px per unit: every pixel of the 400x400 square is covered once
    # (up to the shared edges, which PIL draws on both sides).
    cover = np.zeros((400, 400), dtype=int)
    for _, pts in PIECES:
        c = Canvas(400)
        c.polygon([(x * 100, y * 100) for x, y in pts], "red")
        cover += np.asarray(decode_data_url(c.data_url()).convert("L")) != 255
    assert (cover >= 1).mean() == 1.0 and (cover >= 2).mean() < 0.02
    kinds = Counter(name for name, _ in PIECES)
    assert kinds == {"large triangle": 2, "small triangle": 2, "medium triangle": 1, "square": 1, "parallelogram": 1}


def test_gold_answer_earns_full_reward_on_every_generated_row(env):
    for preset in ("tiny", "default"):
        for _, row in tiny_rows(env, 30, preset=preset):
            assert play(env, row, [env.gold_turn(row)])[1].reward == 1.0


@pytest.mark.parametrize("text, reward", [
    ("\\boxed{red}", 1.0), ("It is \\boxed{ Red. }", 1.0), ("\\boxed{the red}", 1.0),
    ("\\boxed{blue} or \\boxed{red}", 0.0), ("red", 0.0), ("\\boxed{dark red}", 0.0),
])
def test_the_first_boxed_answer_is_compared_after_normalising_case_spaces_and_articles(env, text, reward):
    assert play(env, row_with(env), [ModelTurn(text=text)])[1].reward == reward


def test_numbers_compare_as_integers(env):
    assert play(env, row_with(env, "3", "count_color"), [ModelTurn(text="\\boxed{03}")])[1].reward == 1.0


def test_a_wrong_or_missing_answer_says_why(env):
    assert play(env, row_with(env), [ModelTurn(text="\\boxed{blue}")])[1].failure_reason == "wrong_answer"
    assert play(env, row_with(env), [ModelTurn(text="red")])[1].failure_reason == "no_boxed_answer"


def test_expected_answers_match_the_pieces_drawn(env):
    for _, row in tiny_rows(env, 40, preset="default"):
        pieces, kind, answer = row["pieces"], row["question_kind"], row["expected_answer"]
        colors = [p["color"] for p in pieces]
        text = row["responses_create_params"]["input"][-1]["content"][1]["text"]
        if kind == "count_triangles":
            assert answer == str(sum("triangle" in p["piece"] for p in pieces))
        elif kind == "count_color":
            assert any(answer == str(colors.count(c)) and c in text for c in colors)
        elif kind == "color_of":
            (p,) = [p for p in pieces if f"the {p['piece']}?" in text]
            assert answer == p["color"]
        else:
            (p,) = [p for p in pieces if f" {p['color']}?" in text]
            assert answer == p["piece"] and colors.count(p["color"]) == 1


def test_square_layout_uses_all_seven_pieces_and_the_picture_shows_their_colors(env):
    knobs = resolve_knobs(env, "default", ["layouts=square", "outline=false", "image_size=200"])
    import random

    row = env.make_row(random.Random(5), knobs, 0)
    assert len(row["pieces"]) == 7
    img = decode_data_url(prompt_images(row)[0])
    drawn = {img.getpixel((x, y)) for x in range(0, 200, 4) for y in range(0, 200, 4)} - {(255, 255, 255)}
    assert drawn == {COLORS[p["color"]] for p in row["pieces"]}


def test_tiny_rows_are_56_pixel_pictures_of_at_most_three_pieces_in_three_colors(env):
    rows = [r for _, r in tiny_rows(env, 30)]
    assert all(decode_data_url(prompt_images(r)[0]).size == (56, 56) for r in rows)
    assert all(1 <= len(r["pieces"]) <= 3 and {p["color"] for p in r["pieces"]} <= {"red", "green", "blue"}
               for r in rows)


def test_row_without_an_expected_answer_is_the_rows_fault(env):
    with pytest.raises(RowError, match="expected_answer"):
        env.start({**row_with(env), "expected_answer": ""})


def test_prepare_is_byte_identical_across_worker_counts_and_splits_share_no_row(env, tmp_path):
    one = dataset(env, tmp_path / "a.jsonl", preset="default")
    assert one == dataset(env, tmp_path / "b.jsonl", preset="default", workers=2)
    assert not set(one) & set(dataset(env, tmp_path / "c.jsonl", preset="default", split="eval"))
    assert {json.loads(x)["layout"] for x in one} == {"square", "scattered"}
