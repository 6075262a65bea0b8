"""The policy as a Responses-API model server: NeMo Gym's own agents drive episodes, gymv trains on the tokens.

The policy is the tiny LLaVA with scripted replies (rollout_helpers.ScriptedBackend: real logprobs of given
lines), because a random tiny model never calls a tool. The same episodes run through gymv's own agent loop
and through NeMo Gym's agents (nemo-gym 0.4.0, its own classes) calling gymv's model server; the samples gymv
builds from the agents' results must equal the loop's token for token.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from envs_scripts import END, reply_text
from gymv.backends.multimodal import image_hash
from gymv.backends.generation.base import GenerationBackend, GenerationOutput, SamplingParams
from gymv.envs import get_env
from gymv.envs.responses import wire_item
from gymv.envs.server import EnvServer
from gymv.errors import GymvError
from gymv.rollout import run_rollouts
from gymv.rollout.agent_turns import TurnRebuilder, trajectory_from_result
from gymv.rollout.policy_server import PolicyServer
from gymv.rollout.render import ChatRenderer
from rollout_helpers import ScriptedBackend, tiny_rows
from tiny_models import shared_policy

PARAMS = SamplingParams(max_new_tokens=64)


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def key(request) -> tuple:
    """A prompt as the policy sees it: token ids (image spans are placeholders) and the images themselves."""
    return tuple(request.prompt_token_ids), tuple(image_hash(im) for im in request.images)


class Recorded(GenerationBackend):
    """Answers a prompt the loop saw with exactly what the loop's policy answered there (its tokens and
    logprobs); any other prompt gets an "unscripted" reply, so a prompt that differs by one token or one
    image shows."""

    def __init__(self, policy, replies: dict[tuple, GenerationOutput]):
        self.replies = replies
        self.tokenizer, self.adapter, self.chat_template = policy.tokenizer, policy.adapter, policy.chat_template
        self.calls: list[int] = []

    def generate(self, requests, params):
        self.calls.append(len(requests))
        miss = GenerationOutput(self.tokenizer.encode("unscripted" + END, add_special_tokens=False), [0.0] * 3,
                                "unscripted", "stop")
        return [self.replies.get(key(r), miss) for r in requests]

    def update_weights(self, state_dict):
        raise NotImplementedError

    def reset_encoder_cache(self):
        pass

    def stats(self):
        return {}


def loop_episodes(policy, env_name: str, n: int = 2):
    """gymv's own loop on n rows with gold replies; returns (rows, trajectories, {prompt ids: reply})."""
    env, rows = tiny_rows(env_name, n)
    golds = {i: env.gold_turns(r) for i, r in rows}
    replies: dict[tuple, str] = {}

    def reply(where: str) -> str:
        import re
        task, turn = (int(x) for x in re.search(r"row (\d+).*turn (\d+)", where).groups())
        return reply_text(golds[task][turn]) if turn < len(golds[task]) else "done" + END

    backend = ScriptedBackend(policy, reply)
    trajs = run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, env, rows, group_size=1,
                         params=PARAMS, max_turns=8, max_rollout_tokens=2048, max_seq_len=4096, seed=1)
    for reqs, outs in backend.calls:
        for r, o in zip(reqs, outs):
            replies[key(r)] = o
    return rows, trajs, replies


def post(url: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_response_carries_the_prompt_and_generated_tokens_and_their_logprobs(policy):
    rows, trajs, replies = loop_episodes(policy, "circle-count", 1)
    with PolicyServer(Recorded(policy, replies), params=PARAMS, max_seq_len=4096) as srv:
        status, body = post(srv.url + "/v1/responses", rows[0][1]["responses_create_params"])
    assert status == 200 and body["object"] == "response"
    last = body["output"][-1]
    t = trajs[0]
    assert last["prompt_token_ids"] == t.token_ids[:t.prompt_length]
    assert last["generation_token_ids"] == t.token_ids[t.prompt_length:]
    assert last["generation_log_probs"] == pytest.approx(t.logprobs[t.prompt_length:], abs=1e-6)
    assert body["usage"]["input_tokens"] == t.prompt_length


def test_the_second_call_of_a_tool_episode_is_the_prompt_the_loop_made(policy):
    rows, trajs, replies = loop_episodes(policy, "polygon-naming", 1)
    params = rows[0][1]["responses_create_params"]
    srv_backend = Recorded(policy, replies)
    with PolicyServer(srv_backend, params=PARAMS, max_seq_len=4096) as srv:
        _, first = post(srv.url + "/v1/responses", params)
        env = get_env("polygon-naming")
        state = env.start(rows[0][1])
        from gymv.envs.transcript import turn_from_items

        result = env.step(state, turn_from_items(first["output"]))
        tool_items = [wire_item(r.to_item()) for r in result.tool_results]  # string outputs, as agents send
        _, second = post(srv.url + "/v1/responses", {**params, "input": params["input"] + first["output"] + tool_items})
    t = trajs[0]
    second_call = t.model_calls[1]
    assert second["output"][-1]["prompt_token_ids"] == t.token_ids[:second_call["generation_start"]]


def test_a_conversation_whose_tokens_were_changed_is_an_error_naming_the_turn(policy):
    rows, _, replies = loop_episodes(policy, "polygon-naming", 1)
    params = rows[0][1]["responses_create_params"]
    with PolicyServer(Recorded(policy, replies), params=PARAMS, max_seq_len=4096) as srv:
        _, first = post(srv.url + "/v1/responses", params)
        tampered = [dict(i) for i in first["output"]]
        tampered[-1]["prompt_token_ids"] = tampered[-1]["prompt_token_ids"][:-1]
        status, body = post(srv.url + "/v1/responses", {**params, "input": params["input"] + tampered + [
            {"type": "function_call_output", "call_id": "x", "output": "hi"}]})
    assert status == 400 and "turn 0" in body["detail"] and "do not extend" in body["detail"]


def test_requests_that_arrive_together_are_generated_in_one_call(policy):
    rows, _, replies = loop_episodes(policy, "circle-count", 4)
    with PolicyServer(Recorded(policy, replies), params=PARAMS, max_seq_len=4096, batch_wait_s=0.5) as srv:
        threads = [threading.Thread(target=post, args=(srv.url + "/v1/responses", r["responses_create_params"]))
                   for _, r in rows]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert srv.batches == [4]


def test_a_body_nemo_gym_would_refuse_is_422(policy):
    _, _, replies = loop_episodes(policy, "circle-count", 1)
    with PolicyServer(Recorded(policy, replies), params=PARAMS, max_seq_len=4096) as srv:
        status, body = post(srv.url + "/v1/responses", {"input": "hi", "max_tokens": 3})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "max_tokens"]


def test_a_kept_alive_request_is_answered_as_fast_as_one_on_a_new_connection(policy):
    from http_latency import assert_kept_alive_as_fast

    with PolicyServer(Recorded(policy, {}), params=PARAMS, max_seq_len=4096, batch_wait_s=0.0) as srv:
        host, port = srv.httpd.server_address[:2]
        assert_kept_alive_as_fast(host, port, "POST", "/v1/responses", json.dumps({"input": "hi"}).encode())


def test_a_number_too_long_to_read_is_422_naming_its_field(policy):
    with PolicyServer(Recorded(policy, {}), params=PARAMS, max_seq_len=4096) as srv:
        req = urllib.request.Request(srv.url + "/v1/responses", method="POST",
                                     data=b'{"input": "hi", "max_output_tokens": ' + b"9" * 100_000 + b"}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 422 and json.loads(e.value.read())["detail"][0]["loc"] == ["body", "max_output_tokens"]


def test_a_large_invalid_body_gets_a_small_422(policy):
    body = {"input": "hi", **{f"k{i}": [i] for i in range(500_000)}}
    with PolicyServer(Recorded(policy, {}), params=PARAMS, max_seq_len=4096) as srv:
        req = urllib.request.Request(srv.url + "/v1/responses", method="POST", data=json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        raw = e.value.read()
    assert e.value.code == 422 and len(raw) < 64 * 1024
    assert json.loads(raw)["detail"][-1]["msg"] == "499980 more errors not listed"


def test_a_stalled_body_is_408_and_the_server_goes_on(policy):
    import socket

    with PolicyServer(Recorded(policy, {}), params=PARAMS, max_seq_len=4096) as srv:
        srv.httpd.RequestHandlerClass.idle_timeout_s = 0.5
        host, port = srv.httpd.server_address[:2]
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"in")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        sock.close()
        assert reply.startswith(b"HTTP/1.1 408")
        assert post(srv.url + "/v1/responses", {"input": "hi"})[0] == 200


# ------------------------------------------------------------------------------------------- with NeMo Gym's agents

AGENT_CASES = [("simple_agent", "circle-count"), ("simple_agent", "polygon-naming"), ("gymnasium_agent", "doorkey"),
               ("gymnasium_agent", "scripted")]


@pytest.fixture(scope="module")
def agents(policy):
    from nemo_gym_peer.harness import AGENTS, NemoGymProcess, nemo_gym_python, start_all

    python = nemo_gym_python()
    if python is None:
        pytest.skip("no Python 3.12 on this machine: nemo-gym 0.4.0 needs it (pyenv install 3.12)")
    episodes = {env: loop_episodes(policy, env, 2) for _, env in AGENT_CASES}
    replies = {k: v for _, _, r in episodes.values() for k, v in r.items()}
    servers = {env: EnvServer(get_env(env)).start() for _, env in AGENT_CASES}
    model = PolicyServer(Recorded(policy, replies), params=PARAMS, max_seq_len=4096).start()
    peers = {"policy_model": model.url, **{f"gymv_{e}": s.url for e, s in servers.items()}}
    procs = start_all([lambda a=a, e=e: NemoGymProcess(python, f"{a}_{e}", AGENTS[a], servers=peers, config={
        "resources_server": {"type": "resources_servers", "name": f"gymv_{e}"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"}, "max_steps": 8})
        for a, e in AGENT_CASES])
    yield {"procs": {p.name: p for p in procs}, "episodes": episodes, "model": model}
    for p in procs:
        p.stop()
    model.close()
    for s in servers.values():
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("agent, env_name", AGENT_CASES)
def test_samples_from_nemo_gym_agents_equal_gymvs_own_loop_token_for_token(policy, agents, agent, env_name):
    rows, trajs, _ = agents["episodes"][env_name]
    rebuilder = TurnRebuilder(ChatRenderer(policy.tokenizer, policy.chat_template), policy.adapter)
    for (i, row), t in zip(rows, trajs):
        status, result = post(agents["procs"][f"{agent}_{env_name}"].url + "/run", row)
        assert status == 200, result
        got = trajectory_from_result(result, row, rebuilder, task_index=i, sample_index=0, agent_name=agent,
                                     where=f"row {i}")
        assert got.token_ids == t.token_ids
        assert got.loss_mask == t.loss_mask
        assert got.logprobs == pytest.approx(t.logprobs, abs=1e-5)
        assert got.image_turns == t.image_turns and got.image_keys == t.image_keys
        assert got.reward == t.reward == 1.0


def test_a_result_without_token_fields_is_an_error_naming_the_row(policy):
    rebuilder = TurnRebuilder(ChatRenderer(policy.tokenizer, policy.chat_template), policy.adapter)
    _, rows = tiny_rows("circle-count", 1)
    result = {"reward": 1.0, "response": {"output": [{"type": "message", "role": "assistant", "id": "m",
                                                      "content": [{"type": "output_text", "text": "hi"}]}]}}
    with pytest.raises(GymvError) as e:
        trajectory_from_result(result, rows[0][1], rebuilder, task_index=0, sample_index=0, agent_name="a",
                               where="rows.jsonl line 1")
    assert "rows.jsonl line 1" in e.value.one_line() and "token ids" in e.value.one_line()
