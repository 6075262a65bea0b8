"""The vLLM backend against the HF backend on the real tiny models: greedy rollouts equal token for token,
logprobs by gymv's definition, images per request, stops, seeds, vision tokens never sampled.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from gymv.backends.generation.base import GenerationRequest, SamplingParams  # noqa: E402
from gymv.backends.generation.hf import HFGenerationBackend  # noqa: E402
from gymv.backends.generation.vllm import VllmGenerationBackend  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from gymv.rollout import run_rollouts  # noqa: E402
from rollout_helpers import PictureEnv, picture_row  # noqa: E402
from tiny_models import chat_ids, noise, shared_policy, solid, tiny_path  # noqa: E402
from vllm_helpers import ToolFirst, max_logprob_gap, mult_prob_error, tiny_text_llama, vllm_backend  # noqa: E402

pytestmark = pytest.mark.slow
ARCHES = ["tiny-llava", "tiny-qwen2vl"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    built = {arch: vllm_backend(tiny_path(arch)) for arch in ARCHES}
    yield built
    for b in built.values():
        b.close()


def requests(policy, n=4, texts=("How many red circles?", "Click the blue one, please.", "Hi")):
    out = []
    for i in range(n):
        images = [noise(i % 3, (80 + 30 * (i % 2), 60))] + ([solid((0, 0, 200), (64, 64))] if i % 2 else [])
        out.append(GenerationRequest(chat_ids(policy, texts[i % len(texts)], images), images, where=f"row {i} turn 0"))
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_tokens_equal_the_hf_backends_and_logprobs_agree(engines, arch):
    policy = shared_policy(arch)
    reqs = requests(policy, n=5)
    want = HFGenerationBackend.from_policy(policy).generate(reqs, GREEDY)
    got = engines[arch].generate(reqs, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max_logprob_gap(got, want) < 1e-3
    assert mult_prob_error(policy, reqs, got) < 1.001


@pytest.mark.parametrize("arch", ARCHES)
def test_sampled_logprobs_are_the_trainers_at_a_temperature(engines, arch):
    policy = shared_policy(arch)
    reqs = requests(policy, n=6)
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=3)
    outs = engines[arch].generate(reqs, params)
    assert all(o.token_ids for o in outs)
    assert mult_prob_error(policy, reqs, outs, temperature=0.7) < 1.05
    assert mult_prob_error(policy, reqs, outs, temperature=0.7) < 1.001  # fp32 on CPU: far inside the limit


def test_a_seed_repeats_a_sample_and_the_requests_of_a_group_still_differ(engines):
    policy = shared_policy("tiny-llava")
    req = requests(policy, n=1)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=11)
    a = engines["tiny-llava"].generate([req] * 4, params)
    b = engines["tiny-llava"].generate([req] * 4, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1


def test_a_seeded_batch_larger_than_one_engine_step_generates(engines):
    """64 seeded requests with images: more than one scheduler step of prefill, which vLLM 0.32 would split
    and then fail to rewind the CPU generators of (the backend keeps prefills whole on CPU)."""
    policy = shared_policy("tiny-llava")
    one = requests(policy, n=8)
    outs = engines["tiny-llava"].generate(one * 8, SamplingParams(temperature=1.0, max_new_tokens=4, seed=5))
    assert len(outs) == 64 and all(o.token_ids for o in outs)


def test_text_only_requests_on_a_vlm_match_hf(engines):
    policy = shared_policy("tiny-llava")
    reqs = [GenerationRequest(chat_ids(policy, t, []), [], where=f"row {i}") for i, t in enumerate(["Hi", "Count."])]
    want = HFGenerationBackend.from_policy(policy).generate(reqs, GREEDY)
    assert [o.token_ids for o in engines["tiny-llava"].generate(reqs, GREEDY)] == [o.token_ids for o in want]


def test_stop_ids_and_stop_strings_end_a_sequence_as_the_hf_backend_does(engines):
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=3)
    free = HFGenerationBackend.from_policy(policy).generate(reqs, GREEDY)
    stop_id = free[0].token_ids[3]
    stop_str = policy.tokenizer.decode(free[1].token_ids[4:6])
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,),
                            stop_strings=(stop_str,))
    want = HFGenerationBackend.from_policy(policy).generate(reqs, params)
    got = engines["tiny-llava"].generate(reqs, params)
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in got] == \
        [(o.token_ids, o.finish_reason, o.stop_reason) for o in want]
    assert got[0].stop_reason == stop_id and got[0].token_ids[-1] == stop_id
    assert got[1].finish_reason == "stop"


def test_an_image_placeholder_mismatch_is_refused_before_vllm_sees_it(engines):
    policy = shared_policy("tiny-llava")
    req = requests(policy, n=1)[0]
    with pytest.raises(GymvError, match="placeholder") as e:
        engines["tiny-llava"].generate([GenerationRequest(req.prompt_token_ids[:-40] + req.prompt_token_ids[-30:],
                                                          req.images, where="row 7 turn 2")], GREEDY)
    assert e.value.where == "row 7 turn 2"


@pytest.mark.parametrize("arch", ARCHES)
def test_a_multi_turn_tool_episode_with_tool_images_is_the_same_on_both_backends(engines, arch):
    policy = shared_policy(arch)
    params = SamplingParams(temperature=0, max_new_tokens=48)  # room for the scripted tool call
    runs = []
    for backend in (HFGenerationBackend.from_policy(policy), engines[arch]):
        rec = ToolFirst(backend, policy.tokenizer)
        (t,) = run_rollouts(rec, policy.adapter, policy.tokenizer, policy.chat_template, PictureEnv(),
                            [(0, picture_row())], group_size=1, params=params, max_turns=3, max_rollout_tokens=512,
                            max_seq_len=2048, seed=0)
        runs.append((t, [(r, o) for reqs, outs in rec.calls for r, o in zip(reqs, outs)]))
    (t_hf, calls_hf), (t_vllm, calls_vllm) = runs
    assert [len(r.images) for r, _ in calls_hf] == [1, 2, 3]  # prompt image, tool image, follow-up image
    assert [r.prompt_token_ids for r, _ in calls_vllm] == [r.prompt_token_ids for r, _ in calls_hf]
    assert [o.token_ids for _, o in calls_vllm] == [o.token_ids for _, o in calls_hf]
    assert max_logprob_gap([o for _, o in calls_vllm], [o for _, o in calls_hf]) < 1e-3
    assert t_vllm.token_ids == t_hf.token_ids


def test_vision_tokens_are_never_sampled_even_when_the_model_prefers_them(engines):
    policy = shared_policy("tiny-llava")
    backend = engines["tiny-llava"]
    name = next(n for n, p in policy.model.named_parameters() if p is policy.model.lm_head.weight)
    original = policy.model.lm_head.weight.detach().clone()
    head = original.clone()
    head[policy.adapter.image_token_id] = head.abs().max() * 50 * torch.sign(head.mean(0))
    reqs = requests(policy, n=3)
    with torch.no_grad():  # unmasked, the new head's favourite is the image token
        policy.model.lm_head.weight.copy_(head)
        try:
            logits = policy.model(input_ids=torch.tensor([reqs[0].prompt_token_ids]),
                                  pixel_values=policy.adapter.preprocess(reqs[0].images).pixel_values).logits
        finally:
            policy.model.lm_head.weight.copy_(original)
    assert int(logits[0, -1].argmax()) == policy.adapter.image_token_id
    weights = policy.model.state_dict()
    backend.update_weights({**weights, name: head})
    try:
        for params in (GREEDY, SamplingParams(temperature=1.5, max_new_tokens=12, ignore_eos=True, seed=0)):
            for o in backend.generate(reqs, params):
                assert not set(o.token_ids) & set(policy.adapter.vision_token_ids)
    finally:
        backend.update_weights({**weights, name: original})


def test_a_text_only_language_model_matches_transformers(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_text_llama(tmp_path_factory.mktemp("llama") / "model")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    backend = vllm_backend(path)
    try:
        assert backend.adapter.style == "text" and backend.adapter.vision_token_ids == ()  # what rollouts render with
        prompts = [tok.encode(t, add_special_tokens=False) for t in ("Hello there", "one two three four", "x")]
        outs = backend.generate([GenerationRequest(p) for p in prompts], GREEDY)
        for p, o in zip(prompts, outs):
            ids, logps = list(p), []
            for _ in range(GREEDY.max_new_tokens):
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                nxt = int(logits.argmax())
                logps.append(torch.log_softmax(logits, -1)[nxt].item())
                ids.append(nxt)
            assert o.token_ids == ids[len(p):]
            assert max(abs(a - b) for a, b in zip(o.logprobs, logps)) < 1e-3
    finally:
        backend.close()


def test_top_p_below_one_keeps_the_trainers_logprob_definition_with_full_logits():
    """gymv's logprob is taken before the nucleus cut (gymv.backends.sampling); vLLM's processed logprobs are
    the renormalised nucleus's, so an engine built with full_logits computes them from every raw logit."""
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=6)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)
    engine = VllmGenerationBackend.create(str(tiny_path("tiny-llava")), seed=0, full_logits=True)
    try:
        outs = engine.generate(reqs, params)
        greedy = engine.generate(reqs[:2], GREEDY)
    finally:
        engine.close()
    assert all(o.token_ids for o in outs)
    assert mult_prob_error(policy, reqs, outs, temperature=0.7) < 1.05
    assert mult_prob_error(policy, reqs, outs, temperature=0.7) < 1.001  # fp32 on CPU: far inside the limit
    assert mult_prob_error(policy, reqs[:2], greedy) < 1.001  # greedy validation: temperature-1 logprobs


def test_top_p_below_one_on_an_engine_without_full_logits_is_refused(engines):
    policy = shared_policy("tiny-llava")
    with pytest.raises(GymvError, match="top_p 0.9") as e:
        engines["tiny-llava"].generate(requests(policy, n=1), SamplingParams(temperature=1.0, top_p=0.9))
    assert e.value.where == "generation.top_p" and "full_logits=True" in e.value.fix
