"""Where an async refit lands on a generation worker (real Ray actors, a real env server with a slow step):
between rollouts by default, beside a running rollout with in-flight updates."""

from __future__ import annotations

import threading

import pytest

from gymv.cluster.group import Placement, PolicyCluster
from gymv.cluster.workers import RolloutRequest
from gymv.config import load_recipe
from gymv.envs import get_env
from gymv.envs.server import EnvServer
from gymv.train.replay import Group, ReplayBuffer
from gymv.train.setup import sampling_params, worker_spec
from tiny_models import tiny_path
from train_helpers import REPO, ray_module

STEP_S = 3.0  # every env step on the server takes this long


@pytest.fixture(scope="module")
def server():
    with EnvServer(get_env("circle-count"), step_latency_s=STEP_S) as srv:
        srv.step_started = threading.Event()  # set when a step (or tool call) reaches the server
        slow = srv._wait

        def wait():
            srv.step_started.set()
            slow()

        srv._wait = wait
        yield srv


def cluster_for(server, *, in_flight: bool) -> tuple[PolicyCluster, RolloutRequest]:
    cfg = load_recipe(REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml",
                      [f"model.path={tiny_path('tiny-llava')}", f"env.url={server.url}", "generation.max_new_tokens=4",
                       "env.max_turns=1", "env.max_rollout_tokens=8", "model.max_seq_len=512",
                       "cluster.ray_address=null"]).validated
    cluster = PolicyCluster(worker_spec(cfg, str(tiny_path("tiny-llava"))), Placement.from_config(cfg),
                            in_flight_refit=in_flight)
    return cluster, RolloutRequest(group_size=1, params=sampling_params(cfg), seed=1)


def row():
    import random

    env = get_env("circle-count")
    return env.make_row(random.Random(0), env.presets["tiny"], 0)


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [False, True])
def test_an_async_refit_lands_after_the_running_rollout_unless_in_flight(server, in_flight):
    with ray_module():
        cluster, request = cluster_for(server, in_flight=in_flight)
        try:
            cluster.refit(0)  # transports connect once, synchronously, before the run starts
            server.step_started.clear()
            [call] = cluster.submit_rollouts([(0, row())], request)
            assert server.step_started.wait(timeout=120)  # the rollout now waits on the server's slow step
            import ray

            refs = cluster.refit_async(1)
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=STEP_S / 2)
            out = ray.get(call.ref)
            assert (len(done) == len(refs)) is in_flight
            assert out["weights_version"] == 0  # the rollout started on the initial weights
            assert out["last_weights_version"] == (1 if in_flight else 0)
            ray.get(refs)
            trainer, generators = cluster.weight_hashes()
            assert generators == [trainer]
        finally:
            cluster.shutdown()


def test_a_group_older_than_the_bound_is_dropped_at_the_step_that_would_take_it():
    buf = ReplayBuffer(capacity=8, max_age=1)
    buf.add([Group(batch=2, version=1, trajectories=[1, 2]), Group(batch=1, version=0, trajectories=[3, 4])])
    assert [g.version for g in buf.prune(3)] == [0]  # age (3 - 1) - 0 = 2 > 1
    assert [g.batch for g in buf.take(4)] == [2]


def test_groups_are_taken_in_data_order_whoever_finished_first():
    buf = ReplayBuffer(capacity=8, max_age=2)
    buf.add([Group(3, 1), Group(2, 1)])
    buf.add([Group(1, 0)])
    assert [g.batch for g in buf.take(2)] == [1, 2] and len(buf) == 1


def test_the_buffer_holds_prompts_per_step_times_age_times_two_groups():
    assert ReplayBuffer.for_run(8, 1).capacity == 16
    assert ReplayBuffer.for_run(8, 3).capacity == 48
    assert ReplayBuffer.for_run(8, 0).capacity == 16  # age 0 still double-buffers one batch


def test_age_counts_optimizer_steps_since_the_generating_weights():
    assert Group(batch=5, version=4).age(5) == 0 and Group(batch=5, version=3).age(5) == 1
