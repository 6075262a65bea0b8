"""MOPD routing: each sample reaches exactly one teacher by its agent name; an unroutable one is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymv.algorithms.mopd_routing import TeacherRouter, row_agent
from gymv.config import load_recipe
from gymv.errors import GymvError
from gymv.train.data import Row

TEACHERS = ("counting", "arith")
MAP = {"circle_count_simple_agent": "counting", "arithmetic_simple_agent": "arith"}


def test_strict_routing_sends_each_agent_to_its_mapped_teacher():
    r = TeacherRouter(TEACHERS, MAP)
    agents = ["circle_count_simple_agent", "arithmetic_simple_agent", "circle_count_simple_agent"]
    assert r.route(agents) == {"counting": [0, 2], "arith": [1]}


def test_strict_routing_refuses_an_unmapped_agent_naming_it_and_the_row():
    r = TeacherRouter(TEACHERS, MAP)
    with pytest.raises(GymvError, match="no teacher for agent 'circle_click_simple_agent'") as e:
        r.route(["circle_count_simple_agent", "circle_click_simple_agent"], ["row 4", "row 7"])
    assert e.value.where == "row 7" and "mopd.agent_to_teacher" in e.value.fix


def test_a_row_without_an_agent_name_is_refused_under_strict_matching():
    with pytest.raises(GymvError, match="has no agent_ref.name"):
        TeacherRouter(TEACHERS, MAP).alias_for(None)


def test_non_strict_routing_sends_unmapped_agents_to_the_default_teacher():
    r = TeacherRouter(TEACHERS, MAP, strict=False, default_alias="counting")
    assert r.route(["arithmetic_simple_agent", "circle_click_simple_agent", None]) == {"arith": [0], "counting": [1, 2]}


def test_mapped_agents_win_over_the_default():
    r = TeacherRouter(TEACHERS, MAP, strict=False, default_alias="counting")
    assert r.alias_for("arithmetic_simple_agent") == "arith"


def test_non_strict_routing_without_a_default_is_a_config_error():
    with pytest.raises(GymvError, match="no default_teacher_alias"):
        TeacherRouter(TEACHERS, MAP, strict=False)


def test_a_map_entry_naming_an_unknown_teacher_is_a_config_error():
    with pytest.raises(GymvError, match="routes to teacher 'clicking', which is not in mopd.teachers") as e:
        TeacherRouter(TEACHERS, {**MAP, "circle_click_simple_agent": "clicking"})
    assert e.value.where == "mopd.agent_to_teacher.circle_click_simple_agent"


def test_check_rows_routes_a_whole_dataset_up_front_and_counts_per_teacher():
    rows = [Row(0, {"agent_ref": {"name": "arithmetic_simple_agent"}}, "train.jsonl line 1"),
            Row(1, {}, "train.jsonl line 2"),
            Row(2, {"agent_ref": {"name": "circle_count_simple_agent"}}, "train.jsonl line 3")]
    counts = TeacherRouter(TEACHERS, MAP).check_rows(rows, default_agent="circle_count_simple_agent")
    assert counts == {"arith": 1, "counting": 2}


def test_check_rows_names_the_first_unroutable_row():
    rows = [Row(0, {"agent_ref": {"name": "arithmetic_simple_agent"}}, "train.jsonl line 1"),
            Row(1, {"agent_ref": {"name": "mystery_agent"}}, "train.jsonl line 2")]
    with pytest.raises(GymvError, match="'mystery_agent'") as e:
        TeacherRouter(TEACHERS, MAP).check_rows(rows)
    assert e.value.where == "train.jsonl line 2"


def test_row_agent_reads_agent_ref_name():
    assert row_agent({"agent_ref": {"type": "responses_api_agents", "name": "a"}}) == "a"
    assert row_agent({"agent_ref": {"name": ""}}) is None and row_agent({}) is None


def test_the_router_builds_from_a_loaded_recipe():
    rec = load_recipe(Path(__file__).resolve().parents[1] / "recipes/vlm/vlm_mopd-tinyllava-1n0g-torch.yaml")
    r = TeacherRouter.from_config(rec.validated.mopd)
    assert r.teachers == ("teacher",) and r.alias_for("circle_count_simple_agent") == "teacher"
