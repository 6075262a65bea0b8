"""The step's PhaseTimer: the one source of a metrics row's `timing/*` keys."""

from __future__ import annotations

import time

import pytest

from gymv.timing import PhaseTimer, phase_key, step_row


def test_a_phase_is_the_seconds_of_its_block_under_timing_name_s():
    timer = PhaseTimer()
    t0 = time.perf_counter()
    with timer.phase("refit"):
        sum(range(10_000))
    outside = time.perf_counter() - t0
    assert set(timer.metrics()) == {"timing/refit_s"}
    assert 0.0 < timer.metrics()["timing/refit_s"] <= outside


def test_a_listener_hears_each_phase_as_it_starts_and_announced_ones_add_no_seconds():
    heard = []
    timer = PhaseTimer(on_phase=heard.append)
    with timer.phase("generation"):
        assert heard == ["generation"]  # told before the block runs, not after
    timer.announce("training")
    assert heard == ["generation", "training"]
    assert set(timer.seconds) == {"generation"}


def test_a_phase_run_twice_adds_up():
    timer = PhaseTimer()
    with timer.phase("refit"):
        pass
    first = timer.seconds["refit"]
    timer.add("refit", 2.0)
    assert timer.seconds["refit"] == pytest.approx(first + 2.0)


def test_a_phase_that_raises_is_still_timed():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError), timer.phase("checkpoint"):
        raise RuntimeError("disk full")
    assert "checkpoint" in timer.seconds


def test_nested_phases_are_each_their_own_figure():
    timer = PhaseTimer()
    with timer.phase("logprobs"):
        with timer.phase("reference"):
            sum(range(10_000))
    assert 0.0 < timer.seconds["reference"] <= timer.seconds["logprobs"]


def test_a_workers_timer_goes_into_the_drivers_through_take():
    worker = PhaseTimer()
    with worker.phase("training"):
        pass
    result = {"train/loss": 0.5, **worker.metrics(), "timing/train_step_s": 0.25}  # the backend's own too
    driver = PhaseTimer()
    rest = driver.take(result)
    assert rest == {"train/loss": 0.5}
    assert driver.seconds == {"training": worker.seconds["training"], "train_step": 0.25}


def test_take_reads_nested_phase_names():
    driver = PhaseTimer()
    driver.take({"timing/generation/render_s": 1.5, "timing/env_s": 0.5})
    assert driver.metrics() == {"timing/generation/render_s": 1.5, "timing/env_s": 0.5}
    assert phase_key("generation/render") == "timing/generation/render_s"


def test_a_worker_cannot_send_a_rate():
    with pytest.raises(ValueError, match="timing/tokens_per_s"):
        PhaseTimer().take({"timing/tokens_per_s": 100.0})


def test_step_s_appears_once_the_step_is_stopped_and_the_first_stop_counts():
    timer = PhaseTimer()
    assert "timing/step_s" not in timer.metrics()  # step 0's row: validation alone
    first = timer.stop()
    sum(range(10_000))
    assert timer.stop() == first == timer.metrics()["timing/step_s"]


def test_a_clock_started_earlier_counts_from_then():
    t0 = time.perf_counter()
    timer = PhaseTimer(started=t0 - 5.0)  # the step before stopped 5 s ago (back to back)
    assert timer.stop() >= 5.0


def test_a_rate_is_its_count_per_second_of_its_phase_once_that_phase_is_known():
    timer = PhaseTimer()
    timer.add("generation", 2.0)
    timer.rate("generation_tokens", 100, per="generation")
    timer.rate("tokens", 300, per="step")
    assert "timing/tokens_per_s" not in timer.metrics()
    step_s = timer.stop()
    m = timer.metrics()
    assert m["timing/generation_tokens_per_s"] == 50.0
    assert m["timing/tokens_per_s"] == pytest.approx(300 / step_s)


def test_a_row_is_the_algorithms_metrics_and_the_timers_record():
    timer = PhaseTimer()
    timer.add("refit", 1.0)
    timer.stop()
    row = step_row({"train/loss": 0.5}, timer)
    assert row == {"train/loss": 0.5, **timer.metrics()}
    assert {k for k in row if k.startswith("timing/")} == {phase_key(p) for p in timer.seconds}


def test_a_timing_key_made_outside_the_timer_is_refused():
    with pytest.raises(ValueError, match="timing/step_s"):
        step_row({"train/loss": 0.5, "timing/step_s": 1.0}, PhaseTimer())
