"""The training worker's prefetch of the next SFT batch (gymv.cluster.prefetch): taken by key, built once,
errors raised where the value is taken."""

from __future__ import annotations

import threading

import pytest

from gymv.cluster.prefetch import Prefetch


def test_a_prefetch_taken_by_its_key_gives_what_the_build_returned():
    p = Prefetch()
    p.start(("a",), lambda: [1, 2, 3])
    assert p.take(("a",)) == (True, [1, 2, 3])
    assert p.take(("a",)) == (False, None)  # taken once
    p.close()


def test_a_prefetch_of_other_rows_is_not_used_and_is_dropped():
    p = Prefetch()
    p.start(("a",), lambda: "for a")
    assert p.take(("b",)) == (False, None)
    assert p.take(("a",)) == (False, None)
    p.close()


def test_a_build_that_failed_raises_where_its_value_is_taken():
    p = Prefetch()

    def bad():
        raise ValueError("row 3 cannot be laid out")
    p.start(("a",), bad)
    with pytest.raises(ValueError, match="row 3"):
        p.take(("a",))
    p.close()


def test_the_build_runs_while_the_caller_goes_on():
    p, started, release = Prefetch(), threading.Event(), threading.Event()

    def build():
        started.set()
        release.wait(10)
        return "built"
    p.start(("a",), build)
    assert started.wait(10)  # building in the background, before anything is taken
    release.set()
    assert p.take(("a",)) == (True, "built")
    p.close()


def test_a_build_queued_behind_a_dropped_one_is_waited_for_not_cancelled():
    release = threading.Event()
    p = Prefetch()
    p.start(("old",), lambda: release.wait(10))  # still running when dropped: the pool's one thread is busy
    p.start(("new",), lambda: "built")  # queued behind it
    threading.Timer(0.2, release.set).start()
    assert p.take(("new",)) == (True, "built")
    p.close()
