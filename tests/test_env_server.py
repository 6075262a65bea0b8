"""`gymv env serve`: a real HTTP server on a free 127.0.0.1 port, driven by a real HTTP client."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gymv.data.images import png_data_url
from gymv.envs import Environment, Image, ModelTurn, Score, Tool, ToolOutput, get_env
from gymv.envs.client import EnvClient, EnvHTTPError
from gymv.envs.responses import request_body
from gymv.envs.server import EnvServer


@pytest.fixture
def click_server():
    with EnvServer(get_env("circle-click"), "127.0.0.1", 0, max_body_bytes=1024 * 1024) as srv:
        yield srv


@pytest.fixture
def count_server():
    with EnvServer(get_env("circle-count")) as srv:
        yield srv


def post(srv: EnvServer, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw), dict(resp.getheaders())


def joined(vectors, env: str) -> list[dict]:
    rows = [json.loads(x) for x in (vectors / "nemo_gym" / env / "example.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (vectors / "nemo_gym" / env / "example_rollouts.jsonl").read_text().splitlines()]
    return [{**rows[r["_ng_task_index"]], **r} for r in rollouts]


def test_liveness_answers_status_ok(click_server):
    assert EnvClient(click_server.url).health()["status"] == "ok"


def test_seed_session_sets_a_session_cookie(click_server):
    client = EnvClient(click_server.url)
    assert client.seed_session() == {}
    assert re.fullmatch(r"[0-9a-f]{32}", client.session_id)


def test_session_cookie_is_kept_across_calls_and_differs_between_rollouts(click_server):
    a, b = EnvClient(click_server.url), EnvClient(click_server.url)
    a.seed_session()
    b.seed_session()
    first = a.session_id
    a.call_tool("click", {"x": 1, "y": 2})
    assert a.session_id == first and b.session_id != first


def test_click_tool_endpoint_echoes_the_point(click_server):
    out = EnvClient(click_server.url).call_tool("click", {"x": 5, "y": 7})
    assert json.loads(out.text) == {"x": 5, "y": 7} and out.images == []


def test_verify_reproduces_recorded_rewards_over_http(click_server, vectors):
    client = EnvClient(click_server.url)
    for rollout in joined(vectors, "circle_click"):
        result = client.verify(rollout)
        assert (result["reward"], result["hit"], result["clicked_x"]) == (rollout["reward"], rollout["hit"], rollout["clicked_x"])


def test_aggregate_metrics_match_nemo_gyms_summary_statistics(count_server, vectors):
    client = EnvClient(count_server.url)
    verified = [client.verify(r) for r in joined(vectors, "circle_count")]
    metrics = client.aggregate_metrics(verified)
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(0.6)
    assert metrics["agent_metrics"]["std/reward"] == pytest.approx(0.5477225575051662)
    assert metrics["agent_metrics"]["mean/output_tokens"] == pytest.approx(273.6)
    assert metrics["key_metrics"]["mean/predicted_count"] == pytest.approx(4.2)
    assert [g["_ng_task_index"] for g in metrics["group_level_metrics"]] == [0, 1, 2, 3, 4]


def messages(body: dict) -> str:
    """The messages of a FastAPI-style error list, joined (what a 422 from NeMo Gym or gymv carries)."""
    return " | ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in body["detail"])


def test_malformed_json_body_is_422_json_invalid_as_nemo_gym_answers(click_server):
    status, body, _ = post(click_server, "/verify", b'{"response": ')
    assert status == 422 and body["detail"][0]["type"] == "json_invalid"


def test_body_that_is_not_an_object_is_422(click_server):
    status, body, _ = post(click_server, "/verify", b"[1, 2]")
    assert status == 422 and "must be a JSON object" in messages(body)


def test_empty_body_is_422_body_required(click_server):
    status, body, _ = post(click_server, "/seed_session", b"")
    assert status == 422 and messages(body) == "body: Field required"


def test_verify_of_a_row_missing_verifier_fields_is_422_naming_the_field(click_server):
    row = {"responses_create_params": {"input": "click"}, "target_color": "red"}
    status, body, _ = post(click_server, "/verify", json.dumps(request_body(row, [])).encode())
    assert status == 422 and "'circles'" in messages(body)


def test_verify_with_a_short_response_is_422_naming_each_missing_field(click_server):
    row = {"responses_create_params": {"input": "click"}, "circles": [], "target_color": "red"}
    status, body, _ = post(click_server, "/verify", json.dumps({**row, "response": {"output": []}}).encode())
    assert status == 422 and "body.response.id: Field required" in messages(body)
    assert "body.response.parallel_tool_calls: Field required" in messages(body)


def test_verify_with_an_unknown_key_in_responses_create_params_is_422(click_server):
    row = {"responses_create_params": {"input": "click", "max_tokens": 5}, "circles": [], "target_color": "red"}
    status, body, _ = post(click_server, "/verify", json.dumps(request_body(row, [])).encode())
    assert status == 422 and "body.responses_create_params.max_tokens: Extra inputs are not permitted" in messages(body)


def test_verify_without_a_response_is_422(click_server):
    status, body, _ = post(click_server, "/verify", json.dumps({"circles": [], "target_color": "red"}).encode())
    assert status == 422 and "body.response: Field required" in messages(body)


def test_oversized_body_is_413_without_reading_it(click_server):
    conn = http.client.HTTPConnection(click_server.host, click_server.port, timeout=10)
    conn.putrequest("POST", "/verify")
    conn.putheader("Content-Length", str(10 * 1024 * 1024))
    conn.endheaders()  # the body is never sent: the server must answer from the header
    resp = conn.getresponse()
    assert resp.status == 413 and "over the 1048576 byte limit" in json.loads(resp.read())["detail"]


def test_unknown_tool_is_404_listing_the_tools(click_server):
    status, body, _ = post(click_server, "/zoom", b"{}")
    assert status == 404 and "tools are click" in body["detail"]


def test_tool_arguments_of_the_wrong_type_are_422_with_a_message(click_server):
    with pytest.raises(EnvHTTPError) as e:
        EnvClient(click_server.url).call_tool("click", {"x": [3, 4], "y": 1})
    assert e.value.status == 422 and "argument 'x' must be an integer" in e.value.detail


def test_seed_session_with_a_row_whose_image_is_not_a_data_url_is_422(click_server):
    row = {"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "file:///etc/passwd"}]}]}, "circles": [], "target_color": "red"}
    status, body, _ = post(click_server, "/seed_session", json.dumps(row).encode())
    assert status == 422 and "not a data URL" in messages(body)


def test_post_without_content_length_is_411(click_server):
    conn = http.client.HTTPConnection(click_server.host, click_server.port, timeout=10)
    conn.putrequest("POST", "/verify")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411


def test_unsupported_method_is_405(click_server):
    conn = http.client.HTTPConnection(click_server.host, click_server.port, timeout=10)
    conn.request("DELETE", "/verify")
    assert conn.getresponse().status == 405


def test_the_server_keeps_serving_after_bad_requests(click_server):
    post(click_server, "/verify", b"{{{{")
    post(click_server, "/nope", b"{}")
    assert EnvClient(click_server.url).health()["status"] == "ok"


def test_a_burst_of_connections_all_queue_before_the_server_accepts_any():
    """A batch opens one connection per episode at once; an overflowing listen queue costs a 1 s SYN resend."""
    srv = EnvServer(get_env("circle-count"))  # not started: nothing accepts
    socks = []
    try:
        connected = 0
        for _ in range(64):
            s = socket.socket()
            s.settimeout(0.3)
            socks.append(s)
            try:
                s.connect((srv.host, srv.port))
                connected += 1
            except OSError:
                pass
        assert connected == 64
    finally:
        for s in socks:
            s.close()
        srv.httpd.server_close()


class Camera(Environment):
    """A stateful tool that answers with an image: the count of shots lives in the rollout's session."""

    name = "camera"
    agent_name = "camera_agent"
    verifier_fields = ("goal",)

    def tool_specs(self):
        return [Tool("shoot", "Take a picture.", {"type": "object", "properties": {}}, self._shoot)]

    def _shoot(self, state, args):
        shots = state.data["shots"] = state.data.get("shots", 0) + 1 if state else 0
        return ToolOutput(f"shot {shots}", [Image(png_data_url(np.zeros((2, 2, 3), dtype=np.uint8)))])

    def score_output(self, row, output):
        return Score(0.0)

    def gold_turn(self, row):
        return ModelTurn()


def test_tool_images_come_back_as_parts_and_tool_state_is_per_session():
    with EnvServer(Camera()) as srv:
        a, b = EnvClient(srv.url), EnvClient(srv.url)
        row = {"responses_create_params": {"input": "Take photos."}, "goal": "x"}
        a.seed_session(row)
        b.seed_session(row)
        a.call_tool("shoot", {})
        out = a.call_tool("shoot", {})
        assert out.text == "shot 2" and out.images[0].pil().size == (2, 2)
        assert b.call_tool("shoot", {}).text == "shot 1"


def test_cli_prints_the_url_alone_on_the_first_stdout_line():
    proc = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "env", "serve", "circle-count", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().rstrip("\n")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", line), line
        assert EnvClient(line).health()["env"] == "circle-count"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "serving circle-count on " + line in proc.stderr.read()


def test_cli_serves_on_a_free_port_until_terminated():
    proc = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "env", "serve", "circle-count", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        assert EnvClient(url).health() == {"status": "ok", "env": "circle-count", "tools": []}
    finally:
        proc.terminate()
        t0 = time.time()
        proc.wait(timeout=10)
    assert time.time() - t0 < 5


def test_a_host_header_naming_another_host_is_403_on_a_loopback_server(click_server):
    status, body, _ = post(click_server, "/seed_session", b"{}", {"Host": "attacker.example:8000"})
    assert status == 403 and "loopback names only" in body["detail"]


def test_loopback_host_names_are_served(click_server):
    for host in ("localhost", f"127.0.0.1:{click_server.port}", f"[::1]:{click_server.port}"):
        assert post(click_server, "/seed_session", b"{}", {"Host": host})[0] == 200


def test_a_post_from_a_page_of_another_origin_is_403(click_server):
    status, body, _ = post(click_server, "/seed_session", b"{}", {"Origin": "https://attacker.example"})
    assert status == 403 and "attacker.example" in body["detail"]


def test_sessions_are_bounded_in_bytes_dropping_the_least_recently_used():
    from rollout_helpers import tiny_rows

    env, rows = tiny_rows("circle-count", 3)
    size = len(json.dumps(rows[0][1]).encode())
    with EnvServer(env, max_session_bytes=int(size * 2.5)) as srv:
        clients = [EnvClient(srv.url) for _ in rows]
        for client, (_, row) in zip(clients, rows):
            client.reset(row)
        assert srv.sessions.bytes <= size * 2.5
        with pytest.raises(EnvHTTPError) as e:  # the first episode made room for the third
            clients[0].step(rows[0][1], ModelTurn(text="\\boxed{1}").to_items())
        assert e.value.status == 409
        assert clients[2].step(rows[2][1], ModelTurn(text="\\boxed{1}").to_items())["terminated"]


def test_a_stalled_body_is_408_and_the_server_goes_on():
    with EnvServer(get_env("circle-click"), request_timeout=0.5) as srv:
        sock = socket.create_connection((srv.host, srv.port), timeout=10)
        sock.sendall(b"POST /verify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"resp")
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after a 408
            reply += chunk
        reply = reply.decode()
        sock.close()
        assert reply.startswith("HTTP/1.1 408") and "stopped arriving" in reply
        assert EnvClient(srv.url).health()["status"] == "ok"


def verify_body(env_name: str = "circle-count", text: str | None = None) -> dict:
    """A NeMo-shaped /verify body for one default-preset row, answered correctly unless `text` is given."""
    import random

    env = get_env(env_name)
    row = env.make_row(random.Random(0), env.presets["default"], 0)
    turn = env.gold_turn(row) if text is None else ModelTurn(text=text)
    return request_body(row, turn.to_items())


def test_a_kept_alive_request_is_answered_as_fast_as_one_on_a_new_connection(count_server):
    from http_latency import assert_kept_alive_as_fast

    body = json.dumps(verify_body()).encode()
    assert_kept_alive_as_fast(count_server.host, count_server.port, "POST", "/verify", body)


def test_a_response_is_written_in_one_piece(count_server):
    sock = socket.create_connection((count_server.host, count_server.port), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = sock.recv(65536)  # one write arrives whole on loopback
    sock.close()
    head, _, body = first.partition(b"\r\n\r\n")
    assert int(re.search(rb"Content-Length: (\d+)", head).group(1)) == len(body)
    assert json.loads(body)["status"] == "ok"


def test_a_number_too_long_to_read_is_422_naming_its_field(count_server):
    body = verify_body()
    raw = json.dumps(body).replace('"target_color"', '"huge": ' + "9" * 100_000 + ', "target_color"', 1)
    status, answer, _ = post(count_server, "/verify", raw.encode())
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "huge"]
    assert "100000 characters" in answer["detail"][0]["msg"]


@pytest.mark.parametrize("answer", ["\\boxed{" + "7" * 500_000 + "}", "\\boxed{" + "0" * 100_000 + "3}"])
def test_an_answer_with_endless_digits_is_scored_not_a_500(count_server, answer):
    status, result, _ = post(count_server, "/verify", json.dumps(verify_body(text=answer)).encode())
    assert status == 200
    assert (result["reward"], result["failure_reason"]) == (0.0, "wrong_count") or result["reward"] == 1.0


def trickle(srv: EnvServer, head: bytes, filler: bytes) -> bytes:
    """Send `head`, then one `filler` byte every 0.1 s (never idle for the server's 5 s timeout), until the
    server answers; its answer."""
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.sendall(head)
    t0 = time.monotonic()
    reply = b""
    sock.settimeout(0.1)
    while not reply and time.monotonic() - t0 < 5:
        sock.sendall(filler)
        try:
            reply = sock.recv(65536)
        except TimeoutError:
            pass
    sock.close()
    return reply


def test_a_body_sent_a_byte_at_a_time_is_408_at_the_read_deadline():
    with EnvServer(get_env("circle-click"), request_timeout=5, read_deadline=0.6) as srv:
        reply = trickle(srv, b"POST /verify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n", b" ")
        assert reply.startswith(b"HTTP/1.1 408") and b"read deadline" in reply  # not the 5 s idle timeout
        assert EnvClient(srv.url).health()["status"] == "ok"


def test_headers_sent_a_byte_at_a_time_are_408_at_the_read_deadline():
    with EnvServer(get_env("circle-click"), request_timeout=5, read_deadline=0.6) as srv:
        reply = trickle(srv, b"GET / HTTP/1.1\r\n", b"X")
        assert reply.startswith(b"HTTP/1.1 408")  # the idle timeout would close without a word


def post_raw(srv: EnvServer, path: str, body: bytes) -> tuple[int, bytes, float]:
    """(status, the answer's body, seconds from the first byte sent to the last received)."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    t0 = time.monotonic()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    elapsed = time.monotonic() - t0
    conn.close()
    return resp.status, raw, elapsed


MIB = 1024 * 1024
OK_RESPONSE = {"id": "r", "created_at": 0, "model": "m", "object": "response", "parallel_tool_calls": True,
               "tool_choice": "auto", "tools": []}
LARGE_INVALID = {  # 8 MiB each; FastAPI would answer each with an error (and an echo of its input) per bad part
    "400k bad output items": lambda: {
        "responses_create_params": {"input": "x"},
        "response": {**OK_RESPONSE, "output": [{"type": "function_call"}] * 400_000}},
    "700k unknown keys": lambda: {"responses_create_params": {"input": "x", **{f"k{i}": 0 for i in range(700_000)}}},
    "700k metadata numbers": lambda: {
        "responses_create_params": {"input": "x", "metadata": {f"k{i}": 0 for i in range(700_000)}}},
    "a key of 8 MiB": lambda: {"responses_create_params": {"input": "x", "k" * 8 * MIB: 0}},
    "a response echoed by each missing field": lambda: {
        "responses_create_params": {"input": "x"}, "response": {"junk": ["x" * 100] * 80_000}},
}


@pytest.mark.parametrize("shape", sorted(LARGE_INVALID))
def test_a_large_invalid_body_gets_a_small_422_quickly(count_server, shape):
    status, raw, seconds = post_raw(count_server, "/verify", json.dumps(LARGE_INVALID[shape]()).encode())
    assert status == 422 and json.loads(raw)["detail"]
    assert len(raw) < 64 * 1024, f"a {len(raw)} byte answer"
    assert seconds < 10


def test_errors_past_the_listed_ones_are_counted_in_one_last_entry(count_server):
    params = {"input": "x", **{f"k{i}": 0 for i in range(5000)}}
    status, answer, _ = post(count_server, "/verify", json.dumps({"responses_create_params": params}).encode())
    detail = answer["detail"]
    assert status == 422 and len(detail) == 21
    assert [e["loc"][-1] for e in detail[:20]] == [f"k{i}" for i in range(20)]
    assert detail[-1]["type"] == "too_many_errors" and detail[-1]["msg"] == "4980 more errors not listed"


def test_an_errors_input_is_echoed_whole_when_small_and_as_the_start_of_its_json_text_when_large(count_server):
    params = {"input": "x", "small": [1, 2], "large": ["y" * 100] * 1000}
    status, answer, _ = post(count_server, "/verify", json.dumps({"responses_create_params": params}).encode())
    inputs = {e["loc"][-1]: e["input"] for e in answer["detail"]}
    assert status == 422 and inputs["small"] == [1, 2]
    assert inputs["large"] == json.dumps(params["large"])[:200] + "…"
