"""Run a batch's episodes through NeMo Gym agent servers instead of gymv's own loop (`rollout.driver:
nemo_gym_agents`).

The generation worker serves its backend as a Responses-API model server (`PolicyServer`) on the port the
agents were configured to call; each (row, sample) becomes one `POST /run` to the agent its `agent_ref.name`
names; the agents call the model server (whose collector batches their requests into the backend), run their
environments and return their results, from which the samples are spliced token for token (`agent_turns`).
What `run_rollouts` returns, this returns: trajectories grouped by row, in row order. An agent that cannot be
reached or answers an error marks only that trajectory's `error` (excluded from training and counted, as an
environment failure is); a result whose tokens do not line up is an error naming the row.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from gymv.backends.generation.base import SamplingParams
from gymv.envs.rows import agent_name
from gymv.errors import GymvError
from gymv.rollout.agent_turns import trajectory_from_result
from gymv.rollout.policy_server import PolicyServer
from gymv.rollout.types import Trajectory

MAX_AGENT_CALLS = 64  # episodes in flight at once


def _where(task_index: int, sample: int, group_size: int) -> str:
    return f"row {task_index}" + (f" sample {sample}" if group_size > 1 else "")


def agent_url(agents: Mapping[str, str], row: dict, where: str) -> str:
    name = agent_name(row)
    if name in agents:
        return agents[name].rstrip("/")
    if len(agents) == 1 and name is None:
        return next(iter(agents.values())).rstrip("/")
    raise GymvError(f"no agent server for agent_ref.name {name!r}", where=where,
                    fix=f"add it to rollout.agents (configured: {', '.join(sorted(agents)) or 'none'})")


def _run(url: str, row: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url + "/run", data=json.dumps(row).encode("utf-8"), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:500]
        raise RuntimeError(f"agent {url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"agent {url} could not be reached: {getattr(e, 'reason', e)}") from None


def run_agent_rollouts(server: PolicyServer, agents: Mapping[str, str], rows: Sequence[tuple[int, dict]], *,
                       group_size: int, params: SamplingParams, seed: int | None = None, weights_version: int = 0,
                       timeout_s: float = 600.0, stats: dict | None = None) -> list[Trajectory]:
    """G episodes of each (dataset index, row), driven by the agents; trajectories grouped, in row order.
    `seed` (the step's sampling seed, else `params.seed`) seeds this call's batches, each its own draw."""
    t0 = time.perf_counter()
    server.params = replace(params, seed=seed if seed is not None else params.seed)
    jobs = [(task_index, g, row, agent_url(agents, row, _where(task_index, g, group_size)))
            for task_index, row in rows for g in range(group_size)]

    def one(job) -> Trajectory:
        task_index, g, row, url = job
        where = _where(task_index, g, group_size)
        name = agent_name(row) or "agent"
        try:
            result = _run(url, row, timeout_s)
        except RuntimeError as e:
            return Trajectory(row=row, task_index=task_index, sample_index=g, agent_name=name, error=str(e),
                              finish_reason="error", weights_version=weights_version)
        return trajectory_from_result(result, row, server.rebuilder, task_index=task_index, sample_index=g,
                                      agent_name=name, where=where, weights_version=weights_version)

    with ThreadPoolExecutor(max_workers=min(MAX_AGENT_CALLS, max(1, len(jobs)))) as pool:
        trajectories = list(pool.map(one, jobs))
    if stats is not None:
        stats.update({"generation_s": 0.0, "env_s": time.perf_counter() - t0, "total_s": time.perf_counter() - t0,
                      "generate_calls": len(server.batches), "image_decodes": server.rebuilder.cache.decodes,
                      "image_decode_hits": server.rebuilder.cache.hits})
    return trajectories
