"""`gymv prepare mix`: several environments' rows in one file, deterministic, evenly interleaved, disjoint splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gymv.data.generate import write_dataset
from gymv.envs.mix import MixPart, interleave_order, parse_mix_spec, write_mixed_dataset
from gymv.envs import get_env
from gymv.envs.knobs import resolve_knobs
from gymv.errors import GymvError
from conftest import invoke_gymv

SPEC = [MixPart("circle-count", "tiny", 6), MixPart("arithmetic", "tiny", 3)]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _agent(line: str) -> str:
    return json.loads(line)["agent_ref"]["name"]


def test_the_same_spec_gives_a_byte_identical_file(tmp_path):
    args = ["prepare", "mix", "circle-count:tiny:20", "arithmetic:tiny:20", "--seed", "3"]
    assert invoke_gymv(*args, "--out", tmp_path / "a.jsonl").code == 0
    assert invoke_gymv(*args, "--out", tmp_path / "b.jsonl").code == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_each_part_holds_exactly_the_rows_single_environment_prepare_writes(tmp_path):
    write_mixed_dataset(tmp_path / "mix.jsonl", SPEC, seed=5)
    mixed = _lines(tmp_path / "mix.jsonl")
    for part, agent in ((SPEC[0], "circle_count_simple_agent"), (SPEC[1], "arithmetic_simple_agent")):
        env = get_env(part.env)
        write_dataset(tmp_path / "one.jsonl", env, resolve_knobs(env, part.preset), n=part.n, seed=5, workers=1)
        assert [x for x in mixed if _agent(x) == agent] == _lines(tmp_path / "one.jsonl")


def test_parts_are_interleaved_in_proportion_to_their_sizes():
    assert interleave_order([2, 2]) == [0, 1, 0, 1]
    assert interleave_order([6, 3]) == [0, 0, 1, 0, 0, 1, 0, 0, 1]
    order = interleave_order([300, 100])
    assert all(order[k:k + 4].count(1) == 1 for k in range(0, 400, 4))


def test_train_and_eval_mixes_share_no_row(tmp_path):
    write_mixed_dataset(tmp_path / "train.jsonl", SPEC, split="train")
    write_mixed_dataset(tmp_path / "eval.jsonl", SPEC, split="eval")
    circles = lambda p: {x for x in _lines(p) if "circles" in json.loads(x)}  # noqa: E731
    assert circles(tmp_path / "train.jsonl").isdisjoint(circles(tmp_path / "eval.jsonl"))


def test_parts_parse_from_separate_or_comma_separated_items_with_a_default_preset():
    assert parse_mix_spec(["circle-count:tiny:5,arithmetic:7"]) == [
        MixPart("circle-count", "tiny", 5), MixPart("arithmetic", "default", 7)]


@pytest.mark.parametrize("spec, message", [
    (["circle-count:tiny:5"], "at least two parts"),
    (["circle-count:tiny:five", "arithmetic:2"], "not an integer"),
    (["circle-count:tiny:5", "circle_count:tiny:2"], "repeats"),
    (["circle-count", "arithmetic:2"], "is not ENV:N"),
])
def test_a_bad_spec_is_refused_with_the_format(spec, message):
    with pytest.raises(GymvError, match=message):
        parse_mix_spec(spec)


def test_cli_reports_parts_as_json(tmp_path):
    r = invoke_gymv("prepare", "mix", "circle-count:tiny:4", "arithmetic:tiny:2", "--out", tmp_path / "m.jsonl", "--json")
    assert r.code == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["rows"] == 6 and [p["env"] for p in got["parts"]] == ["circle-count", "arithmetic"]


def test_cli_refuses_options_a_mix_does_not_take(tmp_path):
    r = invoke_gymv("prepare", "mix", "circle-count:tiny:4", "arithmetic:tiny:2", "--n", "3", "--out", tmp_path / "m.jsonl")
    assert r.code != 0 and "does not take --n" in r.stderr
