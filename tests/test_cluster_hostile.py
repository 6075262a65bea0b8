"""`gymv cluster` and joining Ray under hostile input: shell syntax in anything that reaches the batch script
never runs, a port that answers but is not Ray ends the wait at its deadline naming it, out-of-range ports,
deadlines, node counts, resource names and addresses are refused, and a missing program is a one-line error.
SLURM is not here: `scontrol` and `srun` are small shell scripts on PATH; bash, the listeners and gymv are
real."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import run_gymv
from gymv.cluster.slurm import BatchJob, RayOnSlurm
from gymv.config import load_recipe
from gymv.errors import GymvError

SCONTROL = """#!/bin/sh
# stands in for SLURM's scontrol: `scontrol show hostnames A,B` prints one name per line
[ "$1" = show ] && [ "$2" = hostnames ] && echo "$3" | tr ',' '\\n'
"""
SRUN_RECORDS = """#!/bin/sh
# stands in for SLURM's srun: records its arguments, then fails as a node that cannot start
printf '%s\\n' "$@" >> "$SRUN_LOG"
exit 3
"""
SRUN_BLOCKS = """#!/bin/sh
# stands in for SLURM's srun running `ray start --block`: a step that stays up until it is stopped
exec tail -f /dev/null
"""
DRIVER = """#!/usr/bin/env bash
# ===== BEGIN CONFIG =====
NUM_NODES=2
GPUS_PER_NODE=8
STEPS_PER_RUN=10
MAX_STEPS=10
NUM_MINUTES=30
# ===== END CONFIG =====
printf '%s\\0' "$@" > "$DRIVER_ARGV"
"""

# what a shell would run if a value reached it unquoted; each creates a file named PWNED
COMMAND_PAYLOADS = ["$(touch PWNED)", "`touch PWNED`", "x;touch PWNED", "x\ntouch PWNED", "x'\ntouch PWNED\n'",
                    'x"$(touch PWNED)"', "x&&touch PWNED|cat"]
# the same as one word each (what an #SBATCH value may be): bash's brace expansion stands in for the space
SBATCH_WORDS = ["$({touch,PWNED})", "`{touch,PWNED}`", "x;{touch,PWNED}", "x&&{touch,PWNED}|cat"]


def harness(tmp_path: Path, srun: str | None) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", srun)):
        if text is not None:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    return bin_dir


def slurm_env(bin_dir: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="127.0.0.1", **extra)
    return env


def assert_one_line_error(r, *parts: str) -> str:
    assert r.code != 0, r.stdout
    lines = r.stderr.strip().splitlines()  # progress lines may come first; the error is one line, the last
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in r.stderr, r.stderr
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


def assert_sbatch_lines_come_first(script: str) -> None:
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert sum(line.startswith("#SBATCH") for line in lines) >= 4


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("algorithm: grpo\n")
    return path


# --- 1. the batch script -------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--account", "--partition", "--time", "--output"])
@pytest.mark.parametrize("value", ["me\ntouch PWNED", "me\r\ntouch PWNED", "me\u2028x", "me touch", "me\tx",
                                   'me"x', "me\\", "me\x1b[2J"])
def test_an_sbatch_option_that_is_not_one_printable_word_is_refused_naming_it(gymv, recipe, tmp_path, option, value):
    r = gymv("cluster", "sbatch", recipe, option, value, "--write", tmp_path / "job.sh", cwd=tmp_path)
    assert_one_line_error(r, f"error: {option}: ", "an #SBATCH value is one word")
    assert not (tmp_path / "job.sh").exists()


def test_a_time_limit_slurm_cannot_read_is_refused(gymv, recipe, tmp_path):
    r = gymv("cluster", "sbatch", recipe, "--time", "4:00:00;touch${IFS}PWNED", cwd=tmp_path)
    assert_one_line_error(r, "error: --time: ", "is no SLURM time limit")


def test_a_recipe_name_with_a_line_break_is_refused_as_the_job_name(gymv, recipe, tmp_path):
    r = gymv("cluster", "sbatch", recipe, 'name="run\\ntouch PWNED"', cwd=tmp_path)  # a YAML escape: a real line break
    assert_one_line_error(r, "error: name: --job-name", "holds a line break")


def test_a_driver_whose_file_name_holds_a_line_break_is_refused_as_the_job_name(gymv, tmp_path):
    driver = tmp_path / "d\ntouch PWNED.sh"
    driver.write_text(DRIVER)
    r = gymv("cluster", "sbatch", driver, cwd=tmp_path)
    assert_one_line_error(r, "--job-name", "holds a line break")


def run_batch_script(script: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The script under bash as SLURM would start it, with `scontrol` and a recording `srun` on PATH."""
    return subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=slurm_env(harness(tmp_path, SRUN_RECORDS), SRUN_LOG=str(tmp_path / "srun.log"), **env))


@pytest.mark.parametrize("word", SBATCH_WORDS)
def test_shell_syntax_in_sbatch_values_and_the_job_name_never_runs(gymv, recipe, tmp_path, word):
    made = gymv("cluster", "sbatch", recipe, f"name='{word}'", "--account", word, "--partition", word, "--output", word,
                "--write", tmp_path / "job.sh", cwd=tmp_path)
    assert made.code == 0, made.stderr
    script = (tmp_path / "job.sh").read_text()
    assert f"#SBATCH --account={word}" in script.splitlines()
    assert_sbatch_lines_come_first(script)
    job = run_batch_script(tmp_path / "job.sh", tmp_path)
    assert "exited with code 3 while starting" in job.stderr  # the script ran through to its launcher's srun
    assert "ray" in (tmp_path / "srun.log").read_text()
    assert list(tmp_path.rglob("PWNED*")) == []


@pytest.mark.parametrize("payload", COMMAND_PAYLOADS)
def test_shell_syntax_in_the_command_and_the_working_folder_never_runs(gymv, tmp_path, payload):
    workdir = tmp_path / payload  # the folder the script cds into, holding a recipe of that name
    workdir.mkdir()
    recipe = workdir / f"{payload}.yaml"
    recipe.write_text("algorithm: grpo\nname: job\n")
    override = f"logger.wandb_project={json.dumps(payload)}"  # a YAML string: its quotes, $( and ; reach the shell
    made = gymv("cluster", "sbatch", recipe, override, "--write", workdir / "job.sh", cwd=workdir)
    assert made.code == 0, made.stderr
    script = (workdir / "job.sh").read_text()
    assert_sbatch_lines_come_first(script)
    job = run_batch_script(workdir / "job.sh", tmp_path)
    assert "exited with code 3 while starting" in job.stderr  # the script ran through to its launcher's srun
    assert list(tmp_path.rglob("PWNED*")) == []
    command = shlex.split(script.rstrip().rpartition("\nexec ")[2])  # the words bash runs, quotes and all
    assert command[-2:] == [str(recipe.resolve()), override]


@pytest.mark.parametrize("payload,word", list(zip(COMMAND_PAYLOADS, SBATCH_WORDS * 2)))
def test_shell_syntax_in_a_drivers_name_and_arguments_never_runs(gymv, tmp_path, payload, word):
    workdir = tmp_path / payload
    workdir.mkdir()
    driver = workdir / f"{word}.sh"
    driver.write_text(DRIVER)
    made = gymv("cluster", "sbatch", driver, payload, "--write", workdir / "job.sh", cwd=workdir)
    assert made.code == 0, made.stderr
    assert_sbatch_lines_come_first((workdir / "job.sh").read_text())
    argv = tmp_path / "argv.bin"
    job = run_batch_script(workdir / "job.sh", tmp_path, DRIVER_ARGV=str(argv))
    assert job.returncode == 0, job.stderr
    assert argv.read_bytes().split(b"\0")[:-1] == [payload.encode()]  # the driver got its argument as it was
    assert list(tmp_path.rglob("PWNED*")) == []


# --- 2. waits on a port that answers but is not Ray ----------------------------------------------------------

class Listener:
    """A TCP listener on 127.0.0.1 that is not Ray: it accepts and says nothing (`silent`), answers with text
    (`garbage`), or answers the HTTP/2 greeting and then nothing more (`http2`)."""

    REPLIES = {"silent": b"", "garbage": b"HELLO, this is not Ray\r\n",
               "http2": b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"}  # an empty SETTINGS frame

    def __init__(self, kind: str):
        self.reply = self.REPLIES[kind]
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply:
                try:
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture(params=["silent", "garbage", "http2"])
def not_ray(request):
    listener = Listener(request.param)
    yield request.param, listener.port
    listener.close()


DEADLINE_S, MARGIN_S = 2, 8  # the margin covers the interpreter's start and importing Ray


def test_cluster_up_at_a_head_port_that_is_not_ray_ends_at_its_timeout_naming_it(tmp_path, not_ray):
    kind, port = not_ray
    env = slurm_env(harness(tmp_path, SRUN_BLOCKS))
    t0 = time.monotonic()
    r = run_gymv("cluster", "up", "--port", port, "--timeout", DEADLINE_S, "--", "true", env=env, cwd=tmp_path,
                 timeout=DEADLINE_S + MARGIN_S)
    assert time.monotonic() - t0 < DEADLINE_S + MARGIN_S
    if kind == "garbage":
        assert_one_line_error(r, f"error: --port: 127.0.0.1:{port} answers, but not as a Ray cluster's GCS",
                              "choose a free --port")
    else:
        assert_one_line_error(r, f"error: --timeout: waited {DEADLINE_S} s for the Ray GCS", f"at 127.0.0.1:{port}",
                              "raise --timeout")


def test_train_joining_a_port_that_is_not_ray_ends_at_cluster_connect_timeout_s(tmp_path, recipe, not_ray):
    kind, port = not_ray
    t0 = time.monotonic()
    r = run_gymv("train", recipe, "--ray-address", f"127.0.0.1:{port}", f"cluster.connect_timeout_s={DEADLINE_S}",
                 cwd=tmp_path, env={"RAY_ADDRESS": ""}, timeout=DEADLINE_S + MARGIN_S)
    assert time.monotonic() - t0 < DEADLINE_S + MARGIN_S
    if kind == "garbage":
        assert_one_line_error(r, f"error: --ray-address: 127.0.0.1:{port} answers, but not as a Ray cluster's GCS")
    else:
        assert_one_line_error(r, f"error: cluster.connect_timeout_s: waited {DEADLINE_S} s for the Ray GCS",
                              f"at 127.0.0.1:{port}", "raise cluster.connect_timeout_s")
    assert not (tmp_path / "runs").exists()


# --- 3. values refused before anything starts ----------------------------------------------------------------

@pytest.mark.parametrize("port", ["70000", "65536", "0", "-1"])
def test_cluster_up_refuses_a_port_outside_1_to_65535(gymv, tmp_path, port):
    r = gymv("cluster", "up", "--port", port, "--", "true", env={"SLURM_JOB_NODELIST": None}, cwd=tmp_path)
    assert_one_line_error(r, "error: --port: the port", "is not a TCP port (from 1 to 65535)")


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "-1", "0"])
def test_cluster_up_refuses_a_timeout_that_is_not_a_positive_number_of_seconds(gymv, tmp_path, timeout):
    r = gymv("cluster", "up", "--timeout", timeout, "--", "true", env={"SLURM_JOB_NODELIST": None}, cwd=tmp_path)
    assert_one_line_error(r, "error: --timeout: --timeout must be a number of seconds above 0")


@pytest.mark.parametrize("flag", ["--num-cpus", "--num-gpus", "--gpus-per-node"])
def test_cluster_up_refuses_a_negative_count(gymv, tmp_path, flag):
    r = gymv("cluster", "up", flag, "-1", "--", "true", env={"SLURM_JOB_NODELIST": None}, cwd=tmp_path)
    assert_one_line_error(r, f"error: {flag}: {flag} must be 0 or more")


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_cluster_sbatch_refuses_a_port_outside_1_to_65535(gymv, recipe, tmp_path, port):
    r = gymv("cluster", "sbatch", recipe, "--port", port, cwd=tmp_path)
    assert_one_line_error(r, "error: --port: the port")


def test_nodes_sharing_a_host_need_their_ports_below_65536():
    with pytest.raises(GymvError, match=r"2 Ray nodes on one host from --port 65500 need ports up to 65625") as e:
        RayOnSlurm(["127.0.0.1", "127.0.0.1"], port=65500)
    assert e.value.where == "--port"


def test_a_node_count_beyond_any_ray_cluster_is_refused(recipe):
    with pytest.raises(GymvError, match=r"cluster\.num_nodes.*less than or equal to 4096"):
        load_recipe(recipe, ["cluster.num_nodes=1000000000"]).validated
    assert load_recipe(recipe, ["cluster.num_nodes=4096"]).validated.cluster.num_nodes == 4096


def test_a_batch_job_refuses_a_node_count_beyond_any_ray_cluster():
    with pytest.raises(GymvError, match="not a whole number from 1 to 4096") as e:
        BatchJob(1_000_000_000, 8, ("true",), "job")
    assert e.value.where == "cluster.num_nodes"


@pytest.mark.parametrize("resources", ['{"":1}', '{" ":1}', '{"a b":1}', '{"gpu\\nx":1}'])
def test_a_custom_resource_without_a_plain_name_is_refused(recipe, resources):
    with pytest.raises(GymvError, match="is no Ray resource name"):
        load_recipe(recipe, [f"cluster.placement.generation.resources={resources}"]).validated


@pytest.mark.parametrize("amount", ["-1", "0"])
def test_a_custom_resource_amount_that_is_not_positive_is_refused(recipe, amount):
    with pytest.raises(GymvError, match="greater than 0"):
        load_recipe(recipe, [f'cluster.placement.generation.resources={{"a":{amount}}}']).validated


def test_resources_directly_under_cluster_are_an_unknown_key(recipe):
    with pytest.raises(GymvError, match="unknown key 'cluster.resources'"):
        load_recipe(recipe, ['cluster.resources={"":1}'])


@pytest.mark.parametrize("address", ["127.0.0.1:notaport", "127.0.0.1:70000", "127.0.0.1:0", "127.0.0.1:-1",
                                     "127.0.0.1:", ":6379", "127.0.0.1", "ray://10.0.0.1:10001", "a b:6379",
                                     "127.0.0.1:６３７９"])
def test_a_ray_address_that_is_not_host_and_port_is_refused(recipe, address):
    with pytest.raises(GymvError, match=r"cluster\.ray_address.*HOST:PORT with a port from 1 to 65535"):
        load_recipe(recipe, [f"cluster.ray_address='{address}'"]).validated


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "node-7.cluster:6379", "[::1]:6379", "127.0.0.1:65535"])
def test_a_ray_address_of_host_and_port_or_auto_is_taken(recipe, address):
    assert load_recipe(recipe, [f"cluster.ray_address='{address}'"]).validated.cluster.ray_address == address


@pytest.mark.parametrize("address", ["127.0.0.1:notaport", "127.0.0.1:70000"])
def test_a_ray_address_flag_that_is_not_host_and_port_is_refused(gymv, recipe, tmp_path, address):
    r = gymv("train", recipe, "--ray-address", address, cwd=tmp_path)
    assert_one_line_error(r, "error: --ray-address: bad Ray address")


def _bad_token_paths(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    return {"missing": tmp_path / "no-such-token", "a folder": tmp_path, "empty": empty}


@pytest.mark.parametrize("case", ["missing", "a folder", "empty"])
def test_cluster_up_refuses_a_token_path_it_cannot_read(gymv, tmp_path, case):
    path = _bad_token_paths(tmp_path)[case]
    srun_log = tmp_path / "srun.log"
    env = {**slurm_env(harness(tmp_path, SRUN_RECORDS), SRUN_LOG=str(srun_log)), "RAY_AUTH_TOKEN": None,
           "RAY_AUTH_TOKEN_PATH": str(path)}
    r = gymv("cluster", "up", "--", "true", env=env, cwd=tmp_path)
    assert_one_line_error(r, "error: RAY_AUTH_TOKEN_PATH: ", str(path))
    assert not srun_log.exists()  # refused before any node starts


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_cluster_up_refuses_a_token_file_without_read_permission(gymv, tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0)
    env = {**slurm_env(harness(tmp_path, SRUN_RECORDS), SRUN_LOG=str(tmp_path / "srun.log")), "RAY_AUTH_TOKEN": None,
           "RAY_AUTH_TOKEN_PATH": str(token)}
    r = gymv("cluster", "up", "--", "true", env=env, cwd=tmp_path)
    assert_one_line_error(r, "error: RAY_AUTH_TOKEN_PATH: cannot read the token file", "Permission denied")


def test_train_refuses_a_token_path_it_cannot_read(tmp_path, recipe):
    missing = tmp_path / "no-such-token"
    r = run_gymv("train", recipe, "--ray-address", "127.0.0.1:1", cwd=tmp_path,
                 env={"RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(missing), "RAY_ADDRESS": ""}, timeout=120)
    assert_one_line_error(r, "error: RAY_AUTH_TOKEN_PATH: cannot read the token file", str(missing))


def test_sbatch_write_into_a_missing_folder_is_refused_and_makes_no_folder(gymv, recipe, tmp_path):
    target = tmp_path / "no-such-folder" / "job.sh"
    r = gymv("cluster", "sbatch", recipe, "--write", target, cwd=tmp_path)
    assert_one_line_error(r, f"error: --write: the folder {target.parent} does not exist", "mkdir -p")
    assert not target.parent.exists()


def test_sbatch_write_onto_a_folder_is_refused(gymv, recipe, tmp_path):
    r = gymv("cluster", "sbatch", recipe, "--write", tmp_path, cwd=tmp_path)
    assert_one_line_error(r, f"error: --write: {tmp_path} is a folder")


# --- 4. programs that are not there --------------------------------------------------------------------------

@pytest.mark.parametrize("program", ["/nonexistent/cmd", "no-such-program-gymv"])
def test_cluster_up_of_a_command_that_does_not_exist_is_a_one_line_error(gymv, tmp_path, program):
    r = gymv("cluster", "up", "--", program, "arg", env={"SLURM_JOB_NODELIST": None}, cwd=tmp_path)
    assert_one_line_error(r, f"error: gymv cluster up: cannot run '{program}'", "check the command after `--`")
    assert r.code == 127


def test_in_an_allocation_a_command_that_does_not_exist_is_refused_before_any_node_starts(gymv, tmp_path):
    srun_log = tmp_path / "srun.log"
    r = gymv("cluster", "up", "--", "/nonexistent/cmd", env=slurm_env(harness(tmp_path, SRUN_RECORDS),
                                                                     SRUN_LOG=str(srun_log)), cwd=tmp_path)
    assert_one_line_error(r, "cannot run '/nonexistent/cmd'")
    assert not srun_log.exists()


def test_in_an_allocation_without_srun_cluster_up_is_a_one_line_error(gymv, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "7", "PATH": str(empty)}
    r = gymv("cluster", "up", "--", sys.executable, "-c", "pass", env=env, cwd=tmp_path)
    assert_one_line_error(r, "error: gymv cluster up: srun is not on PATH", "SLURM tools")
