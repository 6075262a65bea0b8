"""Driver CONFIG blocks: read like bash would assign them, never executed, one fresh scope per script."""

from __future__ import annotations

import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from gymv.errors import GymvError
from gymv.recipes.drivers import find_block, parse_driver
from gymv.recipes.gpu_hours import plan

BEGIN = "# ===== BEGIN CONFIG ====="
END = "# ===== END CONFIG ====="
SIZING = "NUM_NODES=1\nSTEPS_PER_RUN=10\nMAX_STEPS=10\nNUM_MINUTES=30\n"


def driver(tmp_path: Path, block: str, *, name: str = "d.sh", before: str = "", after: str = "echo run\n") -> Path:
    """Write a driver: shebang, optional lines, the CONFIG block, then the rest of the script."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    body = textwrap.dedent(block).strip("\n")
    path.write_text(f"#!/bin/bash\n{textwrap.dedent(before)}{BEGIN}\n{body}\n{END}\n{textwrap.dedent(after)}")
    return path


def block_line(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def error_of(path: Path, **kwargs) -> GymvError:
    with pytest.raises(GymvError) as info:
        parse_driver(path, **kwargs)
    return info.value


# -- assignments ------------------------------------------------------------------------------------


def test_plain_assignments_set_the_sizing(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=2\nGPUS_PER_NODE=4\nSTEPS_PER_RUN=5\nMAX_STEPS=20\nNUM_RUNS=3\nNUM_MINUTES=45"))
    assert (c.num_nodes, c.gpus_per_node, c.steps_per_run, c.max_steps, c.num_runs, c.num_minutes) == (2, 4, 5, 20, 3, 45)


def test_export_prefix_assigns_like_a_plain_assignment(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING.replace("NUM_NODES=1", "export NUM_NODES=3")))
    assert c.num_nodes == 3


def test_double_quoted_value_is_unquoted(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + 'FLAGS="--a --b"\nNUM_NODES="2"'))
    assert c.num_nodes == 2
    assert c.extras["FLAGS"] == "--a --b"


def test_single_quoted_value_is_literal_without_expansion(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + "NOTE='$NOT_A_VAR and $(( 1 + ))'"))
    assert c.extras["NOTE"] == "$NOT_A_VAR and $(( 1 + ))"


def test_default_expansion_uses_the_default_when_nothing_is_inherited(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING.replace("NUM_NODES=1", 'NUM_NODES="${NUM_NODES:-10}"')))
    assert c.num_nodes == 10


def test_default_expansion_takes_an_inherited_value(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING.replace("NUM_NODES=1", 'NUM_NODES="${NUM_NODES:-10}"')), env={"NUM_NODES": "3"})
    assert c.num_nodes == 3


def test_default_expansion_ignores_the_callers_shell_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NUM_NODES", "99")
    c = parse_driver(driver(tmp_path, SIZING.replace("NUM_NODES=1", 'NUM_NODES="${NUM_NODES:-10}"')))
    assert c.num_nodes == 10


def test_variable_references_use_earlier_values_of_the_block(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=2\nSTEPS_PER_RUN=10\nMAX_STEPS=$STEPS_PER_RUN\nNUM_MINUTES=${NUM_NODES}0\nTAG=n${NUM_NODES}x$MAX_STEPS"))
    assert (c.max_steps, c.num_minutes, c.extras["TAG"]) == (10, 20, "n2x10")


def test_arithmetic_supports_the_four_operations_remainder_and_parentheses(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + "X=$(( (2 + 3) * 4 - 6 / 2 + 7 % 4 ))"))
    assert c.extras["X"] == str((2 + 3) * 4 - 6 // 2 + 7 % 4)


def test_arithmetic_reads_bare_and_dollar_names_of_earlier_variables(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=1\nSTEPS_PER_RUN=7\nMAX_STEPS=30\nNUM_RUNS=$(( (MAX_STEPS + $STEPS_PER_RUN - 1) / ${STEPS_PER_RUN} ))\nNUM_MINUTES=$((24 * 60))"))
    assert (c.num_runs, c.num_minutes) == (5, 1440)


def test_arithmetic_division_floors_positive_values_and_truncates_negative_ones_like_bash(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + "A=$(( 7 / 2 ))\nB=$(( -7 / 2 ))\nC=$(( -7 % 2 ))"))
    assert (c.extras["A"], c.extras["B"], c.extras["C"]) == ("3", "-3", "-1")


def test_trailing_comments_blank_lines_and_comment_lines_are_ignored(tmp_path):
    c = parse_driver(driver(tmp_path, "# sizing\n\nNUM_NODES=2   # two nodes\nSTEPS_PER_RUN=10 #x\nMAX_STEPS=10\n\nNUM_MINUTES=30\nTAG=a#b"))
    assert c.num_nodes == 2
    assert c.extras["TAG"] == "a#b"  # '#' inside a word is not a comment, as in bash


def test_several_assignments_on_one_line_apply_left_to_right(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=2 STEPS_PER_RUN=10; MAX_STEPS=$(( STEPS_PER_RUN * 2 )); NUM_MINUTES=30"))
    assert (c.num_nodes, c.max_steps) == (2, 20)


def test_backslash_continues_a_line(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + 'FLAGS="--a \\\n--b"'))
    assert c.extras["FLAGS"] == "--a --b"


def test_optional_extras_are_kept_as_strings(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + "SEGMENT_SIZE=2\nMIN_EFFICIENCY=0.80\nSUITE=nightly"))
    assert c.extras == {"SEGMENT_SIZE": "2", "MIN_EFFICIENCY": "0.80", "SUITE": "nightly"}


def test_gpus_per_node_defaults_to_8(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING))
    assert c.gpus_per_node == 8
    assert "GPUS_PER_NODE" in c.defaulted


def test_num_runs_defaults_to_the_ceiling_of_max_steps_over_steps_per_run(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=1\nSTEPS_PER_RUN=30\nMAX_STEPS=100\nNUM_MINUTES=30"))
    assert c.num_runs == 4
    assert "NUM_RUNS" in c.defaulted


def test_gpu_hours_are_runs_times_nodes_times_gpus_times_minutes_over_60_exactly(tmp_path):
    c = parse_driver(driver(tmp_path, "NUM_NODES=2\nGPUS_PER_NODE=4\nSTEPS_PER_RUN=10\nMAX_STEPS=30\nNUM_MINUTES=25"))
    assert c.gpu_minutes == 3 * 2 * 4 * 25
    assert c.gpu_hours == Fraction(600, 60)


def test_each_driver_starts_from_fresh_defaults_without_leakage(tmp_path):
    first = parse_driver(driver(tmp_path, SIZING + "GPUS_PER_NODE=2\nNUM_RUNS=9\nEXTRA=1", name="a.sh"))
    second = parse_driver(driver(tmp_path, 'NUM_NODES=1\nSTEPS_PER_RUN=10\nMAX_STEPS=20\nNUM_MINUTES=30\nE="${EXTRA:-unset}"', name="b.sh"))
    assert (first.gpus_per_node, first.num_runs) == (2, 9)
    assert (second.gpus_per_node, second.num_runs, second.extras["E"]) == (8, 2, "unset")


def test_the_block_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    d = driver(tmp_path, SIZING, before=f"touch {marker}\n", after=f"touch {marker}\n")
    parse_driver(d)
    assert not marker.exists()


# -- errors: each names the file and the line ---------------------------------------------------------


def test_block_without_end_marker_is_an_error_at_the_begin_line(tmp_path):
    d = tmp_path / "d.sh"
    d.write_text(f"#!/bin/bash\n{BEGIN}\n{SIZING}")
    e = error_of(d)
    assert e.where == f"{d}:2"
    assert "no END marker" in e.message


def test_driver_without_block_is_an_error(tmp_path):
    d = tmp_path / "d.sh"
    d.write_text("#!/bin/bash\nNUM_NODES=1\n")
    e = error_of(d)
    assert e.where == f"{d}:1"
    assert "no CONFIG block" in e.message


def test_second_begin_marker_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING, after=f"{BEGIN}\n{END}\n")
    e = error_of(d)
    assert e.where.endswith(":8")
    assert "second BEGIN" in e.message


def test_command_substitution_is_an_error_naming_its_line(tmp_path):
    d = driver(tmp_path, SIZING + "HOST=$(hostname)")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'HOST=')}"
    assert "command substitution" in e.message


def test_backticks_are_an_error_naming_their_line(tmp_path):
    d = driver(tmp_path, SIZING + "HOST=`hostname`")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'HOST=')}"
    assert "backticks" in e.message


def test_unknown_variable_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING + "X=$UNDEFINED_THING")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'X=')}"
    assert "UNDEFINED_THING" in e.message


def test_unknown_bare_name_in_arithmetic_is_an_error_not_zero(tmp_path):
    d = driver(tmp_path, SIZING + "X=$(( MAX_STEPZ + 1 ))")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'X=')}"
    assert "MAX_STEPZ" in e.message


def test_malformed_arithmetic_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING + "X=$(( 1 + ))")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'X=')}"
    assert "malformed arithmetic" in e.message


def test_unsupported_power_operator_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING + "X=$(( 2 ** 3 ))")
    assert "'**'" in error_of(d).message


def test_division_by_zero_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING + "Z=0\nX=$(( 4 / Z ))")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'X=')}"
    assert "division by zero" in e.message


def test_missing_required_key_is_an_error_at_the_block(tmp_path):
    d = driver(tmp_path, SIZING.replace("NUM_MINUTES=30\n", ""))
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'BEGIN CONFIG')}"
    assert "NUM_MINUTES" in e.message


def test_non_integer_required_value_is_an_error_at_its_line(tmp_path):
    d = driver(tmp_path, SIZING.replace("NUM_NODES=1", "NUM_NODES=two"))
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'NUM_NODES=')}"
    assert "not an integer" in e.message


def test_leading_zero_integer_is_refused_because_bash_reads_octal(tmp_path):
    d = driver(tmp_path, SIZING.replace("NUM_NODES=1", "NUM_NODES=08"))
    assert "octal" in error_of(d).message


def test_zero_nodes_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING.replace("NUM_NODES=1", "NUM_NODES=0"))
    assert "must be 1 or more" in error_of(d).message


def test_zero_gpus_per_node_is_a_cpu_driver_costing_nothing(tmp_path):
    c = parse_driver(driver(tmp_path, SIZING + "GPUS_PER_NODE=0"))
    assert (c.gpus_per_node, c.gpu_minutes) == (0, 0)


def test_a_command_inside_the_block_is_an_error(tmp_path):
    d = driver(tmp_path, SIZING + "echo hello")
    e = error_of(d)
    assert e.where == f"{d}:{block_line(d, 'echo hello')}"
    assert "not an assignment" in e.message


def test_error_text_is_one_line_with_a_fix(tmp_path):
    d = driver(tmp_path, SIZING + "HOST=$(hostname)")
    text = error_of(d).one_line()
    assert "\n" not in text and "(fix: " in text


# -- wrappers ---------------------------------------------------------------------------------------

CALLEE = 'NUM_NODES="${NUM_NODES:-10}"\nSTEPS_PER_RUN=10\nMAX_STEPS=20\nNUM_MINUTES=60'


def test_wrapper_exec_reads_the_callee_with_the_wrappers_exported_values(tmp_path):
    driver(tmp_path, CALLEE, name="base.sh")
    w = driver(tmp_path, "export NUM_NODES=2", name="wrap.sh", after='exec "$(dirname "$0")/base.sh" "$@"\n')
    c = parse_driver(w)
    assert c.num_nodes == 2
    assert c.path == w and [p.name for p in c.chain] == ["wrap.sh", "base.sh"]
    assert c.gpu_minutes == 2 * 2 * 8 * 60  # counted once, for the wrapper


def test_the_execd_driver_alone_uses_its_own_default(tmp_path):
    base = driver(tmp_path, CALLEE, name="base.sh")
    driver(tmp_path, "export NUM_NODES=2", name="wrap.sh", after='exec "$(dirname "$0")/base.sh"\n')
    parse_driver(tmp_path / "wrap.sh")
    assert parse_driver(base).num_nodes == 10


def test_wrapper_exec_with_a_relative_path_resolves_from_the_wrappers_directory(tmp_path):
    driver(tmp_path / "sub", CALLEE, name="base.sh")
    w = driver(tmp_path, "export NUM_NODES=3", name="wrap.sh", after="exec bash sub/base.sh\n")
    assert parse_driver(w).num_nodes == 3


def test_wrapper_exec_through_a_script_dir_variable(tmp_path):
    driver(tmp_path, CALLEE, name="base.sh")
    w = driver(tmp_path, "export NUM_NODES=4", name="wrap.sh",
               before='SCRIPT_DIR=$( cd -- "$( dirname -- "${BASH_SOURCE[0]}" )" &> /dev/null && pwd)\n',
               after='exec "$SCRIPT_DIR/base.sh" "$@"\n')
    assert parse_driver(w).num_nodes == 4


def test_unexported_wrapper_value_does_not_reach_the_callee_and_is_reported(tmp_path):
    driver(tmp_path, CALLEE, name="base.sh")
    w = driver(tmp_path, "NUM_NODES=2", name="wrap.sh", after='exec "$(dirname "$0")/base.sh"\n')
    c = parse_driver(w)
    assert c.num_nodes == 10  # what bash would run
    [ignored] = c.ignored_wrapper_values
    assert (ignored.name, ignored.reason, ignored.where) == ("NUM_NODES", "not exported", f"{w}:3")


# NeMo RL's Super Omni MOPD smoke: a wrapper whose block sets the sizing, exported by name after the block,
# then an exec of the 10-node driver, which defaults NUM_NODES and NUM_MINUTES from its caller
# (tests/test_suites/vlm/mopd-nemotron-super-omni-120ba12b-4n8g-smoke.v1.sh and its 10n8g driver)
SCRIPT_DIR_IDIOM = 'SCRIPT_DIR=$( cd -- "$( dirname -- "${BASH_SOURCE[0]}" )" &> /dev/null && pwd)\n'
MOPD_10N8G = "mopd-nemotron-super-omni-120ba12b-10n8g-megatron-tp8ep16cp2-async-gym.v1.sh"


def mopd_smoke_pair(tmp_path: Path, exports: str = "export NUM_NODES NUM_MINUTES\n") -> Path:
    driver(tmp_path, 'NUM_NODES="${NUM_NODES:-10}"\nGPUS_PER_NODE=8\nSTEPS_PER_RUN=3\nMAX_STEPS=3\nNUM_RUNS=1\n'
                     'NUM_MINUTES="${NUM_MINUTES:-840}"', name=MOPD_10N8G,
           before=f'{SCRIPT_DIR_IDIOM}source "$SCRIPT_DIR/common.env"\n\n# the checkpoint and data are external\n',
           after='\nexit_if_max_steps_reached\n\n: "${MODEL_PATH:?MODEL_PATH must point at the checkpoint}"\n'
                 'cd "$PROJECT_ROOT"\nuv run examples/nemo_gym/run_grpo_nemo_gym.py --config "$CONFIG_PATH" "$@"\n')
    return driver(tmp_path, "NUM_NODES=4\nGPUS_PER_NODE=8\nSTEPS_PER_RUN=3\nMAX_STEPS=3\nNUM_RUNS=1\nNUM_MINUTES=480",
                  name="mopd-nemotron-super-omni-120ba12b-4n8g-smoke.v1.sh",
                  before=f'{SCRIPT_DIR_IDIOM}\nexport EXP_NAME="$(basename "$0" .sh)"\n\n',
                  after=f'{exports}\nexec "$SCRIPT_DIR/{MOPD_10N8G}" "$@"\n')


def test_a_wrapper_exporting_its_block_values_by_name_after_the_block_hands_them_to_the_driver_it_execs(tmp_path):
    w = mopd_smoke_pair(tmp_path)
    c = parse_driver(w)
    assert (c.num_nodes, c.num_minutes) == (4, 480) and c.ignored_wrapper_values == ()
    assert c.allocated == {} and c.gpu_hours == Fraction(4 * 8 * 480, 60)
    assert plan([w]).warnings() == []  # `gymv dry-run` warned "NUM_NODES='4' ... not exported; it runs with '10'"


def test_an_export_with_a_value_after_the_block_is_what_the_execd_driver_runs_with(tmp_path):
    w = mopd_smoke_pair(tmp_path, exports="export NUM_NODES=5 NUM_MINUTES\n")
    c = parse_driver(w)
    assert (c.num_nodes, c.num_minutes) == (5, 480) and c.allocation("NUM_NODES") == 4  # the launcher reads the block
    [ignored] = c.ignored_wrapper_values
    assert (ignored.name, ignored.effective_value, ignored.reason) == (
        "NUM_NODES", "5", f"reassigned at {w}:{block_line(w, 'export NUM_NODES=5')}")


def test_an_export_after_the_exec_does_not_count(tmp_path):
    w = mopd_smoke_pair(tmp_path, exports="")
    w.write_text(w.read_text() + "export NUM_NODES NUM_MINUTES\n")
    assert [i.name for i in parse_driver(w).ignored_wrapper_values] == ["NUM_NODES", "NUM_MINUTES"]


def test_an_export_after_the_block_that_cannot_be_read_is_an_error_only_for_a_block_value(tmp_path):
    w = mopd_smoke_pair(tmp_path, exports='export NUM_NODES NUM_MINUTES\nexport RUN_ID="$(date +%s)"\n')
    assert parse_driver(w).num_nodes == 4
    w = mopd_smoke_pair(tmp_path, exports='export NUM_MINUTES NUM_NODES="$(nproc)"\n')
    e = error_of(w)
    assert e.where == f"{w}:{block_line(w, 'nproc')}" and "NUM_NODES" in e.message and "export NAME" in e.fix


def test_exec_to_a_missing_driver_is_an_error_at_the_exec_line(tmp_path):
    w = driver(tmp_path, "export NUM_NODES=2", name="wrap.sh", after='exec "$(dirname "$0")/nope.sh"\n')
    e = error_of(w)
    assert e.where == f"{w}:{block_line(w, 'exec ')}"
    assert "does not exist" in e.message


def test_exec_cycle_is_an_error(tmp_path):
    driver(tmp_path, "export NUM_NODES=2", name="a.sh", after="exec ./b.sh\n")
    driver(tmp_path, "export NUM_NODES=2", name="b.sh", after="exec ./a.sh\n")
    assert "exec cycle" in error_of(tmp_path / "a.sh").message


def test_exec_of_a_program_or_a_redirection_is_not_a_wrapper(tmp_path):
    d = driver(tmp_path, SIZING, after="exec > run.log 2>&1\nexec uv run python train.py\n")
    block = find_block(d)
    assert block.exec_target is None
    assert parse_driver(d).chain == (d,)
