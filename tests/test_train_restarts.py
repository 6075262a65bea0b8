"""`with_restarts`: which failures start the run again, from where, and how many times."""

from __future__ import annotations

import pytest

from gymv.cluster.ray_placement import LOST_EXIT
from gymv.errors import GymvError
from gymv.train.launch import with_restarts
from train_helpers import ray_session


@pytest.fixture(scope="module")
def ray():
    stop = ray_session()
    yield
    stop()


def lost(run_dir: str | None = "runs/x", code: int = LOST_EXIT) -> GymvError:
    e = GymvError("training rank 0 on node n died during training: node n was lost", exit_code=code)
    if run_dir is not None:
        e.run_dir = run_dir
    return e


def test_a_lost_worker_restarts_the_run_from_its_run_directory_until_it_finishes():
    calls, said = [], []

    def run_once(resume_dir, after):
        calls.append(resume_dir)
        if len(calls) < 3:
            raise lost()
        return {"complete": True}

    assert with_restarts(run_once, max_restarts=2, say=said.append) == {"complete": True}
    assert calls == [None, "runs/x", "runs/x"]
    assert [s.split(" after:")[0] for s in said] == ["restart 1/2", "restart 2/2"]


def test_restarts_stop_at_the_limit_with_the_count_in_the_error():
    def run_once(resume_dir, after):
        raise lost()

    with pytest.raises(GymvError, match=r"was lost \(after 1 restart\)"):
        with_restarts(run_once, max_restarts=1, say=lambda s: None)


@pytest.mark.parametrize("error", [lost(code=1), lost(run_dir=None)], ids=["not a loss", "before the run directory"])
def test_other_failures_are_never_restarted(error):
    calls = []

    def run_once(resume_dir, after):
        calls.append(resume_dir)
        raise error

    with pytest.raises(GymvError):
        with_restarts(run_once, max_restarts=3, say=lambda s: None)
    assert calls == [None]


def _failing_task(message: str):
    import ray

    @ray.remote(num_cpus=0)
    def step():
        raise RuntimeError(message)

    return step.remote()


@pytest.mark.parametrize("message,blames_lr", [
    ("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)", False),
    ("expected a config with 4 layers", False),
    ("loss is NaN at micro-batch 2", True),
    ("weights hold non-finite values", True),
])
def test_a_worker_error_blames_the_learning_rate_only_when_it_is_about_non_finite_values(ray, message, blames_lr):
    from gymv.cluster.group import ray_get

    with pytest.raises(GymvError) as err:
        ray_get(_failing_task(message), "training")
    assert message in err.value.message and "--debug" in err.value.fix
    assert ("learning rate" in err.value.fix) == blames_lr


def _start_failing_actor(error: Exception):
    import ray

    @ray.remote(num_cpus=0)
    class Teacher:
        def __init__(self):
            raise error

        def info(self):
            return {}

    return Teacher.remote().info.remote()


@pytest.mark.parametrize("error,line,code", [
    (GymvError("teacher 'x' does not share the student's tokenizer (900 vs 1024 tokens)",
               where="mopd.teachers.x.path", fix="use a teacher built with the student's tokenizer"),
     "mopd.teachers.x.path: teacher 'x' does not share the student's tokenizer (900 vs 1024 tokens) "
     "(fix: use a teacher built with the student's tokenizer)", 2),
    (ValueError("vocab_size must be positive"),
     "a worker failed to start: ValueError: vocab_size must be positive", 1),
], ids=["GymvError", "other"])
def test_a_worker_whose_constructor_raises_is_reported_as_that_error_and_never_restarted(ray, error, line, code):
    from gymv.cluster.group import ray_get

    calls, said = [], []

    def run_once(resume_dir, after):
        calls.append(resume_dir)
        try:
            ray_get(_start_failing_actor(error), "starting the teachers")
        except GymvError as e:
            e.run_dir = "runs/x"  # as a launch that opened its run directory marks its error
            raise

    with pytest.raises(GymvError) as err:
        with_restarts(run_once, max_restarts=3, say=said.append)
    assert calls == [None] and said == []
    assert err.value.exit_code == code != LOST_EXIT
    assert err.value.one_line().startswith(line) and "died" not in err.value.message


def test_a_deferred_worker_whose_constructor_raises_stays_up_and_raises_it_on_every_call(ray):
    """Ray prints the traceback of an actor whose __init__ raised onto the driver's stderr; a method's error it
    only returns. deferred_start keeps the constructor's error for the calls, so the run's error is one line."""
    import ray as ray_

    from gymv.cluster.group import ray_get
    from gymv.cluster.ray_placement import deferred_start

    class Worker:
        def __init__(self, vocab: int):
            if vocab != 1024:
                raise GymvError(f"teacher 't' has {vocab} tokens", where="mopd.teachers.t.path", fix="use another")

        def where(self) -> str:
            return "here"

    Deferred = ray_.remote(num_cpus=0)(deferred_start(Worker))
    good, bad = Deferred.remote(1024), Deferred.remote(900)
    assert ray_get(good.where.remote(), "starting") == "here"
    for _ in range(2):  # alive, and saying the same each time
        with pytest.raises(GymvError) as err:
            ray_get(bad.where.remote(), "starting the teachers")
        assert err.value.one_line() == "mopd.teachers.t.path: teacher 't' has 900 tokens (fix: use another)"
        assert err.value.exit_code == 2
