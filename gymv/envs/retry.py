"""Bounded retries for calls to an environment server: exponential backoff within an overall deadline.

A server that is down answers at once and a stalled one after the socket timeout; either way a caller
should give up after a bounded time, not retry for as long as the server stays bad.
"""

from __future__ import annotations

import time
from collections.abc import Iterator


class Backoff:
    """`for attempt in Backoff(...)`: attempt 0 at once, then up to `retries` more after delays of
    `first_s`, 2×`first_s`, ...; no retry starts after `deadline_s` (from the first attempt), and no delay
    runs past it. `attempts` says how many were made."""

    def __init__(self, retries: int, first_s: float, deadline_s: float | None = None, *, sleep=time.sleep,
                 clock=time.monotonic):
        self.retries, self.first_s, self.deadline_s = retries, first_s, deadline_s
        self._sleep, self._clock = sleep, clock
        self.attempts = 0

    def __iter__(self) -> Iterator[int]:
        start = self._clock()
        delay = self.first_s
        for attempt in range(self.retries + 1):
            if attempt:
                if self.deadline_s is not None:
                    left = start + self.deadline_s - self._clock()
                    if left <= 0:
                        return
                    delay = min(delay, left)
                self._sleep(delay)
                delay *= 2
            self.attempts = attempt + 1
            yield attempt
