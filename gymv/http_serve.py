"""The HTTP plumbing gymv's servers share (the environment server and the policy's model server).

Two things the standard library's handler gets wrong for an agent's traffic:

- It writes a response in pieces (status and headers, then the body). On a kept-alive connection the second
  piece waits for the client's ACK of the first (Nagle's algorithm), and the client delays that ACK by up
  to 40 ms: every request after the first paid it. Here a response is one write, on a socket with
  `TCP_NODELAY`.
- Its timeout is per `recv`: a client that sends one byte a second holds a thread forever. Here a request
  has a deadline from its first byte to its last; a body still arriving after it is a 408.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_READ_DEADLINE_S = 60.0


def json_bytes(obj: Any) -> bytes:
    """A JSON answer as UTF-8; text with lone surrogates (valid in JSON, not in UTF-8) goes out escaped."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj).encode("ascii")


class ListeningServer(ThreadingHTTPServer):
    """A deep listen backlog: a batch opens one connection per episode at once, and the standard 5 would make
    the kernel drop the excess SYNs, which the client resends only after a second."""

    request_queue_size = 1024
    daemon_threads = True
    log_name = "gymv server"

    def handle_error(self, request, client_address) -> None:
        """A client that went away is one log line, not a traceback; anything else is a bug worth one."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            sys.stderr.write(f"{self.log_name}: connection from {client_address[0]} ended: {type(exc).__name__}\n")
        else:
            super().handle_error(request, client_address)


class _DeadlineSocketReader(io.RawIOBase):
    """The socket as a raw stream whose reads give up at the request's deadline (armed by its first byte),
    and between requests after the idle timeout."""

    def __init__(self, sock: socket.socket, idle_s: float, deadline_s: float):
        self.sock, self.idle_s, self.deadline_s = sock, idle_s, deadline_s
        self.deadline: float | None = None
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        wait = self.idle_s
        if self.deadline is not None:
            wait = min(wait, self.deadline - time.monotonic())
            if wait <= 0:
                self.expired = True
                raise TimeoutError("request read deadline passed")
        self.sock.settimeout(wait)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self.expired = self.deadline is not None and time.monotonic() >= self.deadline
            raise
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self.deadline_s
        return n


class OneWriteHandler(BaseHTTPRequestHandler):
    """A keep-alive HTTP/1.1 handler that answers each request with a single write and reads each request
    within a deadline. Subclasses answer through `send_whole`."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S
    read_deadline_s = DEFAULT_READ_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineSocketReader(self.connection, self.idle_timeout_s, self.read_deadline_s)
        self.rfile = io.BufferedReader(self._reader, 65536)

    def handle_one_request(self) -> None:
        self._reader.deadline, self._reader.expired, self.responded = None, False, False
        self.command, self.requestline = None, ""
        super().handle_one_request()
        if self._reader.expired and not self.responded:  # timed out in the request line or headers
            self.send_whole(408, b'{"detail": "the request did not arrive within its read deadline"}',
                            {"Content-Type": "application/json"}, close=True)

    @property
    def read_timed_out_after(self) -> str:
        """How the last TimeoutError came about, for the 408's message."""
        if self._reader.expired:
            return f"not complete within the {self.read_deadline_s:g} s read deadline"
        return f"no data for {self.idle_timeout_s:g} s"

    def send_whole(self, status: int, body: bytes, headers: dict[str, str], *, close: bool = False) -> None:
        """Status line, headers and body in one write (no body for HEAD)."""
        self.log_request(status, len(body))
        reason = self.responses.get(status, ("",))[0]
        lines = [f"{self.protocol_version} {status} {reason}", f"Server: {self.version_string()}",
                 f"Date: {self.date_time_string()}", *(f"{k}: {v}" for k, v in headers.items()),
                 f"Content-Length: {len(body)}"]
        if close or self.close_connection:
            lines.append("Connection: close")
            self.close_connection = True
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.connection.settimeout(self.idle_timeout_s)  # a read may have left the deadline's remainder
        self.wfile.write(head if self.command == "HEAD" else head + body)
        self.responded = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass
