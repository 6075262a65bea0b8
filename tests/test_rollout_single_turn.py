"""Single-turn rollouts with the real tiny LLaVA, the real HF backend and real circle-count rows."""

from __future__ import annotations

import pytest

from gymv.backends.generation import SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.envs.protocol import RowError
from gymv.rollout import run_rollouts
from rollout_helpers import RecordingBackend, tiny_rows
from tiny_models import shared_policy

G = 3


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


@pytest.fixture(scope="module")
def count_rows():
    return tiny_rows("circle-count", 2)


def rollouts(policy, env, rows, backend=None, *, group_size=G, params=None, max_seq_len=512, max_rollout_tokens=64,
             seed=7, **kw):
    backend = backend or HFGenerationBackend.from_policy(policy, seed=0)
    return run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, env, rows,
                        group_size=group_size, params=params or SamplingParams(max_new_tokens=12), max_turns=1,
                        max_rollout_tokens=max_rollout_tokens, max_seq_len=max_seq_len, seed=seed, **kw)


@pytest.fixture(scope="module")
def recorded(policy, count_rows):
    env, rows = count_rows
    backend = RecordingBackend(HFGenerationBackend.from_policy(policy, seed=0))
    return backend, rollouts(policy, env, rows, backend, weights_version=5)


def test_trajectories_come_back_grouped_in_row_order(recorded, count_rows):
    _, trajs = recorded
    assert [(t.task_index, t.sample_index) for t in trajs] == [(i, g) for i, _ in count_rows[1] for g in range(G)]
    assert all(t.row is count_rows[1][t.task_index][1] for t in trajs)
    assert {t.agent_name for t in trajs} == {"circle_count_simple_agent"}
    assert {t.weights_version for t in trajs} == {5}


def test_one_generate_call_serves_every_episode_of_the_turn(recorded):
    backend, trajs = recorded
    assert len(backend.calls) == 1 and len(backend.calls[0][0]) == len(trajs)


def test_mask_and_logprobs_align_with_the_generated_span(recorded):
    _, trajs = recorded
    for t in trajs:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        (call,) = t.model_calls
        s, e = call["generation_start"], call["generation_end"]
        assert t.loss_mask == [0] * s + [1] * (e - s) and e == len(t.token_ids)
        assert all(x == 0.0 for x in t.logprobs[:s]) and all(x < 0 for x in t.logprobs[s:])


def test_generated_tokens_are_the_backends_tokens_never_retokenized(recorded, policy):
    backend, trajs = recorded
    (requests, outputs), = backend.calls
    retokenized_differs = False
    for t, req, out in zip(trajs, requests, outputs):
        s, e = t.model_calls[0]["generation_start"], t.model_calls[0]["generation_end"]
        assert t.token_ids[:s] == req.prompt_token_ids
        assert t.token_ids[s:e] == out.token_ids and t.logprobs[s:e] == out.logprobs
        text = policy.tokenizer.decode(out.token_ids)
        retokenized_differs |= policy.tokenizer.encode(text, add_special_tokens=False) != out.token_ids
    assert retokenized_differs  # decode + encode would have changed some sample: the check has teeth


def test_prompt_image_has_its_placeholder_span_and_turn_zero(recorded, policy):
    _, trajs = recorded
    for t in trajs:
        assert len(t.images) == 1 and t.image_turns == [0]
        assert policy.adapter.count_placeholders(t.token_ids) == policy.adapter.tokens_per_image(t.images[0])
        policy.adapter.check(t.token_ids, t.images, where="test")
        s = t.model_calls[0]["generation_start"]
        assert policy.adapter.count_placeholders(t.token_ids[:s]) == policy.adapter.count_placeholders(t.token_ids)


def test_random_model_output_is_a_model_fault_with_reward_zero(recorded):
    _, trajs = recorded
    for t in trajs:
        assert t.error is None and t.reward == 0.0 and t.failure_reason == "no_boxed_answer"
        assert t.output[0]["type"] == "message" and t.turns == 1


def test_same_seed_same_trajectories_other_seed_differs(policy, count_rows):
    env, rows = count_rows
    a = rollouts(policy, env, rows[:1], seed=11)
    b = rollouts(policy, env, rows[:1], seed=11)
    c = rollouts(policy, env, rows[:1], seed=12)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    assert [t.output for t in a] == [t.output for t in b]
    assert [t.token_ids for t in a] != [t.token_ids for t in c]


def test_group_shares_one_decoded_image_and_the_encoder_encodes_it_once(policy, count_rows, monkeypatch):
    from gymv.data import images

    decoded = []
    real = images.decode_data_url
    monkeypatch.setattr(images, "decode_data_url", lambda url, **kw: decoded.append(url) or real(url, **kw))
    env, rows = count_rows
    backend = HFGenerationBackend.from_policy(policy, seed=0)
    stats = {}
    trajs = rollouts(policy, env, rows, backend, group_size=4, stats=stats)
    assert len(decoded) == len(rows) == stats["image_decodes"]
    for i in range(len(rows)):
        group = [t for t in trajs if t.task_index == i]
        assert all(t.images[0] is group[0].images[0] for t in group)
        assert len({t.image_keys[0] for t in group}) == 1
    assert backend.stats()["encoder_cache_misses"] == len(rows)
    assert backend.stats()["encoder_cache_hits"] == len(rows) * (4 - 1)


def test_sequence_never_exceeds_max_seq_len_and_is_marked_truncated(policy, count_rows):
    env, rows = count_rows
    prompt_len = rollouts(policy, env, rows[:1], group_size=1)[0].prompt_length
    trajs = rollouts(policy, env, rows[:1], params=SamplingParams(max_new_tokens=40, ignore_eos=True),
                     max_seq_len=prompt_len + 5, max_rollout_tokens=100)
    for t in trajs:
        assert len(t.token_ids) == prompt_len + 5 and sum(t.loss_mask) == 5
        assert t.truncated and t.finish_reason == "length" and t.error is None


def test_rollout_token_budget_caps_generation(policy, count_rows):
    env, rows = count_rows
    trajs = rollouts(policy, env, rows[:1], params=SamplingParams(max_new_tokens=40, ignore_eos=True),
                     max_rollout_tokens=3)
    assert all(sum(t.loss_mask) == 3 and t.truncated and t.finish_reason == "length" for t in trajs)


def test_prompt_that_leaves_no_room_is_an_excluded_error_not_a_crash(policy, count_rows):
    env, rows = count_rows
    prompt_len = rollouts(policy, env, rows[:1], group_size=1)[0].prompt_length
    trajs = rollouts(policy, env, rows, max_seq_len=prompt_len)
    assert all("max_seq_len" in t.error and t.token_ids == [] for t in trajs)


def test_row_without_verifier_fields_raises_naming_the_row(policy, count_rows):
    env, rows = count_rows
    bad = {k: v for k, v in rows[1][1].items() if k != "circles"}
    with pytest.raises(RowError, match=r"train\.jsonl line 2.*'circles'"):
        rollouts(policy, env, [rows[0], (1, bad)], source="train.jsonl")


def test_each_shared_image_object_is_hashed_once_per_generate_call(policy, count_rows, monkeypatch):
    from gymv.backends import multimodal

    hashed = []
    real = multimodal.image_hash
    monkeypatch.setattr(multimodal, "image_hash", lambda im: hashed.append(id(im)) or real(im))
    env, rows = count_rows
    rollouts(policy, env, rows, group_size=4)
    assert len(hashed) == len(rows)  # one per picture, not one per episode of its group


def test_stats_say_where_the_rollout_time_goes(policy, count_rows):
    from gymv.rollout.loop import BREAKDOWN

    env, rows = count_rows
    stats = {}
    rollouts(policy, env, rows, stats=stats)
    parts = {k: stats[f"breakdown/{k}"] for k in BREAKDOWN}
    assert all(v >= 0 for v in parts.values())
    assert parts["backend_decode_s"] > 0 and parts["render_s"] > 0 and parts["image_decode_s"] > 0
    assert parts["image_decode_s"] <= parts["render_s"]  # decoding happens while rendering
    backend_s = sum(v for k, v in parts.items() if k.startswith("backend_"))
    assert backend_s <= stats["generation_s"]
    env_s = sum(parts[k] for k in ("env_open_s", "render_s", "parse_s", "env_step_s", "env_verify_s"))
    assert env_s == pytest.approx(stats["env_s"], rel=0.05, abs=1e-3)
