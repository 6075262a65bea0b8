"""HTTP framing of gymv's servers (the environment server and the policy's model server), over a raw socket.

Where a request ends must be read one way only: a request whose framing two readers could read differently
(a proxy in front and the server behind it: request smuggling) gets exactly one answer, a 400, and the
connection closes, so that nothing after it is read as a request.
"""

from __future__ import annotations

import re
import socket

import pytest

from gymv.backends.generation.base import GenerationBackend, SamplingParams
from gymv.envs import get_env
from gymv.envs.server import EnvServer
from gymv.rollout.policy_server import PolicyServer
from tiny_models import shared_policy

HOST = b"Host: 127.0.0.1\r\n"
INNER = b"GET /describe HTTP/1.1\r\n" + HOST + b"\r\n"  # a request hidden in another's body


def post(path: bytes, headers: bytes, body: bytes = b"{}") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\n" + HOST + headers + b"\r\n" + body


SMUGGLING = {
    "a GET whose body is a request": b"GET / HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n\r\n" % len(INNER) + INNER,
    "a GET with a body": b"GET / HTTP/1.1\r\n" + HOST + b"Content-Length: 2\r\n\r\n{}",
    "two Transfer-Encoding headers": lambda p: post(p, b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
                                                    b"2\r\n{}\r\n0\r\n\r\n"),
    "two different Content-Length values": lambda p: post(
        p, b"Content-Length: 2\r\nContent-Length: %d\r\n" % (2 + len(INNER)), b"{}" + INNER),
    "Content-Length 1_0": lambda p: post(p, b"Content-Length: 1_0\r\n", b"{}        "),
    "Content-Length +2": lambda p: post(p, b"Content-Length: +2\r\n"),
    "Transfer-Encoding with Content-Length": lambda p: post(p, b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n",
                                                            b"{}" + INNER),
    "a header folded over two lines": lambda p: post(p, b"X-Note: a\r\n b\r\nContent-Length: 2\r\n"),
    "a space before a header's colon": lambda p: post(p, b"Content-Length : 2\r\n"),
    "a Transfer-Encoding other than chunked": lambda p: post(p, b"Transfer-Encoding: gzip, chunked\r\n"),
    "two Host headers": b"GET / HTTP/1.1\r\n" + HOST + b"Host: 127.0.0.1\r\n\r\n",
}


class NoModel(GenerationBackend):
    """A model server's backend that no request of these tests may reach."""

    def __init__(self, policy):
        self.tokenizer, self.adapter, self.chat_template = policy.tokenizer, policy.adapter, policy.chat_template

    def generate(self, requests, params):
        raise AssertionError("a refused request reached the model")

    def update_weights(self, weights):
        raise NotImplementedError

    def reset_encoder_cache(self):
        pass


@pytest.fixture(scope="module")
def env_server():
    with EnvServer(get_env("circle-count")) as srv:
        yield srv


@pytest.fixture(scope="module")
def model_server():
    with PolicyServer(NoModel(shared_policy("tiny-llava")), params=SamplingParams(max_new_tokens=4),
                      max_seq_len=512) as srv:
        yield srv


@pytest.fixture(params=["env", "model"])
def server(request) -> tuple[str, int, bytes]:
    """(host, port, a POST path) of each server."""
    if request.param == "env":
        srv = request.getfixturevalue("env_server")
        return srv.host, srv.port, b"/seed_session"
    srv = request.getfixturevalue("model_server")
    host, port = srv.httpd.server_address[:2]
    return host, port, b"/v1/responses"


def exchange(host: str, port: int, raw: bytes) -> tuple[bytes, bool]:
    """Send `raw` at once; (everything the server answered, whether it closed the connection)."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(raw)
    reply, closed = b"", False
    try:
        while chunk := sock.recv(65536):
            reply += chunk
        closed = True
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        pass
    sock.close()
    return reply, closed


def statuses(reply: bytes) -> list[int]:
    """The status of each answer in `reply`, read by its Content-Length."""
    out = []
    while reply:
        head, _, rest = reply.partition(b"\r\n\r\n")
        out.append(int(head.split(b" ", 2)[1]))
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        reply = rest[int(length.group(1)) if length else 0:]
    return out


@pytest.mark.parametrize("shape", sorted(SMUGGLING))
def test_a_request_smuggling_shape_gets_one_400_and_the_connection_closes(server, shape):
    host, port, path = server
    raw = SMUGGLING[shape](path) if callable(SMUGGLING[shape]) else SMUGGLING[shape]
    reply, closed = exchange(host, port, raw)
    assert statuses(reply) == [400] and closed, reply[:500]


def test_a_request_head_over_64_kib_is_431(env_server):
    raw = b"GET / HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    reply, closed = exchange(env_server.host, env_server.port, raw)
    assert statuses(reply) == [431] and closed


def test_pipelined_requests_are_answered_in_order_on_one_connection(env_server):
    sock = socket.create_connection((env_server.host, env_server.port), timeout=5)
    sock.sendall(b"GET /describe HTTP/1.1\r\n" + HOST + b"\r\n" + b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
    reply = b""
    while len(statuses(reply)) < 2 or not reply.endswith(b"}"):
        reply += sock.recv(65536)
    sock.close()
    assert statuses(reply) == [200, 200] and reply.index(b'"endpoints"') < reply.index(b'"status": "ok"')


def test_a_client_expecting_100_continue_gets_it_before_it_sends_the_body(env_server):
    sock = socket.create_connection((env_server.host, env_server.port), timeout=5)
    sock.sendall(b"POST /seed_session HTTP/1.1\r\n" + HOST + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
    sock.sendall(b"{}")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    sock.close()
