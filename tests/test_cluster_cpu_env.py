"""CPU actors run with passive OpenMP waiting (gymv.cluster.ray_cluster.cpu_env). On a CPU cluster this process
started, every worker inherits it from the raylet, so the actors need no runtime_env (a worker with one starts
through Ray's extra set-up process, about 0.3 s later); a value the workers did not inherit still reaches them
through one."""

from __future__ import annotations

import os

import pytest

from gymv.cluster.ray_cluster import cpu_actor_options, cpu_env
from train_helpers import ray_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


def _actor_env(options: dict) -> str | None:
    import ray

    @ray.remote(num_cpus=0)
    class Env:
        def get(self, key: str) -> str | None:
            return os.environ.get(key)

    actor = Env.options(**options).remote()
    try:
        return ray.get(actor.get.remote("OMP_WAIT_POLICY"), timeout=60)
    finally:
        ray.kill(actor)


def test_a_cpu_actor_of_a_cluster_started_here_inherits_passive_waiting_without_a_runtime_env():
    import ray

    if ray.cluster_resources().get("GPU", 0):
        pytest.skip("the local cluster has GPUs: its actors are not all CPU actors")
    assert cpu_actor_options() == {}
    assert _actor_env(cpu_actor_options()) == cpu_env()["OMP_WAIT_POLICY"]


def test_a_setting_the_workers_did_not_inherit_reaches_the_actor_through_a_runtime_env(monkeypatch):
    inherited = _actor_env({})
    wanted = "ACTIVE" if inherited != "ACTIVE" else "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", wanted)
    options = cpu_actor_options()
    assert options == {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": wanted}}}
    assert _actor_env(options) == wanted
