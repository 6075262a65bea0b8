"""`gymv prepare`: deterministic NeMo-Gym-format rows, disjoint splits, atomic output, preview, knobs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from gymv.data.generate import SPLIT_SPAN, RowGenerator, default_workers, row_seeds, write_dataset
from gymv.envs import Environment, ModelTurn, Score, get_env
from gymv.envs.knobs import resolve_knobs
from gymv.errors import GymvError
from conftest import invoke_gymv


def _structure(value):
    """The shape of a JSON value: keys and types, with lists reduced to the shapes of their items."""
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes = []
        for item in value:
            s = _structure(item)
            if s not in shapes:
                shapes.append(s)
        return shapes
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_arguments_give_a_byte_identical_file(tmp_path):
    args = ["prepare", "circle-count", "--preset", "tiny", "--n", "40", "--seed", "7"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke_gymv(*args, "--out", a).code == 0
    assert invoke_gymv(*args, "--out", b).code == 0
    assert a.read_bytes() == b.read_bytes()


def test_worker_count_does_not_change_the_file(tmp_path):
    env = get_env("circle-click")
    knobs = resolve_knobs(env, "tiny")
    write_dataset(tmp_path / "one.jsonl", env, knobs, n=80, workers=1)
    write_dataset(tmp_path / "two.jsonl", env, knobs, n=80, workers=2)
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()


def test_rows_are_made_on_all_cores():
    """In a fresh single-threaded interpreter, as `gymv prepare` runs (earlier tests may leave threads here)."""
    code = (
        "from gymv.envs import get_env\n"
        "from gymv.envs.knobs import resolve_knobs\n"
        "from gymv.data.generate import RowGenerator, row_seeds, default_workers\n"
        "env = get_env('circle-count')\n"
        "with RowGenerator(env, resolve_knobs(env, 'tiny'), row_seeds('train', 0, 200)) as gen:\n"
        "    print(gen.processes, default_workers(), len(list(gen)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    processes, cores, rows = map(int, out)
    assert processes == cores and rows == 200


def test_a_caller_with_running_threads_gets_the_same_file_made_in_process(tmp_path):
    env = get_env("circle-count")
    knobs = resolve_knobs(env, "tiny")
    write_dataset(tmp_path / "plain.jsonl", env, knobs, n=100, workers=1)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with RowGenerator(env, knobs, row_seeds("train", 0, 100), workers=2) as gen:
            assert gen.processes == 1
        write_dataset(tmp_path / "threaded.jsonl", env, knobs, n=100, workers=2)
    finally:
        stop.set()
        thread.join()
    assert (tmp_path / "plain.jsonl").read_bytes() == (tmp_path / "threaded.jsonl").read_bytes()


def test_a_row_depends_only_on_its_own_seed(tmp_path):
    env = get_env("circle-count")
    knobs = resolve_knobs(env, "tiny")
    write_dataset(tmp_path / "all.jsonl", env, knobs, n=10, workers=1)
    write_dataset(tmp_path / "tail.jsonl", env, knobs, n=5, seed=5, workers=1)
    assert _rows(tmp_path / "all.jsonl")[5:] == _rows(tmp_path / "tail.jsonl")


@pytest.mark.parametrize("env", ["circle_count", "circle_click"])
def test_rows_have_the_structure_of_nemo_gym_example_rows(tmp_path, vectors, env):
    theirs = _rows(vectors / "nemo_gym" / env / "example.jsonl")
    out = tmp_path / "rows.jsonl"
    assert invoke_gymv("prepare", env, "--n", "5", "--out", out).code == 0
    ours = _rows(out)
    ours_shape = _structure(ours)
    for row in theirs:  # NeMo Gym's circle_click example rows carry no agent_ref; gymv's always do
        row.setdefault("agent_ref", {"type": "responses_api_agents", "name": f"{env}_simple_agent"})
    assert ours_shape == _structure(theirs)
    assert [list(r) for r in ours] == [list(r) for r in theirs]  # same keys in the same order
    ours_system, theirs_system = (r[0]["responses_create_params"]["input"][0] for r in (ours, theirs))
    assert ours_system["role"] == theirs_system["role"] and type(ours_system["content"]) is type(theirs_system["content"])
    assert _tool_signatures(ours[0]) == _tool_signatures(theirs[0])


def _tool_signatures(row: dict) -> list:
    """What a server relies on: tool names and argument schemas (the wording of descriptions is gymv's own)."""
    out = []
    for tool in row["responses_create_params"].get("tools") or []:
        params = tool["parameters"]
        props = {k: v["type"] for k, v in params["properties"].items()}
        out.append((tool["type"], tool["name"], props, sorted(params.get("required", [])), tool.get("strict")))
    return out


def test_images_are_png_data_urls_in_input_image_parts_with_detail_auto(tmp_path):
    out = tmp_path / "rows.jsonl"
    invoke_gymv("prepare", "circle-click", "--preset", "tiny", "--n", "3", "--out", out)
    part = _rows(out)[0]["responses_create_params"]["input"][0]["content"][0]
    assert part["type"] == "input_image" and part["detail"] == "auto"
    assert part["image_url"].startswith("data:image/png;base64,iVBORw0KGgo")


def test_train_and_eval_row_seeds_are_disjoint_by_construction():
    train, eval_ = row_seeds("train", 0, 1000), row_seeds("eval", 0, 1000)
    assert not set(train) & set(eval_)
    assert row_seeds("eval", 0, 1).start == SPLIT_SPAN


def test_train_and_eval_files_with_the_same_seed_differ(tmp_path):
    for split in ("train", "eval"):
        assert invoke_gymv("prepare", "circle-count", "--preset", "tiny", "--n", "5", "--split", split,
                        "--out", tmp_path / f"{split}.jsonl").code == 0
    assert (tmp_path / "train.jsonl").read_bytes() != (tmp_path / "eval.jsonl").read_bytes()


def test_a_train_seed_range_reaching_into_eval_is_refused(tmp_path):
    r = invoke_gymv("prepare", "circle-count", "--n", "10", "--seed", str(SPLIT_SPAN - 5), "--out", tmp_path / "x.jsonl")
    assert r.code == 2
    assert "overlap the eval split" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_an_eval_seed_range_reaching_into_train_is_refused():
    with pytest.raises(GymvError, match="overlap the train split"):
        row_seeds("eval", -3, 10)


def test_unknown_split_is_refused():
    with pytest.raises(GymvError, match="unknown split 'test'"):
        row_seeds("test", 0, 10)


class _FailsAtRowFive(Environment):
    name = "fails-at-five"
    agent_name = "x"

    presets = {"default": None}

    def make_row(self, rng, knobs, index):
        if index == 5:
            raise RuntimeError("generator bug")
        return {"i": index}

    def score_output(self, row, output):
        return Score(0.0)

    def gold_turn(self, row):
        return ModelTurn()


def test_a_failure_mid_way_leaves_the_previous_file_untouched(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text("previous\n")
    with pytest.raises(RuntimeError, match="generator bug"):
        write_dataset(out, _FailsAtRowFive(), None, n=10, workers=1)
    assert out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_preview_writes_a_contact_sheet_of_the_first_rows(tmp_path):
    r = invoke_gymv("prepare", "circle-count", "--preset", "tiny", "--n", "30", "--out", tmp_path / "r.jsonl",
                 "--preview", tmp_path / "p.png", "--preview-count", "6")
    assert r.code == 0, r.stderr
    with Image.open(tmp_path / "p.png") as sheet:
        assert sheet.size == (4 * 240, 2 * (240 + 6 * 14))


def test_knob_overrides_reach_the_rows(tmp_path):
    out = tmp_path / "r.jsonl"
    r = invoke_gymv("prepare", "circle-count", "--preset", "tiny", "--n", "20", "--out", out, "circles=3", "radius=5")
    assert r.code == 0, r.stderr
    assert all(len(row["circles"]) == 3 and row["circles"][0]["radius"] == 5 for row in _rows(out))


def test_bad_knob_is_a_one_line_error(tmp_path):
    r = invoke_gymv("prepare", "circle-count", "--n", "2", "--out", tmp_path / "r.jsonl", "circles=lots")
    last = r.stderr.strip().splitlines()[-1]
    assert r.code == 2 and last.startswith("error: knob circles='lots'") and "circles=LO:HI" in last


def test_json_summary_reports_rows_seeds_and_rate(tmp_path):
    r = invoke_gymv("prepare", "circle-click", "--preset", "tiny", "--n", "12", "--split", "eval", "--seed", "3",
                 "--out", tmp_path / "r.jsonl", "--json")
    summary = json.loads(r.stdout)
    assert (summary["rows"], summary["split"], summary["seeds"]) == (12, "eval", [3, 14])
    assert summary["rows_per_second"] > 0


def test_list_knobs_shows_the_preset_values():
    r = invoke_gymv("prepare", "circle-count", "--preset", "tiny", "--list-knobs", "--json")
    knobs = json.loads(r.stdout)["knobs"]
    assert (knobs["image_size"], knobs["circles"], knobs["colors"]) == ([56, 56], [1, 3], [1, 1])


def test_missing_n_or_out_is_a_usage_error():
    r = invoke_gymv("prepare", "circle-count")
    assert r.code == 2 and "--n and --out are required" in r.stderr


def test_progress_bar_goes_to_stderr_and_stdout_stays_clean_for_json(tmp_path):
    r = invoke_gymv("prepare", "circle-count", "--preset", "tiny", "--n", "50", "--out", tmp_path / "r.jsonl", "--json")
    assert "circle-count train" in r.stderr
    json.loads(r.stdout)


def test_generated_rows_are_accepted_back_by_the_environment(tmp_path):
    env = get_env("circle-click")
    write_dataset(tmp_path / "r.jsonl", env, resolve_knobs(env, "default"), n=3, workers=1)
    for row in _rows(tmp_path / "r.jsonl"):
        from gymv.envs.rows import check_images

        assert check_images(row) == 1
        assert env.start(row).messages[-1].images


def test_make_row_uses_nothing_but_its_rng():
    env = get_env("circle-count")
    knobs = resolve_knobs(env, "default")
    assert env.make_row(random.Random(11), knobs, 0) == env.make_row(random.Random(11), knobs, 99)
