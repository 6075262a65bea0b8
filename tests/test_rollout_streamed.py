"""Streamed rollouts: one `serve` session per batch, each episode's next turn joining the running batch as soon
as its own environment step is done (continuous batching across turns).

The tiny model is real and random: its greedy turns end on a stop set of a third of the vocabulary, so turns
last one to a few tokens and differ between rows; `TurnsEnv` rows say how many turns each episode lasts.
"""

from __future__ import annotations

import threading

import pytest

from gymv.backends.generation import SamplingParams
from gymv.backends.generation.base import GenerationRequest, RequestFeed
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.generation.static import StaticDecodeBackend
from gymv.envs.protocol import RowError
from gymv.errors import GymvError
from gymv.rollout import run_rollouts
from rollout_helpers import TurnsEnv, turns_row
from tiny_models import chat_ids, shared_policy

TEXTS = ("Count", "How many red circles?", "Hi", "Click the blue one", "What is it?", "Go on")


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def stops(policy) -> tuple[int, ...]:
    return tuple(i for i in range(len(policy.tokenizer)) if i % 3 == 0)


def greedy(policy, n=12) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=stops(policy))


def rows(turns=(1, 4, 2, 3, 4, 1), extra: dict | None = None) -> list[tuple[int, dict]]:
    return [(i, turns_row(TEXTS[i % len(TEXTS)], n, **(extra or {}).get(i, {}))) for i, n in enumerate(turns)]


def run(policy, backend, params, data, *, streamed, group_size=1, stats=None, **kw):
    return run_rollouts(backend, policy.adapter, policy.tokenizer, None, TurnsEnv(), data, group_size=group_size,
                        params=params, max_turns=6, max_rollout_tokens=200, max_seq_len=1024, streamed=streamed,
                        stats=stats, **kw)


def same_trajectories(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.task_index, x.sample_index) == (y.task_index, y.sample_index)
        assert x.token_ids == y.token_ids
        assert x.loss_mask == y.loss_mask
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert (x.image_turns, x.image_keys) == (y.image_turns, y.image_keys)
        assert (x.turns, x.reward, x.finish_reason, x.truncated, x.error) == (y.turns, y.reward, y.finish_reason,
                                                                             y.truncated, y.error)
        assert [c["generation_end"] for c in x.model_calls] == [c["generation_end"] for c in y.model_calls]


def test_streamed_greedy_episodes_of_different_lengths_equal_turn_synchronous(policy):
    backend = StaticDecodeBackend.from_policy(policy, sync_every=1)
    stats_sync, stats_streamed = {}, {}
    sync = run(policy, backend, greedy(policy), rows(), streamed=False, stats=stats_sync)
    streamed = run(policy, backend, greedy(policy), rows(), streamed=True, stats=stats_streamed)
    same_trajectories(streamed, sync)
    assert sorted({t.turns for t in sync}) == [1, 2, 3, 4]  # the rows really differ in length
    assert any(t.image_turns == [2] for t in sync)  # the follow-up image came in at turn 2
    assert (stats_sync["generate_calls"], stats_streamed["generate_calls"]) == (4, 1)
    assert backend.last_timing["batch"] == sum(t.turns for t in sync)  # every turn went through the one session
    assert backend.last_timing["repacks"] >= 1  # the rows of the last long episodes moved to a smaller bucket
    assert backend.last_timing["batch_bucket"] < 8  # it started on 8 rows (6 episodes)


def test_streaming_is_the_default_for_a_continuously_batching_backend(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    stats = {}
    run(policy, backend, greedy(policy), rows((2, 1)), streamed=None, stats=stats)
    assert stats["generate_calls"] == 1
    assert backend.last_timing["batch"] == 3


def test_a_seeded_sampled_run_does_not_depend_on_which_episode_finishes_first(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=stops(policy))
    data = rows((3, 2, 4, 1))

    def tokens(max_batch, seed):
        backend = StaticDecodeBackend.from_policy(policy, max_batch=max_batch, sync_every=max_batch)
        return [t.token_ids for t in run(policy, backend, params, data, streamed=True, group_size=2, seed=seed)]

    wide = tokens(8, 7)
    assert tokens(3, 7) == wide  # three slots: other admission and finishing orders, the same samples
    assert tokens(8, 7) == wide
    assert tokens(8, 8) != wide
    assert len({tuple(t) for t in wide}) == len(wide)  # the two samples of a row differ


class _JoinWatch:
    """The static backend, whose first handed-back output waits (on an event, no sleep) until some episode's
    next request has been fed: that request then finds the other episodes' turns still decoding."""

    def __init__(self, inner):
        self.inner, self.order = inner, []

    def serve(self, feed, params, on_output, **hints):
        fed, put = threading.Event(), feed.put
        delivered = []

        def put_and_tell(key, request):
            put(key, request)
            fed.set()

        def hand_back(key, out):
            self.order.append(key)
            on_output(key, out)
            if not delivered:
                delivered.append(key)
                assert fed.wait(30), "the episode's next request was never fed"

        feed.put = put_and_tell
        return self.inner.serve(feed, params, hand_back, **hints)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_episodes_next_turn_is_served_while_another_episodes_turn_still_decodes(policy):
    backend = _JoinWatch(StaticDecodeBackend.from_policy(policy, sync_every=1))
    run(policy, backend, greedy(policy), rows((3, 3, 3, 3)), streamed=True)
    first = backend.order[0]
    back_again = backend.order.index(first, 1)  # its next turn's output
    assert set(backend.order[:back_again]) != {0, 1, 2, 3}  # came back before some episode's first turn ended
    assert backend.inner.last_timing["joined"] >= 1


def test_an_environment_step_that_fails_marks_only_its_episode(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    out = run(policy, backend, greedy(policy), rows((3, 3, 2), {1: {"crash_at": 1}}), streamed=True)
    assert out[1].error.startswith("environment step failed at turn 1")
    assert out[1].turns == 2
    assert [t.error for t in (out[0], out[2])] == [None, None]
    assert (out[0].turns, out[2].turns) == (3, 2)


class _BlamesTheRow(TurnsEnv):
    def score_output(self, row, output):
        raise RowError("the row has no answer")


def test_a_row_error_raises_naming_the_row(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    with pytest.raises(RowError, match="no answer") as e:
        run_rollouts(backend, policy.adapter, policy.tokenizer, None, _BlamesTheRow(), rows((2, 1)), group_size=1,
                     params=greedy(policy), max_turns=4, max_rollout_tokens=200, max_seq_len=1024, streamed=True)
    assert "row 0" in str(e.value)


class _BreaksItsContract(TurnsEnv):
    def step(self, state, turn):
        super().step(state, turn)
        return "not a StepResult"


def test_a_failure_in_a_worker_thread_ends_the_session_and_raises(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    with pytest.raises(AttributeError):
        run_rollouts(backend, policy.adapter, policy.tokenizer, None, _BreaksItsContract(), rows((3, 3)),
                     group_size=1, params=greedy(policy), max_turns=4, max_rollout_tokens=200, max_seq_len=1024,
                     streamed=True)


@pytest.mark.parametrize("backend_class", [StaticDecodeBackend, HFGenerationBackend])
def test_the_budgets_hold_in_a_streamed_run(policy, backend_class):
    backend = backend_class.from_policy(policy)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)  # every turn runs to its cap
    sync = run_rollouts(backend, policy.adapter, policy.tokenizer, None, TurnsEnv(), rows((4, 4)), group_size=1,
                        params=params, max_turns=6, max_rollout_tokens=4, max_seq_len=1024, streamed=False)
    streamed = run_rollouts(backend, policy.adapter, policy.tokenizer, None, TurnsEnv(), rows((4, 4)), group_size=1,
                            params=params, max_turns=6, max_rollout_tokens=4, max_seq_len=1024, streamed=True)
    same_trajectories(streamed, sync)
    assert [(t.num_generated, t.finish_reason, t.truncated) for t in streamed] == [(4, "length", True)] * 2


def test_a_backend_without_continuous_batching_streams_through_batched_generate(policy):
    backend = HFGenerationBackend.from_policy(policy)
    assert not backend.serves_continuously
    same_trajectories(run(policy, backend, greedy(policy), rows((2, 3, 1)), streamed=True),
                      run(policy, backend, greedy(policy), rows((2, 3, 1)), streamed=False))


def test_serve_hands_each_output_back_and_a_request_fed_meanwhile_joins_the_batch(policy):
    backend = StaticDecodeBackend.from_policy(policy, sync_every=1)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    reqs = [GenerationRequest(chat_ids(policy, t, []), [], where=t, max_new_tokens=n)
            for t, n in (("Hi", 2), ("Count", 8), ("Go on", 5))]
    feed = RequestFeed([("a", reqs[0]), ("b", reqs[1])])
    got = {}

    def on_output(key, out):
        got[key] = out
        if key == "a":
            feed.put("c", reqs[2])  # ready while "b" still decodes
        if len(got) == 3:
            feed.close()

    backend.serve(feed, params, on_output, max_seq_len=256)
    assert list(got) == ["a", "c", "b"]
    assert backend.last_timing["joined"] == 1
    alone = backend.generate(reqs, params)
    for key, req, ref in zip("abc", reqs, alone):
        assert got[key].token_ids == ref.token_ids[:req.max_new_tokens]
        assert got[key].logprobs == pytest.approx(ref.logprobs[:req.max_new_tokens], abs=1e-4)


def test_serve_refuses_a_request_longer_than_its_cache(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    ids = chat_ids(policy, "Hi", [])
    feed = RequestFeed([(0, GenerationRequest(ids, [], where="row 9, turn 3"))], closed=True)
    with pytest.raises(GymvError, match="over this session's cache") as e:
        backend.serve(feed, SamplingParams(max_new_tokens=64), lambda k, o: None, max_seq_len=len(ids) + 8)
    assert "row 9, turn 3" in str(e.value)


def test_a_session_takes_fewer_rows_where_their_cache_would_not_fit():
    from gymv.backends.generation.static import rows_that_fit

    buckets = StaticDecodeBackend.BATCH_BUCKETS
    assert rows_that_fit(100, 10, 1280, buckets) == 100  # its bucket, 128 rows, fits
    assert rows_that_fit(100, 10, 1279, buckets) == 64
    assert rows_that_fit(3, 10, 5, buckets) == 1


def test_a_generation_worker_holds_its_weights_lock_for_a_whole_session(policy):
    from gymv.cluster.workers import _Locked

    lock = threading.Lock()
    held = []
    backend = _Locked(StaticDecodeBackend.from_policy(policy), lock)
    feed = RequestFeed([(0, GenerationRequest(chat_ids(policy, "Hi", []), []))], closed=True)
    backend.serve(feed, greedy(policy, 4), lambda key, out: held.append(lock.locked()), max_seq_len=256)
    assert held == [True] and not lock.locked()


def test_the_default_serve_generates_ready_requests_together_and_cuts_each_to_its_cap(policy):
    backend = HFGenerationBackend.from_policy(policy)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    reqs = [GenerationRequest(chat_ids(policy, t, []), [], where=t, max_new_tokens=n)
            for t, n in (("Hi", 2), ("Count", 5))]
    got = {}
    backend.serve(RequestFeed(enumerate(reqs), closed=True), params, got.__setitem__)
    assert (backend.last_timing["batch"], backend.last_timing["new_tokens"]) == (2, 10)  # one call, to the longest cap
    full = backend.generate(reqs, params)
    assert [got[i].token_ids for i in range(2)] == [full[0].token_ids[:2], full[1].token_ids[:5]]
    assert [got[i].finish_reason for i in range(2)] == ["length", "length"]


def test_a_session_joins_no_request_into_running_rows_before_join_every_steps(policy):
    every_check = StaticDecodeBackend.from_policy(policy, sync_every=1)
    never_mid_decode = StaticDecodeBackend.from_policy(policy, sync_every=1, join_every=10_000)
    data = rows((3, 4, 2, 4, 3, 1))
    same_trajectories(run(policy, never_mid_decode, greedy(policy), data, streamed=True),
                      run(policy, every_check, greedy(policy), data, streamed=True))
    assert never_mid_decode.last_timing["joined"] == 0  # requests waited until no row was decoding
    assert never_mid_decode.last_timing["refill_calls"] > 0
