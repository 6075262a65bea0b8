"""The environment registry: built-ins, names with _ or -, entry-point plugins, broken plugins, row routing."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from gymv.envs import available, env_for_row, get_env
from gymv.errors import GymvError
from conftest import run_gymv

PLUGIN = '''
from gymv.envs import Environment, ModelTurn, Score


class EchoEnv(Environment):
    name = "echo-env"
    agent_name = "echo_agent"
    verifier_fields = ("word",)
    description = "say the word"

    def score_output(self, row, output):
        from gymv.envs.rows import output_text
        return Score(float(row["word"] in output_text(output)))

    def gold_turn(self, row):
        return ModelTurn(text=row["word"])


def broken():
    raise RuntimeError("plugin exploded")
'''


def _plugin_dir(tmp_path: Path) -> Path:
    """A real installed-distribution layout (package + dist-info with entry_points.txt) on a path entry."""
    root = tmp_path / "site"
    (root / "echo_env_pkg").mkdir(parents=True)
    (root / "echo_env_pkg" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "echo_env_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-env-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[gymv.envs]\necho-env = echo_env_pkg:EchoEnv\nbroken-env = echo_env_pkg:broken\n")
    return root


def test_builtins_are_available():
    assert {"circle-count", "circle-click"} <= set(available())


def test_nemo_gym_style_underscore_names_resolve():
    assert get_env("circle_count").name == "circle-count"


def test_unknown_environment_is_an_error_listing_the_known_ones():
    with pytest.raises(GymvError, match="unknown environment 'nope'.*circle-count"):
        get_env("nope")


def _install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "echo_env_pkg", raising=False)
    monkeypatch.syspath_prepend(str(_plugin_dir(tmp_path)))


def test_entry_point_plugin_is_found_and_instantiated(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch)
    assert available()["echo-env"] == "echo_env_pkg:EchoEnv"
    assert get_env("echo-env").gold_answer({"word": "hi"}) == "hi"


def test_plugin_that_fails_to_build_is_a_clear_error(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch)
    with pytest.raises(GymvError, match="plugin exploded"):
        get_env("broken-env")


def test_plugin_appears_in_env_list_of_the_real_cli(tmp_path):
    r = run_gymv("env", "list", "--json", env={"PYTHONPATH": str(_plugin_dir(tmp_path))})
    assert r.code == 0, r.stderr
    names = {e["name"]: e for e in json.loads(r.stdout)}
    assert names["echo-env"]["description"] == "say the word"
    assert names["broken-env"]["description"].startswith("(broken")


def test_rows_route_by_agent_ref():
    row = {"agent_ref": {"type": "responses_api_agents", "name": "circle_click_simple_agent"}}
    assert env_for_row(row).name == "circle-click"


def test_rows_without_agent_ref_route_by_their_fields_and_tools():
    base = {"circles": [], "target_color": "red"}
    assert env_for_row({**base, "responses_create_params": {"input": "x", "tools": []}}).name == "circle-count"
    clicky = {**base, "responses_create_params": {"input": "x", "tools": get_env("circle-click").tools()}}
    assert env_for_row(clicky).name == "circle-click"


def test_unrecognisable_row_routes_nowhere():
    assert env_for_row({"foo": 1}) is None


def test_an_entry_point_of_gymv_envs_is_found_through_the_shared_registry_under_either_spelling():
    from gymv.envs.registry import ENVIRONMENTS
    from train_helpers import plugin_on_path

    with plugin_on_path():
        assert ENVIRONMENTS.available()["even-length"] == "gymv_train_testenv:EvenLength"
        assert ENVIRONMENTS.load("Even_Length").__name__ == "EvenLength"
        assert get_env("even_length").name == "even-length"


def test_a_builtin_environment_cannot_be_taken_over_under_its_alias_or_another_spelling():
    from gymv.envs import register

    for name in ("Circle_Count", "example_multi_turn_gymnasium"):
        with pytest.raises(GymvError, match="built in"):
            register(name, object)
