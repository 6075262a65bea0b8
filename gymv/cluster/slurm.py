"""A Ray cluster on a SLURM allocation, for the run of one command (`gymv cluster up -- gymv train ...`), and
the batch script that asks SLURM for the recipe's nodes and GPUs (`gymv cluster sbatch RECIPE`).

Inside an allocation: `scontrol show hostnames $SLURM_JOB_NODELIST` lists its nodes; the first is the head.
One `srun --overlap` step per node runs `ray start --block` there (the head with `--head`, the others joining
it), each node labelled `gymv-node: "<index>"` so that recipes can pin roles to nodes
(`cluster.placement.<role>.labels`). Once every node has joined (a deadline, as every wait), the command
runs on the head node (where the batch script runs) with RAY_ADDRESS set and the head's address as its
driver's node address (GYMV_DRIVER_NODE_IP, so Ray need not guess the interface); when it ends, the steps are stopped and its exit code is the launcher's. The
cluster uses Ray's token authentication: a token is made for the job unless one is given (RAY_AUTH_TOKEN),
and reaches the nodes and the command through the environment srun passes on. Node addresses come from
the hostnames (resolved on the batch host); several nodes on one host get ports of their own. The nodes
listen on the node's network (as every node of a multi-node Ray cluster must): keep the allocation on a
private network; the token guards Ray's own RPCs.

What reaches the batch script is checked or quoted: an #SBATCH value is one word of printable characters
(a line break there would start a line bash runs), and every word of a command is shell-quoted.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.cluster_limits import MAX_NODES, MAX_PORT, check_port, has_control_or_space, one_line
from gymv.cluster.preflight import NODE_LABEL
from gymv.cluster.ray_cluster import (DRIVER_NODE_IP, Deadline, authenticate, check_token_path, loopback_only,
                                      use_token_auth, wait_for_gcs)
from gymv.errors import GymvError
from gymv.recipes.drivers import parse_driver

DEFAULT_PORT = 6379


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_NODELIST"))


def allocation_hosts() -> list[str]:
    """The allocation's node names, in SLURM's order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise GymvError(f"cannot list the allocation's nodes with scontrol ({e})", where="SLURM_JOB_NODELIST",
                        fix="run inside a SLURM allocation (sbatch or salloc) on a host with the SLURM tools") from None
    hosts = [h for h in out.split() if h]
    if not hosts:
        raise GymvError(f"scontrol lists no node for SLURM_JOB_NODELIST={nodelist!r}", where="SLURM_JOB_NODELIST",
                        fix="run inside a SLURM allocation (sbatch or salloc)")
    return hosts


def node_address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise GymvError(f"cannot resolve node {host!r} ({e})", where="SLURM_JOB_NODELIST",
                        fix="the allocation's host names must resolve on the batch host (DNS or /etc/hosts)") from None


@dataclass(frozen=True)
class RayNode:
    index: int
    host: str
    address: str

    def start_command(self, head: RayNode, port: int, *, shared_host: bool, num_cpus: int | None,
                      num_gpus: int | None) -> list[str]:
        """`ray start --block` for this node: the head opens the cluster at `port`, the others join it."""
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--block", f"--node-ip-address={self.address}",
                f"--labels={NODE_LABEL}={self.index}", "--disable-usage-stats"]
        if self.index == 0:  # a temp dir of its own: Ray's default one would make this the machine's
            argv += ["--head", f"--port={port}", "--include-dashboard=false",  # cluster for any local ray.init()
                     f"--temp-dir={temp_dir(port)}"]
        else:
            argv += [f"--address={head.address}:{port}"]
        if num_cpus is not None:
            argv.append(f"--num-cpus={num_cpus}")
        if num_gpus is not None:
            argv.append(f"--num-gpus={num_gpus}")
        if shared_host:  # several nodes on one host: ports of their own
            base = port + 100 + 20 * self.index
            argv += [f"--node-manager-port={base}", f"--object-manager-port={base + 1}",
                     f"--dashboard-agent-grpc-port={base + 2}", f"--dashboard-agent-listen-port={base + 3}",
                     f"--metrics-export-port={base + 4}", f"--runtime-env-agent-port={base + 5}",
                     f"--min-worker-port={20000 + 1000 * self.index}", f"--max-worker-port={20999 + 1000 * self.index}"]
        return argv


def temp_dir(port: int) -> str:
    """The head's Ray temp dir, per job (Ray records the running cluster there for `ray.init()` to find)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"gymv-ray-{os.environ.get('SLURM_JOB_ID', 'job')}-{port}")


def srun(host: str, argv: Sequence[str], gpus_per_node: int = 0) -> list[str]:
    """One task on `host`, beside the batch step (`--overlap`), holding the node's GPUs."""
    gpus = [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    return ["srun", "--nodes=1", "--ntasks=1", "--overlap", f"--nodelist={host}", *gpus, *argv]


def job_environment(nodes: Sequence[RayNode]) -> dict[str, str]:
    """What the nodes and the command share: a token for Ray's authentication (the one given, or a new one
    for this job), and the loopback switch where the head is 127.0.0.1."""
    env = {"RAY_AUTH_MODE": "token"}
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    return env


class RayOnSlurm:
    """The Ray nodes of one allocation, started by `start` and stopped by `stop`."""

    def __init__(self, hosts: Sequence[str], *, port: int = DEFAULT_PORT, num_cpus: int | None = None,
                 num_gpus: int | None = None, gpus_per_node: int = 0, say: Callable[[str], None] = print):
        self.nodes = [RayNode(i, h, node_address(h)) for i, h in enumerate(hosts)]
        self.port, self.num_cpus, self.num_gpus, self.gpus_per_node = port, num_cpus, num_gpus, gpus_per_node
        if _shared_host(self.nodes):  # the ports RayNode.start_command gives the last node
            last = len(self.nodes) - 1
            top = max(port + 100 + 20 * last + 5, 20999 + 1000 * last)
            if top > MAX_PORT:
                raise GymvError(f"{len(self.nodes)} Ray nodes on one host from --port {port} need ports up to {top}",
                                where="--port", fix=f"choose a lower --port (at most {port - (top - MAX_PORT)}), or "
                                                    "fewer nodes per host")
        self.say = say
        self.env = {**os.environ, **job_environment(self.nodes)}
        self.steps: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"{self.nodes[0].address}:{self.port}"

    def start(self, deadline_s: float) -> str:
        """Start every node and wait (at most `deadline_s` in all) until all have joined; returns the address."""
        deadline = Deadline.after(deadline_s, "--timeout")
        shared = _shared_host(self.nodes)
        head = self.nodes[0]
        for node in self.nodes:
            argv = node.start_command(head, self.port, shared_host=shared, num_cpus=self.num_cpus,
                                      num_gpus=self.num_gpus)
            self.say(f"starting Ray node {node.index} on {node.host} ({node.address})")
            command = srun(node.host, argv, self.gpus_per_node)
            try:
                self.steps.append(subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL,
                                                   start_new_session=True))
            except OSError as e:
                raise GymvError(f"cannot run {command[0]} ({e.strerror or e})", where="gymv cluster up",
                                fix=SRUN_FIX) from None
            if node is head:
                self._wait_for_head(deadline)
        self._wait_for_nodes(deadline)
        return self.address

    def _wait_for_head(self, deadline: Deadline) -> None:
        while deadline.left() > 0:
            self._check_steps()
            try:
                with socket.create_connection((self.nodes[0].address, self.port), timeout=min(1.0, deadline.left())):
                    return
            except OSError:
                time.sleep(min(0.5, deadline.left()))
        raise GymvError(f"the Ray head on {self.nodes[0].host} did not open {self.address} within "
                        f"{deadline.seconds:g} s", where="--timeout", exit_code=1, fix="see the head's log above; raise --timeout")

    def _wait_for_nodes(self, deadline: Deadline) -> None:
        import ray

        env = {k: v for k, v in self.env.items() if k.startswith("RAY_")}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            use_token_auth()
            if self.nodes[0].address.startswith("127."):
                loopback_only(ray)
            wait_for_gcs(self.address, deadline, "--port", not_gcs_fix="another program holds this port on the "
                                                                        "head node: choose a free --port")
            authenticate(self.address, deadline, "--port")
            ray.init(address=self.address, logging_level="ERROR", log_to_driver=False,
                     _node_ip_address=self.nodes[0].address)  # this launcher runs on the head node
            try:
                while (alive := sum(1 for n in ray.nodes() if n.get("Alive"))) < len(self.nodes):
                    self._check_steps()
                    if deadline.left() <= 0:
                        raise GymvError(f"{alive} of {len(self.nodes)} Ray nodes joined the cluster at {self.address} "
                                        f"within {deadline.seconds:g} s", where="--timeout", exit_code=1,
                                        fix="see the nodes' logs above; raise --timeout")
                    time.sleep(min(1.0, deadline.left()))
            finally:
                ray.shutdown()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        self.say(f"Ray cluster of {len(self.nodes)} nodes at {self.address}")

    def _check_steps(self) -> None:
        for node, step in zip(self.nodes, self.steps):
            if step.poll() is not None:
                raise GymvError(f"the Ray node on {node.host} exited with code {step.returncode} while starting",
                                where="gymv cluster up", exit_code=1, fix="see its log above")

    def run(self, command: Sequence[str]) -> int:
        """Run `command` against the cluster (RAY_ADDRESS and the token in its environment)."""
        env = {**self.env, "RAY_ADDRESS": self.address, DRIVER_NODE_IP: self.nodes[0].address}
        try:
            return subprocess.run(list(command), env=env).returncode
        except OSError as e:
            raise GymvError(f"cannot run {command[0]!r} ({e.strerror or e})", where="gymv cluster up",
                            exit_code=COMMAND_NOT_FOUND, fix="check the command after `--`") from None

    def stop(self, grace_s: float = 45.0) -> None:
        """End every node's step: SIGTERM (srun passes it to `ray start`, which stops its node), then SIGKILL."""
        for step in self.steps:
            if step.poll() is None:
                _signal_group(step, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for step in self.steps:
            try:
                step.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(step, signal.SIGKILL)
                step.wait()
        self.steps = []


def _shared_host(nodes: Sequence[RayNode]) -> bool:
    """Whether some nodes share a host (the same address, or loopback addresses), so need ports of their own."""
    loopback = [n for n in nodes if n.address.startswith("127.")]
    return len({n.address for n in nodes}) < len(nodes) or len(loopback) > 1


SRUN_FIX = "run inside a SLURM allocation (sbatch or salloc) on a host with the SLURM tools (srun on PATH)"
COMMAND_NOT_FOUND = 127  # a shell's exit code for a command it cannot find


def _check_runnable(command: Sequence[str]) -> None:
    """The command's program exists and may be run (a path, or a name on PATH), before any node starts."""
    program = command[0]
    if not shutil.which(program):
        place = "no executable file at that path" if os.sep in program else "no such program on PATH"
        raise GymvError(f"cannot run {program!r}: {place}", where="gymv cluster up", exit_code=COMMAND_NOT_FOUND,
                        fix="check the command after `--`: a program on PATH or the path of an executable file")


def check_launch_options(*, port: int, timeout_s: float, num_cpus: int | None, num_gpus: int | None,
                         gpus_per_node: int) -> None:
    """`gymv cluster up`'s options, refused before anything starts."""
    check_port(port, "--port")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise GymvError(f"--timeout must be a number of seconds above 0, not {timeout_s!r}", where="--timeout",
                        fix="give the seconds every node may take to join, e.g. --timeout 300")
    for flag, value in (("--num-cpus", num_cpus), ("--num-gpus", num_gpus), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 0:
            raise GymvError(f"{flag} must be 0 or more, not {value}", where=flag, fix=f"give {flag} 0 or more, or "
                                                                                      "leave it out")


def _signal_group(step: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(step.pid, sig)  # the step's own session: srun and what it started on this host
    except OSError:
        pass


def cluster_up(command: Sequence[str], *, port: int = DEFAULT_PORT, timeout_s: float = 300.0,
               num_cpus: int | None = None, num_gpus: int | None = None, gpus_per_node: int = 0,
               say: Callable[[str], None] = print) -> int:
    """Start Ray on the allocation, run `command`, stop Ray; the command's exit code. Outside an allocation
    the command runs as it is (a local cluster, or the --ray-address it names)."""
    if not command:
        raise GymvError("no command to run", where="gymv cluster up", fix="gymv cluster up -- gymv train RECIPE")
    check_launch_options(port=port, timeout_s=timeout_s, num_cpus=num_cpus, num_gpus=num_gpus,
                         gpus_per_node=gpus_per_node)
    _check_runnable(command)
    if not in_allocation():
        say("not inside a SLURM allocation (no SLURM_JOB_NODELIST): running the command as it is")
        try:
            return subprocess.run(list(command)).returncode
        except OSError as e:
            raise GymvError(f"cannot run {command[0]!r} ({e.strerror or e})", where="gymv cluster up",
                            exit_code=COMMAND_NOT_FOUND, fix="check the command after `--`") from None
    if not shutil.which("srun"):
        raise GymvError("srun is not on PATH", where="gymv cluster up", fix=SRUN_FIX)
    check_token_path()
    cluster = RayOnSlurm(allocation_hosts(), port=port, num_cpus=num_cpus, num_gpus=num_gpus,
                         gpus_per_node=gpus_per_node, say=say)
    # SLURM ends a job (time limit, scancel) with SIGTERM: stop the nodes on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        cluster.start(timeout_s)
        return cluster.run(command)
    finally:
        cluster.stop()


def check_write_target(path: Path) -> None:
    """`gymv cluster sbatch --write PATH`: a file in a folder that exists (a typo'd folder is not made)."""
    if path.is_dir():
        raise GymvError(f"{one_line(str(path))} is a folder", where="--write",
                        fix=f"name a file in it, e.g. {one_line(str(path / 'job.sh'))}")
    if not path.parent.is_dir():
        raise GymvError(f"the folder {one_line(str(path.parent))} does not exist", where="--write",
                        fix=f"create it first (mkdir -p {shlex.quote(str(path.parent))}) or write the script elsewhere")


_SLURM_TIME = re.compile(r"\d+(?::\d+){0,2}|\d+-\d+(?::\d+){0,2}|(?i:unlimited|infinite)")
_SBATCH_QUOTING = set("\"'\\")


def sbatch_value(option: str, value: str, where: str | None = None) -> str:
    """`value` for an #SBATCH line: one non-empty word of printable characters. A line break would end the
    comment and start a line bash runs; a space or a quote would split or merge the options SLURM reads."""
    if not isinstance(value, str) or not value:
        problem = "is empty"
    elif any(ch in "\n\r\x0b\x0c\x85\u2028\u2029" for ch in value):
        problem = "holds a line break"
    elif has_control_or_space(value):
        problem = "holds whitespace or a control character"
    elif _SBATCH_QUOTING & set(value):
        problem = "holds a quote or a backslash"
    else:
        return value
    raise GymvError(f"{option} {value!r} {problem}: an #SBATCH value is one word of printable characters",
                    where=one_line(where or option),
                    fix=f"give {option} without spaces, line breaks, quotes or backslashes")


@dataclass(frozen=True)
class BatchJob:
    """What `gymv cluster sbatch` asks SLURM for: the recipe's nodes and GPUs, and the command to run."""

    nodes: int
    gpus_per_node: int
    command: tuple[str, ...]
    job_name: str
    time: str | None = None
    account: str | None = None
    partition: str | None = None
    output: str | None = None
    workdir: str | None = None
    port: int = DEFAULT_PORT
    launcher: bool = True  # run the command through `gymv cluster up` (a driver already does)
    job_name_from: str = "--job-name"  # where the job name comes from (a recipe's `name`, a driver's file)

    def __post_init__(self) -> None:
        for what, value, low, high in (("cluster.num_nodes", self.nodes, 1, MAX_NODES),
                                       ("cluster.gpus_per_node", self.gpus_per_node, 0, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                raise GymvError(f"{what} is {value!r}, not a whole number from {low}" + (f" to {high}" if high else
                                                                                       " up"),
                                where=what, fix="fix the recipe's (or the driver's) node and GPU counts")
        check_port(self.port, "--port")
        sbatch_value("--job-name", self.job_name, self.job_name_from)
        for flag in ("time", "account", "partition", "output"):
            if getattr(self, flag) is not None:
                sbatch_value(f"--{flag}", getattr(self, flag))
        if self.time is not None and not _SLURM_TIME.fullmatch(self.time):
            raise GymvError(f"--time {self.time!r} is no SLURM time limit", where="--time",
                            fix="write minutes, HH:MM:SS, D-HH:MM:SS (e.g. 4:00:00) or UNLIMITED")

    @classmethod
    def for_driver(cls, path: Path, args: Sequence[str] = (), **kw) -> BatchJob:
        """One launch of a test-suite driver, sized as its CONFIG block says (what `gymv dry-run` counts per
        run: NUM_NODES x GPUS_PER_NODE for NUM_MINUTES); the driver itself goes through `gymv cluster up`."""
        d = parse_driver(path)
        if kw.get("time") is None:
            kw["time"] = str(d.allocation("NUM_MINUTES"))  # SLURM reads a bare number as minutes
        return cls(d.allocation("NUM_NODES"), d.allocation("GPUS_PER_NODE"), ("bash", str(path.resolve()), *args),
                   path.stem, launcher=False, job_name_from=str(path), **kw)

    def script(self) -> str:
        """The batch script. Its #SBATCH values were checked to be single words; everything on a command line
        is shell-quoted, so no value reaches bash as code."""
        head = [f"#SBATCH --job-name={self.job_name}", f"#SBATCH --nodes={self.nodes}", "#SBATCH --ntasks-per-node=1",
                "#SBATCH --exclusive"]
        if self.gpus_per_node:
            head.append(f"#SBATCH --gpus-per-node={self.gpus_per_node}")
        for flag, value in (("time", self.time), ("account", self.account), ("partition", self.partition),
                            ("output", self.output)):
            if value:
                head.append(f"#SBATCH --{flag}={value}")
        gymv = shlex.join([sys.executable, "-m", "gymv_cli.main"])
        up = ["cluster", "up", *([f"--port={self.port}"] if self.port != DEFAULT_PORT else []),
              *([f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else [])]
        lines = ["#!/usr/bin/env bash", f"# written by `gymv cluster sbatch`: {self.nodes} node(s) x "
                 f"{self.gpus_per_node} GPU(s); Ray starts on every node, then the command runs", *head, "",
                 "set -euo pipefail"]
        if self.workdir:
            lines.append(f"cd {shlex.quote(self.workdir)}")
        run = f"{gymv} {shlex.join(up)} -- {shlex.join(self.command)}" if self.launcher else shlex.join(self.command)
        lines.append(f"exec {run}")
        return "\n".join(lines) + "\n"
