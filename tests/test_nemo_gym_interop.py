"""gymv against the real NeMo Gym (nemo-gym 0.4.0, its own servers and agents), in both directions.

NeMo Gym runs from a Python 3.12 venv that scripts/nemo_gym_venv.sh makes once (outside the repo); its servers
and agents are its own classes, set up as its `run_webserver` does (tests/nemo_gym_peer/serve.py), on 127.0.0.1.
gymv -> NeMo Gym: gymv's remote client plays episodes on NeMo Gym's circle_count, circle_click and gymnasium
servers, and `gymv train` trains against circle_count. NeMo Gym -> gymv: NeMo Gym's simple_agent and
gymnasium_agent run gymv's environments (`gymv env serve`'s server), image tools included, and NeMo Gym's and
gymv's servers accept and refuse the same bodies. The one stand-in is the policy behind the agents: a scripted
Responses-API model server (tests/nemo_gym_peer/harness.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gymv.envs import ModelTurn, ToolCall, get_env
from gymv.envs.remote import RemoteEnv
from gymv.envs.responses import request_body
from gymv.envs.server import EnvServer
from gymv.errors import GymvError
from nemo_gym_peer.harness import (AGENTS, RESOURCES, NemoGymProcess, ScriptedModel, nemo_gym_python, post_json,
                              start_all)
from rollout_helpers import tiny_rows

pytestmark = pytest.mark.slow

GYMV_ENVS = ("circle-count", "polygon-naming", "doorkey", "tangram", "scripted")
AGENT_RUNS = [("simple_agent", "circle-count"), ("simple_agent", "polygon-naming"), ("simple_agent", "doorkey"),
              ("simple_agent", "tangram"), ("gymnasium_agent", "polygon-naming"), ("gymnasium_agent", "doorkey"),
              ("gymnasium_agent", "tangram"), ("gymnasium_agent", "scripted")]


@pytest.fixture(scope="module")
def python() -> str:
    py = nemo_gym_python()
    if py is None:
        pytest.skip("no Python 3.12 on this machine: nemo-gym 0.4.0 needs it (pyenv install 3.12)")
    return py


@pytest.fixture(scope="module")
def world(python):
    """NeMo Gym's resources servers, gymv's servers, the scripted model and NeMo Gym's agents, all running."""
    gymv_servers = {name: EnvServer(get_env(name)).start() for name in GYMV_ENVS}
    model = ScriptedModel()
    peers = {"policy_model": model.url, **{f"gymv_{n}": s.url for n, s in gymv_servers.items()}}
    starters = [lambda n=n, c=c: NemoGymProcess(python, n, c) for n, c in RESOURCES.items()]
    for agent, env in AGENT_RUNS:
        config = {"resources_server": {"type": "resources_servers", "name": f"gymv_{env}"},
                  "model_server": {"type": "responses_api_models", "name": "policy_model"}, "max_steps": 8}
        starters.append(lambda a=agent, e=env, c=config: NemoGymProcess(python, f"{a}_{e}", AGENTS[a], config=c,
                                                                        servers=peers))
    procs = start_all(starters)
    yield {"python": python, "ng": {p.name: p for p in procs}, "gymv": gymv_servers, "model": model}
    for p in procs:
        p.stop()
    for s in gymv_servers.values():
        s.close()
    model.close()


def ng_url(world, name: str) -> str:
    return world["ng"][name].url


# ---------------------------------------------------------------------------------------------- gymv -> NeMo Gym

COUNT_ANSWERS = ["\\boxed{{{n}}}", "\\boxed{{{wrong}}}", "{n}", "\\boxed{{}}", "", "\\boxed{{ {n} }}",
                 "\\boxed{{{n}}} or \\boxed{{{wrong}}}", "\\boxed{{{wrong}}} then \\boxed{{{n}}}", "<think>\\boxed{{{n}}}"]


def test_gymv_client_scores_circle_count_answers_as_nemo_gym_verifies_them(world):
    env, rows = tiny_rows("circle-count", 3)
    remote = RemoteEnv(ng_url(world, "circle_count"), name="circle-count")
    assert remote.protocol == "resources"
    agree = total = 0
    for _, row in rows:
        n = int(env.gold_turn(row).text.split("{")[1].split("}")[0])
        for answer in COUNT_ANSWERS:
            output = ModelTurn(text=answer.format(n=n, wrong=n + 1)).to_items()
            total += 1
            agree += remote.score_output(row, output).reward == env.score_output(row, output).reward
    assert (agree, total) == (27, 27)


def test_gymv_client_rescoring_nemo_gyms_recorded_rollouts_gives_their_rewards(world, vectors):
    for env_name, server in (("circle_count", "circle_count"), ("circle_click", "circle_click")):
        rows = [json.loads(x) for x in (vectors / "nemo_gym" / env_name / "example.jsonl").read_text().splitlines()]
        remote = RemoteEnv(ng_url(world, server), name=env_name.replace("_", "-"))
        for line in (vectors / "nemo_gym" / env_name / "example_rollouts.jsonl").read_text().splitlines():
            rollout = json.loads(line)
            row = {**rows[rollout["_ng_task_index"]], **{k: v for k, v in rollout.items() if k != "response"}}
            assert remote.score_output(row, rollout["response"]["output"]).reward == rollout["reward"]


@pytest.mark.parametrize("args, hit", [(None, True), ('{"x": 0, "y": 0}', False), ('{"x": "abc", "y": 1}', False),
                                       ('{"x": 1', False)])
def test_gymv_client_plays_circle_click_episodes_on_nemo_gyms_server(world, args, hit):
    env, rows = tiny_rows("circle-click", 1)
    row = rows[0][1]
    remote = RemoteEnv(ng_url(world, "circle_click"), name="circle-click")
    gold = env.gold_turn(row)
    turn = gold if args is None else ModelTurn(tool_calls=[ToolCall("click", args)])
    state = remote.start(row)
    if not remote.step(state, turn).done:
        remote.step(state, ModelTurn(text="done"))
    assert remote.score(state).reward == (1.0 if hit else 0.0) == env.score_output(row, state.output).reward


def test_auto_protocol_recognises_a_nemo_gym_gymnasium_server(world):
    assert RemoteEnv(ng_url(world, "example_multi_turn_gymnasium"), name="scripted").protocol == "gymnasium"


def test_the_wrong_protocol_error_names_the_right_one(world):
    remote = RemoteEnv(ng_url(world, "circle_count"), name="circle-count", protocol="gymnasium")
    _, rows = tiny_rows("circle-count", 1)
    with pytest.raises(GymvError) as e:
        remote.start(rows[0][1])
    assert "env.kwargs.protocol: resources" in e.value.one_line()


def _multi_turn_rows(vectors) -> list[dict]:
    path = vectors / "nemo_gym" / "example_multi_turn_gymnasium" / "example.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_gymv_client_plays_nemo_gyms_scripted_multi_turn_episodes_to_its_reward(world, vectors):
    remote = RemoteEnv(ng_url(world, "example_multi_turn_gymnasium"), name="scripted", max_turns=5)
    for row in _multi_turn_rows(vectors):
        for final, reward in ((f"It is the {row['expected_answer']}.", 1.0), ("I do not know.", 0.0)):
            state = remote.start(row)
            for _ in row["follow_ups"]:
                result = remote.step(state, ModelTurn(text="an answer"))
                assert not result.done and result.user_messages
            assert remote.step(state, ModelTurn(text=final)).done
            assert remote.score(state).reward == reward


def test_an_episode_cut_by_max_turns_on_a_server_without_verify_scores_its_step_rewards(world, vectors):
    row = next(r for r in _multi_turn_rows(vectors) if r["follow_ups"])
    remote = RemoteEnv(ng_url(world, "example_multi_turn_gymnasium"), name="scripted", max_turns=1)
    state = remote.start(row)
    assert remote.step(state, ModelTurn(text=row["expected_answer"])).done
    assert remote.score(state).reward == 0.0  # NeMo Gym's gymnasium_agent: truncated, the rewards so far


# ---------------------------------------------------------------------------------------------- NeMo Gym -> gymv

def _run_agent(world, agent: str, env_name: str, row: dict, turns: list[ModelTurn]) -> dict:
    world["model"].answer(row, turns)
    status, body = post_json(ng_url(world, f"{agent}_{env_name}") + "/run", row)
    assert status == 200, body
    return body


@pytest.mark.parametrize("agent, env_name", AGENT_RUNS)
def test_nemo_gym_agents_run_gymv_environments_to_the_gold_reward(world, agent, env_name):
    env, rows = tiny_rows(env_name, 1)
    row = rows[0][1]
    result = _run_agent(world, agent, env_name, row, env.gold_turns(row))
    assert result["reward"] == 1.0


@pytest.mark.parametrize("agent, env_name", [("simple_agent", "circle-count"), ("gymnasium_agent", "polygon-naming")])
def test_nemo_gym_agents_get_no_reward_for_a_wrong_answer(world, agent, env_name):
    env, rows = tiny_rows(env_name, 1)
    row = rows[0][1]
    result = _run_agent(world, agent, env_name, row, [ModelTurn(text="\\boxed{9999} 1: nothing")])
    assert result["reward"] == 0.0


def test_simple_agent_receives_a_tool_image_as_the_json_text_of_input_parts(world):
    env, rows = tiny_rows("polygon-naming", 1)
    row = rows[0][1]
    result = _run_agent(world, "simple_agent", "polygon-naming", row, env.gold_turns(row))
    outputs = [i for i in result["response"]["output"] if i["type"] == "function_call_output"]
    parts = json.loads(outputs[0]["output"])
    assert [p["type"] for p in parts] == ["input_text", "input_image"]
    assert parts[1]["image_url"].startswith("data:image/png;base64,")


VERIFY_BODIES = {
    "complete": lambda row: request_body(row, ModelTurn(text="\\boxed{3}").to_items()),
    "short response": lambda row: {**row, "response": {"output": []}},
    "no response": lambda row: dict(row),
    "no responses_create_params": lambda row: {k: v for k, v in request_body(row, []).items()
                                               if k != "responses_create_params"},
    "unknown key in responses_create_params": lambda row: request_body(
        {**row, "responses_create_params": {**row["responses_create_params"], "max_tokens": 4}}, []),
    "assistant message without id": lambda row: {**request_body(row, []), "response": {
        **request_body(row, [])["response"], "output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "hi", "annotations": []}]}]}},
    "tool output that is a list": lambda row: {**request_body(row, []), "response": {
        **request_body(row, [])["response"], "output": [{"type": "function_call_output", "call_id": "c",
                                                         "output": [{"type": "input_text", "text": "x"}]}]}},
    "not an object": lambda row: [1, 2],
}


@pytest.mark.parametrize("case", sorted(VERIFY_BODIES))
def test_gymv_server_accepts_and_refuses_verify_bodies_as_nemo_gym_does(world, case):
    _, rows = tiny_rows("circle-count", 1)
    body = VERIFY_BODIES[case](rows[0][1])
    ng_status, ng_body = post_json(ng_url(world, "circle_count") + "/verify", body)
    gv_status, gv_body = post_json(world["gymv"]["circle-count"].url + "/verify", body)
    assert gv_status == ng_status
    if ng_status == 422:
        assert isinstance(gv_body["detail"], list) and isinstance(ng_body["detail"], list)
        assert all(set(e) >= {"type", "loc", "msg"} and e["loc"][0] == "body" for e in gv_body["detail"])


@pytest.mark.parametrize("body", [{"responses_create_params": {"input": "hi"}}, {"follow_ups": []}, {}],
                         ids=["row", "no params", "empty"])
def test_gymv_server_accepts_and_refuses_reset_bodies_as_nemo_gym_does(world, body):
    ng_status, _ = post_json(ng_url(world, "example_multi_turn_gymnasium") + "/reset", body)
    row = tiny_rows("scripted", 1)[1][0][1]
    gv_body = {**row, **body} if "responses_create_params" in body else body
    gv_status, _ = post_json(world["gymv"]["scripted"].url + "/reset", gv_body)
    assert gv_status == ng_status


# ---------------------------------------------------------------------------------------------- records and training

VALIDATE = """
import json, sys
from nemo_gym.base_resources_server import BaseVerifyResponse
bad = []
for n, line in enumerate(sys.stdin):
    try:
        BaseVerifyResponse.model_validate(json.loads(line))
    except Exception as e:
        bad.append(f"{n}: {e}")
print(json.dumps(bad))
"""


def nemo_gym_rejects(python: str, records: list[dict]) -> list[str]:
    """The records NeMo Gym's own response models refuse, with why."""
    proc = subprocess.run([python, "-c", VALIDATE], input="\n".join(json.dumps(r) for r in records),
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


@pytest.mark.timeout(600)
def test_gymv_train_against_nemo_gyms_circle_count_logs_its_rewards_and_valid_rollouts(world, tmp_path):
    from gymv.train import train
    from tiny_models import tiny_path
    from train_helpers import tiny_grpo_settings, write_recipe

    url = ng_url(world, "circle_count")
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
        "env.name": "circle-count", "env.preset": "tiny", "env.url": url, "grpo.max_steps": 2})
    train(write_recipe(tmp_path, "grpo", "vlm_grpo.yaml", settings))
    records = [json.loads(x) for f in sorted((tmp_path / "runs" / "grpo" / "rollouts").glob("step_*.jsonl"))
               for x in f.read_text().splitlines()]
    assert len(records) == 2 * 2 * 2
    assert nemo_gym_rejects(world["python"], records) == []
    for r in records:
        status, verified = post_json(url + "/verify", {k: v for k, v in r.items() if k != "reward"})
        assert status == 200 and verified["reward"] == r["reward"]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    logged = [m["train/reward_mean"] for m in metrics if "train/reward_mean" in m]
    by_step = {}
    for f in sorted((tmp_path / "runs" / "grpo" / "rollouts").glob("step_*.jsonl")):
        rewards = [json.loads(x)["reward"] for x in f.read_text().splitlines()]
        by_step[int(f.stem.split("_")[1])] = sum(rewards) / len(rewards)
    assert logged == pytest.approx([by_step[k] for k in sorted(by_step)])


def test_nemo_gyms_models_accept_gymv_rollout_records_with_tool_images(world):
    from gymv.rollout.record import to_rollout_record  # noqa: F401  (the writer the train test exercises)
    from gymv.runs.rollout_log import make_rollout_record

    env, rows = tiny_rows("polygon-naming", 1)
    row = rows[0][1]
    state = env.start(row)
    for turn in env.gold_turns(row):
        env.step(state, turn)
    record = make_rollout_record(row, state.output, 1.0, model=None, usage={"input_tokens": 5, "output_tokens": 2})
    assert nemo_gym_rejects(world["python"], [record]) == []
