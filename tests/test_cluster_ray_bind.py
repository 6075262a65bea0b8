"""A local Ray cluster started by gymv listens on the loopback interface only (real sockets, from /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from net_listeners import is_loopback

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listeners from /proc (Linux)")

_PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from net_listeners import descendants, listeners
    from gymv.cluster.ray_cluster import start_ray, stop_ray
    import ray

    start_ray(num_cpus=1)

    @ray.remote
    def ping():
        return os.getpid()

    ray.get(ping.remote())  # a worker process is up too
    found = listeners(descendants(os.getpid()))
    stop_ray()
    print("LISTENERS " + json.dumps(found))
""")


@pytest.mark.slow
def test_local_ray_cluster_binds_every_listener_to_loopback(tmp_path):
    tests = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(tests=tests)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("LISTENERS "))
    found = json.loads(line.split(" ", 1)[1])
    assert len(found) >= 3  # GCS, raylet, a worker at least: the probe sees the cluster
    exposed = [(pid, addr, port) for pid, addr, port in found if not is_loopback(addr)]
    assert exposed == [], f"listening beyond 127.0.0.1: {exposed}"


_PRIVATE = textwrap.dedent("""
    import ray
    from gymv.cluster.ray_cluster import start_ray, stop_ray

    info = start_ray(num_cpus=1)
    print("STARTED", info.started_here)
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    env = dict(v.split("=", 1) for v in open(f"/proc/{raylet}/environ").read().split("\\0") if "=" in v)
    print("PRESTART", env.get("RAY_prestart_worker_first_driver"))
    stop_ray()
""")


@pytest.fixture(scope="module")
def private_start(tmp_path_factory) -> str:
    """What a local start prints where another cluster is advertised in RAY_ADDRESS (one Ray start for the module)."""
    # Ray's own default would join the cluster in RAY_ADDRESS or in /tmp/ray/ray_current_cluster (another
    # user's `ray start` on a shared machine) and fail there; gymv's local cluster is its own
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    env.pop("RAY_prestart_worker_first_driver", None)
    out = subprocess.run([sys.executable, "-c", _PRIVATE], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path_factory.mktemp("private"), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_a_local_cluster_is_started_even_where_another_one_is_advertised(private_start):
    assert "STARTED True" in private_start


@pytest.mark.slow
def test_a_local_cluster_prestarts_no_idle_workers_since_gymvs_actors_start_their_own(private_start):
    # Ray would start one idle worker per CPU, each importing Ray, at the moment the run's actors start
    assert "PRESTART 0" in private_start
