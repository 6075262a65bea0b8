"""The HTTP plumbing gymv's servers share (the environment server and the policy's model server).

Requests are read by h11, a strict HTTP/1.1 protocol library (pure Python; httpcore and uvicorn build on it),
not by a parser of our own: where a request ends must be read the same way by everything on its path, or a
second request hidden in the first's body gets past a proxy in front (request smuggling). A request h11
refuses (a `Content-Length` that is not digits, two that differ, two `Transfer-Encoding` headers, one that is
not `chunked`, a malformed request line or header) is a 400, or a 431 for a head over `max_head_bytes`, and
the connection closes. Refused the same way on top of h11's checks: a header folded over two lines (h11
unfolds it; RFC 9112 lets a server refuse it), `Transfer-Encoding` together with `Content-Length`, and a GET or
HEAD that carries a body.

Two things the standard library's handler got wrong for an agent's traffic, kept fixed here:

- It writes a response in pieces (status and headers, then the body). On a kept-alive connection the second
  piece waits for the client's ACK of the first (Nagle's algorithm), and the client delays that ACK by up
  to 40 ms: every request after the first paid it. Here a response is one write, on a socket with
  `TCP_NODELAY`.
- Its timeout is per `recv`: a client that sends one byte a second holds a thread forever. Here a request
  has a deadline from its first byte to its last; a request still arriving after it is a 408 (so is one that
  stops arriving for the idle timeout), and a kept-alive connection with no request for the idle timeout
  closes.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import sys
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import h11

DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_READ_DEADLINE_S = 60.0
RECV_BYTES = 128 * 1024
_HEAD_END = re.compile(rb"\n\r?\n")
_FOLDED = re.compile(rb"\n[ \t]")
_BODILESS = frozenset({"GET", "HEAD"})
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_DRAIN_BYTES = 1024 * 1024
_date = [0, ""]


def _http_date() -> str:
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, formatdate(now, usegmt=True)]
    return _date[1]


def json_bytes(obj: Any) -> bytes:
    """A JSON answer as UTF-8; text with lone surrogates (valid in JSON, not in UTF-8) goes out escaped."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj).encode("ascii")


class ListeningServer(socketserver.ThreadingTCPServer):
    """A deep listen backlog: a batch opens one connection per episode at once, and the standard 5 would make
    the kernel drop the excess SYNs, which the client resends only after a second."""

    request_queue_size = 1024
    allow_reuse_address = True
    daemon_threads = True
    log_name = "gymv server"

    def handle_error(self, request, client_address) -> None:
        """A client that went away is one log line, not a traceback; anything else is a bug worth one."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            sys.stderr.write(f"{self.log_name}: connection from {client_address[0]} ended: {type(exc).__name__}\n")
        else:
            super().handle_error(request, client_address)


class Headers(dict):
    """A request's headers by lower-case name (the first of repeated ones); `get` takes any case."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class BodyError(Exception):
    """The request's body could not be read: `status` says how (400 cut short, 408 too slow)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OneWriteHandler(socketserver.BaseRequestHandler):
    """A keep-alive HTTP/1.1 handler that reads requests through h11 within a deadline each and answers each
    with a single write. Subclasses define `do_<METHOD>` (a method without one is a 501), read a request's
    body with `read_body`, and answer through `send_whole`."""

    server_version = "gymv"
    idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S
    read_deadline_s = DEFAULT_READ_DEADLINE_S
    max_head_bytes = 64 * 1024

    command: str | None
    path: str
    headers: Headers

    def setup(self) -> None:
        self.connection: socket.socket = self.request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self._buffer = bytearray(RECV_BYTES)
        self._view = memoryview(self._buffer)
        self._unread = b""  # bytes that came after the last request (a pipelined request's)
        self.close_connection = False

    def handle(self) -> None:
        while self._handle_one_request():
            self._unread = self._after_body if self._body_done else self.conn.trailing_data[0]

    # -- reading -------------------------------------------------------------------------------------
    def _handle_one_request(self) -> bool:
        """Read and answer one request; whether the connection can carry another. Each request is read by
        an h11 connection of its own (the answer is written here, in one piece)."""
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head_bytes)
        if self._unread:  # (b"" would tell h11 the connection closed)
            self.conn.receive_data(self._unread)
        self._head = bytearray(self._unread[:self.max_head_bytes + 4])  # what came before h11 read the head
        self.command, self.path, self.headers, self.requestline = None, "", Headers(), ""
        self.responded, self._expired, self._length = False, False, 0
        self._body_done, self._after_body = False, b""  # once read past h11: the bytes after the body
        self.deadline = time.monotonic() + self.read_deadline_s if self._unread else None
        try:
            if not self._unread:
                self._receive()  # (asking h11 first would only learn that it needs data)
            event = self._next_event()
            if isinstance(event, h11.ConnectionClosed):
                return False
            self._take_request(event)
            if self._length == 0:  # nothing to read: what follows is the next request's
                self._body_done, self._after_body = True, self.conn.trailing_data[0]
        except TimeoutError:
            if self.deadline is not None:  # part of a request came; nothing did is an idle connection
                self._error_whole(408, f"the request did not arrive ({self.read_timed_out_after})")
            return False
        except h11.RemoteProtocolError as e:
            status = 431 if e.error_status_hint == 431 else 400
            self._error_whole(status, f"malformed request: {str(e)[:200]}")
            return False
        except (_Refused, BodyError) as e:
            self._error_whole(e.status, str(e))
            return False
        handler = getattr(self, f"do_{self.command}", None)
        if handler is None:
            self._error_whole(501, f"method {self.command} is not supported")
            return False
        try:
            handler()
        except BodyError as e:  # a subclass that does not answer it itself
            self._error_whole(e.status, str(e))
        if not self.responded:
            self._error_whole(500, "the server gave no answer")
        return not self.close_connection and self._request_read()

    def _take_request(self, event: h11.Request) -> None:
        self.command = event.method.decode("ascii")
        self.path = event.target.decode("ascii")
        self.requestline = f"{self.command} {self.path} HTTP/{event.http_version.decode('ascii')}"
        headers = Headers()
        for name, value in event.headers.raw_items():
            headers.setdefault(name.lower().decode("latin-1"), value.decode("latin-1"))
        self.headers = headers
        chunked = "transfer-encoding" in headers
        self._length = None if chunked else int(dict.get(headers, "content-length", "0"))
        connection = {token.strip().lower() for token in dict.get(headers, "connection", "").split(",")}
        self.close_connection = event.http_version != b"1.1" or "close" in connection
        end = _HEAD_END.search(self._head)
        head_end = end.start() if end else len(self._head)
        if head_end > self.max_head_bytes:  # h11 checks only a head that arrives in pieces
            raise _Refused(431, f"the request's head is over {self.max_head_bytes} bytes")
        if _FOLDED.search(self._head, 0, head_end):
            raise _Refused(400, "malformed request: a header folded over two lines (obs-fold)")
        if chunked and "content-length" in headers:
            raise _Refused(400, "malformed request: both Transfer-Encoding and Content-Length")
        if self.command in _BODILESS and self._length != 0:
            raise _Refused(400, f"malformed request: a {self.command} request with a body")

    def _request_read(self) -> bool:
        return self._body_done or self.conn.their_state is h11.DONE

    def read_body(self) -> bytes | bytearray:
        """The request's body, whole (b"" once it was read); BodyError when it ends early, is malformed or
        arrives too slowly. A body of a given length (h11 read the length) is received straight into its
        buffer, past h11's own, which would copy it three times; a chunked one through h11."""
        if self._request_read():
            return b""
        if self.conn.they_are_waiting_for_100_continue:
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            if self._length is not None:
                return self._read_length(self._length)
            parts = []
            while True:
                event = self._next_event()
                if isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(parts)
                else:
                    raise BodyError(400, "the request body ended early")
        except TimeoutError:
            raise BodyError(408, f"the request body stopped arriving ({self.read_timed_out_after})") from None
        except h11.RemoteProtocolError as e:
            raise BodyError(400, f"the request body could not be read: {e}") from None

    def _read_length(self, length: int) -> bytes | bytearray:
        buffered = self.conn.trailing_data[0]  # what came with the head, unread by h11
        if len(buffered) >= length:  # (the usual case: the whole body came with its head)
            self._body_done, self._after_body = True, buffered[length:]
            return buffered if len(buffered) == length else buffered[:length]
        body = bytearray(length)
        got = len(buffered)
        body[:got] = buffered
        view = memoryview(body)
        while got < length:
            n = self._recv_into(view[got:])
            if not n:
                raise BodyError(400, f"the request body ended after {got} of {length} bytes")
            got += n
        self._body_done, self._after_body = True, buffered[length:]
        return body

    def _next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._receive()

    def _receive(self) -> None:
        n = self._recv_into(self._view)
        data = self._view[:n]
        if self.conn.their_state is h11.IDLE:
            self._head += data
        self.conn.receive_data(data)

    def _recv_into(self, view: memoryview) -> int:
        """One recv within the idle timeout and the request's deadline (armed by the request's first byte)."""
        wait = self.idle_timeout_s
        if self.deadline is not None:
            wait = min(wait, self.deadline - time.monotonic())
            if wait <= 0:
                self._expired = True
                raise TimeoutError("request read deadline passed")
        self.connection.settimeout(wait)
        try:
            n = self.connection.recv_into(view)
        except TimeoutError:
            self._expired = self.deadline is not None and time.monotonic() >= self.deadline
            raise
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self.read_deadline_s
        return n

    @property
    def read_timed_out_after(self) -> str:
        """How the last TimeoutError came about, for the 408's message."""
        if self._expired:
            return f"not complete within the {self.read_deadline_s:g} s read deadline"
        return f"no data for {self.idle_timeout_s:g} s"

    # -- answering -----------------------------------------------------------------------------------
    def send_whole(self, status: int, body: bytes, headers: dict[str, str], *, close: bool = False) -> None:
        """Status line, headers and body in one write (no body for HEAD). A connection whose request was not
        read to its end closes after the answer."""
        self.log_request(status, len(body))
        if close or not self._request_read():
            self.close_connection = True
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", f"Server: {self.server_version}",
                 f"Date: {_http_date()}", *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {len(body)}"]
        if self.close_connection:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._write(head if self.command == "HEAD" else head + body)
        self.responded = True

    def _error_whole(self, status: int, message: str) -> None:
        """An error answered before or instead of the subclass (the connection closes after it)."""
        if self.responded:
            return
        try:
            self.send_whole(status, json_bytes({"detail": message}), {"Content-Type": "application/json"},
                            close=True)
        except OSError:  # the client is gone
            pass

    def finish(self) -> None:
        """Read what the client already sent before closing: closing on unread bytes would reset the
        connection, and the client could lose the answer."""
        try:
            self.connection.setblocking(False)
            drained = 0
            while drained < _DRAIN_BYTES and (n := self.connection.recv_into(self._buffer)):
                drained += n
        except OSError:
            pass

    def _write(self, data: bytes) -> None:
        self.connection.settimeout(self.idle_timeout_s)
        self.connection.sendall(data)

    # -- logging -------------------------------------------------------------------------------------
    def address_string(self) -> str:
        return self.client_address[0]

    def log_request(self, code: int, size: int) -> None:
        self.log_message('"%s" %s %s', self.requestline, str(code), str(size))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass
