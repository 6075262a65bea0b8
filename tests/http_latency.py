"""Latency of a kept-alive request against a request on a new connection, measured alternately in one run.

A server that writes its response in pieces meets the client's delayed ACK on a kept-alive connection (about
40 ms a request on Linux); on a new connection it does not. Alternating the two makes machine load fall on
both alike, so their ratio holds on a busy machine where absolute times do not.
"""

from __future__ import annotations

import http.client
import statistics
import time


def _timed(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None) -> float:
    t0 = time.perf_counter()
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    elapsed = time.perf_counter() - t0
    assert resp.status == 200, resp.status
    return elapsed


def kept_alive_and_fresh(host: str, port: int, method: str, path: str, body: bytes | None = None,
                         n: int = 15) -> tuple[float, float]:
    """(median seconds per request on one kept-alive connection, median on a new connection each)."""
    kept = http.client.HTTPConnection(host, port, timeout=30)
    _timed(kept, method, path, body)  # the connection is open and warm from here on
    kept_s, fresh_s = [], []
    for _ in range(n):
        kept_s.append(_timed(kept, method, path, body))
        fresh = http.client.HTTPConnection(host, port, timeout=30)
        fresh_s.append(_timed(fresh, method, path, body))  # connecting is part of a fresh request's cost
        fresh.close()
    kept.close()
    return statistics.median(kept_s), statistics.median(fresh_s)


def assert_kept_alive_as_fast(host: str, port: int, method: str, path: str, body: bytes | None = None) -> None:
    kept, fresh = kept_alive_and_fresh(host, port, method, path, body)
    assert kept <= 2 * fresh + 0.005, (f"a kept-alive request took {kept * 1e3:.1f} ms (median), one on a new "
                                       f"connection {fresh * 1e3:.1f} ms")
