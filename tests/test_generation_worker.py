"""A generation worker runs episodes within the run's budgets, which it reads from the sections of its spec;
a call for rollouts carries only what changes from call to call (rows, group size, sampling, seed)."""

from __future__ import annotations

import random

import pytest

from gymv.backends.generation import SamplingParams
from gymv.cluster.workers import GenerationWorker, RolloutRequest, WorkerSpec
from gymv.sections import EnvSection, ModelSection
from tiny_models import tiny_path

ENV = "arithmetic"


def rows(worker: GenerationWorker, n: int = 2) -> list[tuple[int, dict]]:
    env = worker.router.default
    return [(i, env.make_row(random.Random(i), env.presets["default"], i)) for i in range(n)]


@pytest.fixture(scope="module")
def budget_worker():
    """A worker whose spec allows 3 generated tokens an episode."""
    return GenerationWorker(WorkerSpec(model_path=str(tiny_path("tiny-qwen3")),
                                       env=EnvSection(name=ENV, max_rollout_tokens=3), threads=1))


def test_an_episode_stops_at_the_token_budget_of_the_workers_env_section(budget_worker):
    request = RolloutRequest(group_size=2, params=SamplingParams(max_new_tokens=8, temperature=1.0), seed=3)
    out = budget_worker.rollouts(rows(budget_worker), request)
    trajectories = out["trajectories"]
    assert len(trajectories) == 4 and all(t.num_generated <= 3 for t in trajectories)
    assert any(t.truncated and t.finish_reason == "length" for t in trajectories)


def test_an_episode_stops_at_the_sequence_length_of_the_workers_model_section(budget_worker):
    request = RolloutRequest(group_size=1, params=SamplingParams(max_new_tokens=8), seed=3)
    [(index, row)] = rows(budget_worker, 1)
    [free] = budget_worker.rollouts([(index, row)], request)["trajectories"]
    short = GenerationWorker(WorkerSpec(model_path=str(tiny_path("tiny-qwen3")), env=EnvSection(name=ENV),
                                        model=ModelSection(max_seq_len=free.prompt_length + 1), threads=1))
    [cut] = short.rollouts([(index, row)], request)["trajectories"]
    assert free.num_generated > 1
    assert len(cut.token_ids) <= free.prompt_length + 1 and cut.finish_reason == "length"
