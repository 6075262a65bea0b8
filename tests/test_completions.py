"""Shell completions: generated from the live command tree, committed fresh, and working in real shells."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from enum import Enum
from pathlib import Path

import pytest
import typer

from gymv_cli.completions import FILENAMES, command_tree, render
from conftest import REPO

COMPLETIONS = REPO / "completions"
needs_zsh = pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
needs_fish = pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")


def bash_complete(script: Path, words: list[str], cwd: Path) -> list[str]:
    """Source the script in a real bash, set COMP_WORDS/COMP_CWORD as readline would, and call the function."""
    prog = f'source {script}; COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); _gymv; printf "%s\\n" "${{COMPREPLY[@]}}"'
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog, "_", *words], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return sorted(line for line in p.stdout.splitlines() if line)


def fish_complete(script: Path, line: str, cwd: Path) -> list[str]:
    p = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C {line!r}"],
                       cwd=cwd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return sorted(x.split("\t")[0] for x in p.stdout.splitlines() if x)


# Drives an interactive zsh in a pseudo-terminal with the real completion system (compinit + the _gymv file
# on $fpath), presses TAB, and records the matches compsys adds (through a pass-through compadd wrapper).
ZSH_HARNESS = r'''
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PROMPT='%% '; fpath=($1 \$fpath); autoload -Uz compinit; compinit -u -D; cd $2"
zpty -w z 'compadd() { local -a __m; builtin compadd -O __m "$@"; (( $#__m )) && print -l -- "" "MATCH:"${^__m}; builtin compadd "$@"; }'
zpty -w z 'echo READY'
local line out=""
for i in {1..100}; do
  zpty -r -t z line 2>/dev/null && out+=$line || sleep 0.05
  [[ $out == *$'\nREADY'* ]] && break
done
zpty -w -n z "$3"$'\t'
out=""
for i in {1..20}; do sleep 0.1; while zpty -r -t z line; do out+=$line; done; [[ $out == *MATCH:* ]] && break; done
sleep 0.2
while zpty -r -t z line; do out+=$line; done
print -r -- "$out" | tr -d '\r' | grep -a '^MATCH:' | sed 's/^MATCH://' | sort -u
zpty -d z
'''


def zsh_complete(fpath_dir: Path, line: str, cwd: Path) -> list[str]:
    harness = cwd / ".zsh_harness.zsh"
    harness.write_text(ZSH_HARNESS)
    p = subprocess.run(["zsh", "-f", str(harness), str(fpath_dir), str(cwd), line], capture_output=True, text=True, timeout=30)
    return sorted(x for x in p.stdout.splitlines() if x)


@pytest.fixture
def project(tmp_path) -> Path:
    """A working directory with recipes/suites holding two suites."""
    (tmp_path / "recipes/suites").mkdir(parents=True)
    for name in ("nightly", "release"):
        (tmp_path / "recipes/suites" / f"{name}.txt").write_text("llm/x.yaml\n")
    return tmp_path


# -- the committed scripts ------------------------------------------------------------------------


def test_committed_completion_scripts_are_fresh(gymv):
    r = gymv("completion", "--check", "completions", cwd=REPO)
    assert r.code == 0, r.stderr + "\n(refresh with: gymv completion --write completions)"


def test_a_stale_script_is_reported_with_the_refresh_command(gymv, tmp_path):
    for name in FILENAMES.values():
        shutil.copy(COMPLETIONS / name, tmp_path / name)
    (tmp_path / "gymv.fish").write_text("# edited by hand\n")
    r = gymv("completion", "--check", tmp_path)
    assert r.code == 1
    assert f"{tmp_path / 'gymv.fish'}" in r.stderr and "gymv completion --write" in r.stderr


def test_printed_script_lists_every_mounted_subcommand(gymv):
    from gymv_cli.main import build_app

    mounted = list(typer.main.get_command(build_app()).commands)
    script = gymv("completion", "bash").stdout
    root_line = next(line for line in script.splitlines() if line.strip().startswith("'')"))
    assert root_line.split("echo ", 1)[1].strip(" ;'").split() == mounted


def test_completion_without_a_shell_or_directory_is_a_usage_error(gymv):
    r = gymv("completion")
    assert r.code == 2
    assert "Traceback" not in r.stderr and "exactly one of" in r.stderr


# -- bash, on the committed script ------------------------------------------------------------------


def test_bash_completes_subcommands(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "dr"], project) == ["dry-run"]


def test_bash_completes_options_of_the_subcommand(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "dry-run", "--js"], project) == ["--json"]


def test_bash_completes_suite_names_from_the_recipes_dir(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "dry-run", "n"], project) == ["nightly"]


def test_bash_completes_suite_names_from_the_recipes_dir_option(project, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    words = ["gymv", "dry-run", "--recipes-dir", str(project / "recipes"), "re"]
    assert bash_complete(COMPLETIONS / "gymv.bash", words, elsewhere) == ["release"]


def test_bash_completes_an_option_value_split_at_equals_sign(project):
    # readline splits `--recipes-dir=rec` into three words because '=' is in COMP_WORDBREAKS
    words = ["gymv", "dry-run", "--recipes-dir", "=", "rec"]
    assert bash_complete(COMPLETIONS / "gymv.bash", words, project) == ["recipes"]


def test_bash_completes_environment_names(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "prepare", "circle-c"], project) == ["circle-click", "circle-count"]
    assert "polygon-naming" in bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "env", "serve", ""], project)


def test_bash_completes_model_architectures(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "model", "init", "tiny-"], project) == ["tiny-llava", "tiny-qwen2vl"]


def test_bash_completes_override_keys_after_the_recipe(project):
    words = ["gymv", "train", "r.yaml", "training.l"]
    assert bash_complete(COMPLETIONS / "gymv.bash", words, project) == ["training.lr=", "training.lr_schedule="]
    assert "grpo.async.enabled=" in bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "train", "r.yaml", "grpo.as"], project)


def test_bash_offers_nothing_for_an_override_value(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "train", "r.yaml", "training.lr", "=", ""], project) == []


def test_bash_completes_choices_of_an_argument(project):
    assert bash_complete(COMPLETIONS / "gymv.bash", ["gymv", "completion", ""], project) == ["bash", "fish", "zsh"]


# -- generation, on a synthetic app with nested groups ---------------------------------------------


class Color(str, Enum):
    red = "red"
    blue = "blue"


def synthetic_tree():
    app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
    env = typer.Typer()

    @app.callback()
    def root(debug: bool = typer.Option(False, "--debug")):
        pass

    @env.command("serve")
    def serve(port: int = typer.Option(8000, "--port"), color: Color = typer.Option(Color.red, "--color"),
              logs: Path = typer.Option(Path("."), "--logs", file_okay=False), verbose: bool = typer.Option(False, "--verbose")):
        pass

    @env.command("verify")
    def verify(rollouts: Path = typer.Argument(...)):
        pass

    app.add_typer(env, name="env")
    return command_tree(typer.main.get_command(app))


@pytest.fixture
def synthetic_bash(tmp_path) -> Path:
    path = tmp_path / "gymv.bash"
    path.write_text(render("bash", synthetic_tree()))
    (tmp_path / "logs_dir").mkdir()
    (tmp_path / "rollouts.jsonl").write_text("{}\n")
    return path


def test_bash_completes_nested_subcommands(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "--debug", "env", ""], tmp_path) == ["serve", "verify"]


def test_bash_completes_options_of_a_nested_subcommand(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "env", "serve", "--"], tmp_path) == ["--color", "--help", "--logs", "--port", "--verbose"]


def test_bash_completes_enum_choices_of_an_option(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "env", "serve", "--color", ""], tmp_path) == ["blue", "red"]


def test_bash_offers_nothing_for_a_numeric_option(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "env", "serve", "--port", ""], tmp_path) == []


def test_bash_offers_directories_only_for_a_directory_option(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "env", "serve", "--logs", "lo"], tmp_path) == ["logs_dir"]


def test_bash_offers_files_for_a_path_argument_after_a_flag(synthetic_bash, tmp_path):
    assert bash_complete(synthetic_bash, ["gymv", "env", "verify", "roll"], tmp_path) == ["rollouts.jsonl"]


def test_generated_scripts_pass_their_shells_syntax_check(tmp_path):
    tree = synthetic_tree()
    checks = [("bash", ["bash", "-n"]), ("zsh", ["zsh", "-n"]), ("fish", ["fish", "--no-execute"])]
    for shell, cmd in checks:
        if shutil.which(cmd[0]) is None:
            continue
        path = tmp_path / FILENAMES[shell]
        path.write_text(render(shell, tree))
        p = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"{shell}: {p.stderr}"


# -- zsh and fish, on the committed scripts ------------------------------------------------------------


@needs_zsh
def test_zsh_completes_subcommands_through_compinit(project):
    assert zsh_complete(COMPLETIONS, "gymv dr", project) == ["dry-run"]


@needs_zsh
def test_zsh_completes_suite_names(project):
    assert "nightly" in zsh_complete(COMPLETIONS, "gymv dry-run n", project)


@needs_fish
def test_fish_completes_subcommands(project):
    assert fish_complete(COMPLETIONS / "gymv.fish", "gymv dr", project) == ["dry-run"]


@needs_fish
def test_fish_completes_options_and_suite_names(project):
    script = COMPLETIONS / "gymv.fish"
    assert fish_complete(script, "gymv dry-run --js", project) == ["--json"]
    assert fish_complete(script, "gymv dry-run ni", project) == ["nightly"]


@needs_zsh
def test_zsh_completes_environment_names_and_override_keys(project):
    assert zsh_complete(COMPLETIONS, "gymv prepare circle-c", project) == ["circle-click", "circle-count"]
    assert zsh_complete(COMPLETIONS, "gymv train r.yaml training.l", project) == ["training.lr=", "training.lr_schedule="]


@needs_fish
def test_fish_completes_architectures_and_override_keys_but_not_values(project):
    script = COMPLETIONS / "gymv.fish"
    assert fish_complete(script, "gymv model init tiny-", project) == ["tiny-llava", "tiny-qwen2vl"]
    assert fish_complete(script, "gymv train r.yaml training.l", project) == ["training.lr=", "training.lr_schedule="]
    assert fish_complete(script, "gymv train r.yaml training.lr=", project) == []
