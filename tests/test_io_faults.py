"""Faults while writing or reading files give one line naming the file and the fix: a full disk (a
file-size limit set with setrlimit, in a subprocess), a directory where a file goes, a path that cannot be
created, a FIFO given as a recipe, an over-long number, an unknown env.kwargs argument."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gymv.config import load_recipe
from gymv.envs.registry import get_env
from gymv.errors import GymvError
from gymv.io import atomic_write_text
from gymv.runs.run_dir import RunDir

_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from gymv.errors import GymvError
    from gymv.io import atomic_write_text
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        atomic_write_text(sys.argv[1], "x" * 100_000)
    except GymvError as e:
        print("ERROR " + e.one_line())
""")


def test_a_write_that_runs_out_of_room_names_the_file_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(target)], capture_output=True, text=True, timeout=60)
    line = next(l for l in out.stdout.splitlines() if l.startswith("ERROR "))
    assert f"{target}: cannot write: File too large" in line and ".tmp" not in line and "fix:" in line
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left behind


def test_writing_over_a_directory_names_it_not_a_temporary_path(tmp_path):
    with pytest.raises(GymvError, match="cannot write: is a directory") as e:
        atomic_write_text(tmp_path, "x")
    assert e.value.where == str(tmp_path) and ".tmp" not in e.value.one_line()


@pytest.mark.parametrize("root", ["/dev/null", "/tmp/" + "a" * 300])
def test_a_run_directory_that_cannot_be_created_is_one_line_naming_it(root):
    with pytest.raises(GymvError, match="cannot create the run directory") as e:
        RunDir.create(f"{root}/run", {"algorithm": "grpo"})
    assert "checkpoint.dir" in e.value.fix


def test_a_fifo_given_as_a_recipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    with pytest.raises(GymvError, match="is not a regular file"):
        load_recipe(fifo, validate=False)


def test_a_fifo_named_in_defaults_is_not_called_missing(tmp_path):
    os.mkfifo(tmp_path / "parent.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: parent.yaml\nalgorithm: grpo\n")
    with pytest.raises(GymvError, match="is not a regular file"):
        load_recipe(child, validate=False)


def test_an_integer_too_long_to_convert_is_a_recipe_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\nseed: " + "9" * 5000 + "\n")
    with pytest.raises(GymvError, match="r.yaml: a value cannot be read: Exceeds the limit"):
        load_recipe(recipe, validate=False)


def test_an_unknown_env_kwargs_argument_is_blamed_on_env_kwargs():
    with pytest.raises(GymvError, match="does not take these arguments.*bogus") as e:
        get_env("circle-count", bogus=1)
    assert e.value.where == "env.kwargs" and "max_turns" in e.value.fix


@pytest.mark.parametrize("expr, expected", [("(" * 5000 + "1" + ")" * 5000, "nests too deeply"),
                                            ("- " * 5000 + "1", "nests too deeply"),
                                            ("9" * 5000 + " + 1", "number too long")])
def test_driver_arithmetic_past_the_parsers_limits_is_a_one_line_error(expr, expected):
    from gymv.recipes.arith import evaluate

    with pytest.raises(GymvError, match=expected) as e:
        evaluate(expr, lambda name: None, where="d.sh:3")
    assert e.value.where == "d.sh:3"


def test_lint_calls_a_fifo_what_it_is_and_an_over_long_path_unreadable(tmp_path):
    from gymv.config.lint import lint_paths

    os.mkfifo(tmp_path / "r.yaml")
    with pytest.raises(GymvError, match="is not a regular file or directory"):
        lint_paths([tmp_path / "r.yaml"])
    with pytest.raises(GymvError, match="cannot read: File name too long"):
        lint_paths([tmp_path / ("a" * 400)])


def test_a_device_as_the_output_is_written_into_never_replaced(tmp_path):
    """`--out /dev/full` replaced the device with a regular file (as root); a device of our own here."""
    import stat

    full = tmp_path / "full"
    try:
        os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # the kernel's /dev/full: every write is ENOSPC
    except PermissionError:
        pytest.skip("making a device needs root")
    with pytest.raises(GymvError, match="No space left on device") as e:
        atomic_write_text(full, "rows\n" * 10_000)
    assert e.value.where == str(full) and stat.S_ISCHR(full.stat().st_mode)


def test_a_named_pipe_as_the_output_gets_the_text_and_stays_a_pipe(tmp_path):
    import stat
    import threading

    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    atomic_write_text(fifo, "row 1\nrow 2\n")
    reader.join(timeout=30)
    assert got == ["row 1\nrow 2\n"] and stat.S_ISFIFO(fifo.stat().st_mode)
