"""Gymnasium-style endpoints of `gymv env serve` (/reset, /step, /describe) and the RemoteEnv client, over real HTTP."""

from __future__ import annotations

import json
import socket
import time

import pytest

from envs_scripts import play, tiny_rows
from gymv.envs import ModelTurn, RowError, ToolCall, get_env, make_env
from gymv.envs.client import EnvClient, EnvHTTPError
from gymv.envs.remote import RemoteEnv, RemoteEnvError
from gymv.envs.server import EnvServer
from gymv.errors import GymvError


@pytest.fixture(scope="module")
def polygon():
    env = get_env("polygon-naming")
    with EnvServer(env) as srv:
        yield env, srv, tiny_rows(env, 1)[0][1]


def items(turn: ModelTurn) -> list[dict]:
    return turn.to_items()


def test_reset_then_step_plays_an_episode_with_tool_images_and_the_reward_on_the_last_step(polygon):
    env, srv, row = polygon
    client = EnvClient(srv.url)
    assert client.reset(row) == {"observation": None, "info": {"env": "polygon-naming", "max_turns": 3}}
    fetch, answer = env.gold_turns(row)
    first = client.step(row, items(fetch))
    (out,) = first["info"]["tool_outputs"]
    assert out["call_id"] == "call_gold_0" and out["name"] == "get_picture"
    parts = json.loads(out["output"])  # a string, as NeMo Gym's function_call_output needs: the parts' JSON
    assert [p["type"] for p in parts] == ["input_text", "input_image"]
    assert parts[1]["image_url"] == env.picture(row, 3)
    assert (first["reward"], first["terminated"], first["truncated"], first["observation"]) == (0.0, False, False, None)
    last = client.step(row, items(answer))
    assert last["reward"] == 1.0 and last["terminated"] and not last["truncated"]
    assert last["info"]["extras"]["fetched_third"] and last["info"]["failure_reason"] is None


def test_step_without_an_episode_in_the_session_is_a_conflict(polygon):
    env, srv, row = polygon
    with pytest.raises(EnvHTTPError) as e:
        EnvClient(srv.url).step(row, items(ModelTurn(text="hi")))
    assert e.value.status == 409 and "POST /reset" in e.value.detail


def test_step_after_the_episode_ended_is_a_conflict(polygon):
    env, srv, row = polygon
    client = EnvClient(srv.url)
    client.reset(row)
    assert client.step(row, items(ModelTurn(text="1: red square")))["terminated"]
    with pytest.raises(EnvHTTPError) as e:
        client.step(row, items(ModelTurn(text="again")))
    assert e.value.status == 409


def test_a_step_body_without_a_response_is_refused(polygon):
    env, srv, row = polygon
    client = EnvClient(srv.url)
    client.reset(row)
    with pytest.raises(EnvHTTPError) as e:
        client._json("POST", "/step", row)
    assert e.value.status == 422 and "response" in e.value.detail


def test_reset_with_a_bad_row_is_unprocessable(polygon):
    _, srv, row = polygon
    with pytest.raises(EnvHTTPError) as e:
        EnvClient(srv.url).reset({**row, "polygons": []})
    assert e.value.status == 422 and "polygons" in e.value.detail


def test_scripted_follow_ups_come_back_as_nemo_gym_observation_text():
    env = get_env("scripted")
    row = tiny_rows(env, 1)[0][1]
    with EnvServer(env) as srv:
        client = EnvClient(srv.url)
        client.reset(row)
        first = client.step(row, items(ModelTurn(text="triangle")))
        assert first["observation"] == row["follow_ups"][0] and not first["terminated"]
        assert first["info"]["user_messages"] == [{"type": "message", "role": "user", "content": row["follow_ups"][0]}]
        last = client.step(row, items(ModelTurn(text=row["expected_answer"].upper())))
        assert last["terminated"] and last["reward"] == 1.0 and last["observation"] is None


def test_the_turn_limit_truncates_rather_than_terminates():
    env = get_env("doorkey", max_turns=1)
    row = {"responses_create_params": {"input": "Go."}, "grid": ["#####", "#.#G#", "#AD.#", "#K#.#", "#####"],
           "image_size": 20}
    with EnvServer(env) as srv:
        client = EnvClient(srv.url)
        client.reset(row)
        move = ModelTurn(tool_calls=[ToolCall("move", '{"direction": "down"}', "c0")])
        answer = client.step(row, items(move))
        assert answer["truncated"] and not answer["terminated"] and answer["reward"] == 0.0
        assert answer["info"]["failure_reason"] == "goal_not_reached"


def test_describe_gives_name_agent_tools_and_turn_limit(polygon):
    env, srv, _ = polygon
    info = EnvClient(srv.url).describe()
    assert (info["name"], info["agent_name"], info["max_turns"]) == ("polygon-naming", "polygon_naming_agent", 3)
    assert info["tools"] == env.tools() and "/step" in info["endpoints"] and "/get_picture" in info["endpoints"]


def test_remote_env_takes_its_identity_from_the_server(polygon):
    env, srv, _ = polygon
    remote = make_env({"name": "whatever", "url": srv.url, "max_turns": 4})
    assert isinstance(remote, RemoteEnv) and remote.protocol == "gymnasium"
    assert (remote.name, remote.agent_name, remote.max_turns) == ("polygon-naming", "polygon_naming_agent", 4)
    assert remote.tools() == env.tools() and remote.verifier_fields == ("polygons",)


def test_make_env_without_url_builds_the_local_environment_with_the_runs_turn_limit():
    env = make_env({"name": "doorkey", "url": None, "max_turns": 7, "kwargs": {}})
    assert type(env).__name__ == "DoorKey" and env.max_turns == 7


@pytest.mark.parametrize("name", ["polygon-naming", "doorkey", "scripted", "tangram"])
def test_a_gold_episode_over_http_earns_what_it_earns_in_process(name):
    local = get_env(name, max_turns=12)
    row = tiny_rows(local, 1, seed=2)[0][1]
    with EnvServer(local) as srv:
        remote = make_env({"name": name, "url": srv.url, "max_turns": 12})
        state, score = play(remote, row, local.gold_turns(row))
    local_state, local_score = play(local, row, local.gold_turns(row))
    assert score == local_score and score.reward == 1.0
    assert state.output == local_state.output and state.turns == local_state.turns and state.done


def test_resources_protocol_runs_tools_by_route_and_scores_by_verify(polygon):
    env, srv, row = polygon
    remote = make_env({"name": "polygon-naming", "url": srv.url}, protocol="resources")
    state = remote.start(row)
    result = remote.step(state, env.gold_turns(row)[0])
    assert result.tool_results[0].images[0].url == env.picture(row, 3) and not result.done
    remote.step(state, env.gold_turns(row)[1])
    assert state.done and remote.score(state).reward == 1.0


def test_resources_protocol_answers_a_refused_tool_call_to_the_model(polygon):
    env, srv, row = polygon
    remote = make_env({"name": "polygon-naming", "url": srv.url}, protocol="resources")
    state = remote.start(row)
    bad = ModelTurn(tool_calls=[ToolCall("get_picture", '{"index": 9}', "a"), ToolCall("fly", "{}", "b")])
    first, second = remote.step(state, bad).tool_results
    assert "at most 3" in first.error and "unknown endpoint /fly" in second.error


def test_a_row_the_server_refuses_is_the_rows_fault(polygon):
    _, srv, row = polygon
    remote = make_env({"name": "polygon-naming", "url": srv.url})
    with pytest.raises(RowError, match="polygons"):
        remote.start({**row, "polygons": [{"shape": "blob"}] * 3})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error_after_bounded_retries():
    t0 = time.time()
    with pytest.raises(RemoteEnvError, match=r"cannot reach.*after 3 attempts.*gymv env serve"):
        RemoteEnv(f"http://127.0.0.1:{_free_port()}", retries=2, backoff_s=0.05)
    assert time.time() - t0 < 2.0


def test_a_server_that_dies_after_reset_fails_the_episode_with_a_remote_error():
    env = get_env("doorkey")
    row = tiny_rows(env, 1)[0][1]
    srv = EnvServer(env).start()
    remote = RemoteEnv(srv.url, retries=1, backoff_s=0.01)
    state = remote.start(row)
    srv.close()
    with pytest.raises(RemoteEnvError, match="POST /step failed after 2 attempts"):
        remote.step(state, env.gold_turns(row)[0])


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(GymvError, match="not an http"):
        make_env({"name": "doorkey", "url": "127.0.0.1:8000"})


def test_tool_output_text_round_trips_exactly(polygon):
    env, srv, row = polygon
    remote = make_env({"name": "polygon-naming", "url": srv.url})
    state = remote.start(row)
    (res,) = remote.step(state, ModelTurn(tool_calls=[ToolCall("get_picture", '{"index": "x"}', "a")])).tool_results
    assert json.loads(res.text) == {"error": res.error} and "must be an integer" in res.error
