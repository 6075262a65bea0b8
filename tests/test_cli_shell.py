"""The CLI shell: version, plugin discovery through entry points, and error rendering."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer

import gymv
from conftest import invoke_gymv, run_gymv


def test_version_flag_prints_package_version():
    r = invoke_gymv("--version")
    assert r.code == 0
    assert r.stdout.strip() == f"gymv {gymv.__version__}"


def test_help_lists_builtin_commands():
    r = invoke_gymv("--help")
    assert r.code == 0
    for name in ("prepare", "env", "lint", "dry-run", "model"):
        assert name in r.stdout


def _install_plugin(tmp_path: Path, body: str) -> Path:
    """Build and pip-install a real plugin distribution into its own target folder."""
    src = tmp_path / "src"
    (src / "gymv_hello").mkdir(parents=True)
    (src / "gymv_hello" / "__init__.py").write_text(textwrap.dedent(body))
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "gymv-hello"
        version = "0.0.1"
        [project.entry-points."gymv.commands"]
        hello = "gymv_hello:hello"
        [tool.setuptools]
        packages = ["gymv_hello"]
    """))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True, capture_output=True,
    )
    return target


@pytest.mark.slow
def test_separately_installed_plugin_appears_in_help_and_runs(tmp_path):
    site = _install_plugin(tmp_path, '''
        import typer
        def hello(name: str = typer.Option("world", help="Who to greet.")):
            """Say hello (a third-party command)."""
            print(f"hello {name}")
    ''')
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    help_out = run_gymv("--help", env=env)
    assert "hello" in help_out.stdout
    r = run_gymv("hello", "--name", "gymv", env=env)
    assert r.code == 0, r.stderr
    assert r.stdout.strip() == "hello gymv"


@pytest.mark.slow
def test_plugin_that_fails_to_import_warns_once_and_cli_still_works(tmp_path):
    site = _install_plugin(tmp_path, "raise RuntimeError('boom at import')\n")
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = run_gymv("--help", env=env)
    assert r.code == 0
    assert r.stderr.count("warning: command plugin 'hello'") == 1
    assert "boom at import" in r.stderr
    assert "prepare" in r.stdout


def test_a_command_of_the_gymv_commands_entry_point_group_is_found_through_the_shared_registry_after_the_builtins():
    from typer.testing import CliRunner

    from gymv_cli.plugins import BUILTINS, COMMANDS, command_names, mount_plugins
    from train_helpers import plugin_on_path

    with plugin_on_path():
        assert COMMANDS.available()["hello-plugin"] == "gymv_registry_command:hello"
        names = command_names()
        assert names[:len(BUILTINS)] == list(BUILTINS) and "hello-plugin" in names[len(BUILTINS):]
        app = typer.Typer()
        assert "hello-plugin" in mount_plugins(app, warn=pytest.fail)
        r = CliRunner().invoke(app, ["hello-plugin", "--name", "gymv"])
    assert r.exit_code == 0 and r.output.strip() == "hello gymv"


def test_unknown_command_is_a_usage_error_without_traceback():
    r = invoke_gymv("no-such-command")
    assert r.code == 2
    assert "Traceback" not in r.stderr


def test_debug_after_the_subcommand_is_accepted_and_shows_the_traceback():
    r = invoke_gymv("prepare", "circle-count", "--debug")
    assert "No such option" not in r.stderr
    assert r.code != 0
    assert "Traceback" in r.stderr and "--n and --out are required" in r.stderr


def test_without_debug_the_same_error_is_one_line():
    r = invoke_gymv("prepare", "circle-count")
    assert r.code != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--n and --out are required" in r.stderr


def test_debug_after_a_double_dash_is_left_to_the_command():
    from gymv_cli.main import split_debug

    assert split_debug(["train", "r.yaml", "--debug", "--", "--debug"]) == (["train", "r.yaml", "--", "--debug"], True)
    assert split_debug(["train", "--", "--debug"]) == (["train", "--", "--debug"], False)


HEAVY = ("torch", "transformers", "ray")


@pytest.mark.parametrize("args", [
    ["lint", "recipes/grpo.yaml"],
    ["dry-run", "nightly"],
    ["train", "missing.yaml"],
    ["train", "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", "grpo.max_stepz=3"],
    ["smoke", "missing.yaml"],
    ["env", "verify", "missing.jsonl"],
], ids=lambda a: " ".join(a))
def test_commands_that_only_read_yaml_or_fail_on_it_never_import_torch(args):
    """torch takes 5-15 s to import on a loaded machine: a typo or a missing file must not wait for it."""
    code = textwrap.dedent(f"""
        import sys
        from gymv_cli.main import main
        sys.argv = ["gymv", *{args!r}]
        try:
            main()
        except SystemExit:
            pass
        print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.stderr.strip().splitlines()[-1] == "HEAVY []", p.stderr[-2000:]
