"""Bounded retries of environment-server calls: backoff doubles, and nothing retries past the deadline."""

from __future__ import annotations

from gymv.envs.retry import Backoff


class FakeClock:
    """A clock that only sleeping advances, so the schedule is exact."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s

    def __call__(self):
        return self.now


def test_retries_wait_exponentially_longer():
    clock = FakeClock()
    tries = Backoff(3, 0.5, sleep=clock.sleep, clock=clock)
    assert list(tries) == [0, 1, 2, 3] and tries.attempts == 4
    assert clock.sleeps == [0.5, 1.0, 2.0]


def test_no_retry_starts_after_the_deadline_and_no_wait_runs_past_it():
    clock = FakeClock()
    tries = Backoff(10, 1.0, deadline_s=5.0, sleep=clock.sleep, clock=clock)
    for _ in tries:
        clock.now += 1.0  # each attempt takes a second (a stalled server answering at its timeout)
    assert clock.now <= 6.0 + 1e-9  # the last attempt started by the deadline
    assert tries.attempts == 3 and clock.sleeps == [1.0, 2.0]
