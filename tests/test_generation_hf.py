"""The HF generation backend: batched KV-cached sampling from token ids + images, with exact logprobs."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.generation.base import GenerationRequest, SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.errors import GymvError
from tiny_models import chat_ids, fresh_policy, noise, shared_policy, solid

ARCHES = ["tiny-llava", "tiny-qwen2vl"]


def requests(policy, n=4, texts=("How many red circles?", "Click the blue one, please.", "Hi")):
    out = []
    for i in range(n):
        image = noise(i % 2, (80 + 30 * (i % 2), 60))
        ids = chat_ids(policy, texts[i % len(texts)], [image])
        out.append(GenerationRequest(ids, [image], where=f"row {i} turn 0"))
    return out


def no_cache_greedy(policy, req: GenerationRequest, n: int) -> list[int]:
    """Reference decoding: a full forward over the whole sequence for every new token, no cache, no padding."""
    ids = list(req.prompt_token_ids)
    forbidden = list(policy.adapter.vision_token_ids)
    grid = policy.adapter.style == "grid"
    kwargs = {}
    if req.images:
        inputs = policy.adapter.preprocess(list(req.images))
        kwargs["pixel_values"] = inputs.pixel_values
        if grid:
            kwargs["image_grid_thw"] = inputs.image_grid_thw
    for _ in range(n):
        x = torch.tensor([ids])
        if grid:
            kwargs["mm_token_type_ids"] = (x == policy.adapter.image_token_id).int()
        with torch.no_grad():
            logits = policy.model(input_ids=x, use_cache=False, **kwargs).logits[0, -1]
        logits[forbidden] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(req.prompt_token_ids):]


@pytest.mark.parametrize("arch", ARCHES)
def test_kv_cache_batched_greedy_equals_no_cache_greedy(arch):
    policy = shared_policy(arch)
    reqs = requests(policy, n=3)
    outs = HFGenerationBackend.from_policy(policy).generate(
        reqs, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    for req, out in zip(reqs, outs):
        assert out.token_ids == no_cache_greedy(policy, req, 8)


@pytest.mark.parametrize("arch", ARCHES)
def test_generation_logprobs_equal_training_logprobs(arch):
    policy = shared_policy(arch)
    reqs = requests(policy, n=6)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)
    outs = HFGenerationBackend.from_policy(policy).generate(reqs, params)
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [r.images for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=0.7)
    deltas = []
    for b, (r, o) in enumerate(zip(reqs, outs)):
        start = len(r.prompt_token_ids)
        deltas.append(train[b, start:start + len(o.token_ids)] - torch.tensor(o.logprobs))
    mult_err = torch.exp(torch.cat(deltas).abs()).mean().item()
    assert mult_err < 1.01
    assert mult_err < 1.0001  # fp32 on CPU agrees far better than the health threshold


def test_sampling_never_emits_a_vision_token_even_when_the_model_prefers_it():
    policy = fresh_policy("tiny-llava")
    image_id = policy.adapter.image_token_id
    with torch.no_grad():
        policy.model.lm_head.weight[image_id] *= 0
        policy.model.lm_head.weight[image_id] += 50 * policy.model.lm_head.weight.abs().max()
        policy.model.model.language_model.norm.weight.fill_(0)
        policy.model.model.language_model.norm.weight[0] = 1.0
        policy.model.model.language_model.embed_tokens.weight[:, 0] = 10.0
    reqs = requests(policy, n=4)
    raw = policy.model.generate(input_ids=torch.tensor([reqs[0].prompt_token_ids]),
                                pixel_values=policy.adapter.preprocess(reqs[0].images).pixel_values,
                                max_new_tokens=3, do_sample=False)
    assert raw[0, -3:].tolist() == [image_id] * 3  # unmasked, the model emits image tokens
    outs = HFGenerationBackend.from_policy(policy).generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=16))
    for out in outs:
        assert image_id not in out.token_ids
        assert all(torch.isfinite(torch.tensor(out.logprobs)))


def test_grid_model_never_emits_any_vision_special():
    policy = shared_policy("tiny-qwen2vl")
    outs = HFGenerationBackend.from_policy(policy).generate(
        requests(policy, n=8), SamplingParams(temperature=2.0, max_new_tokens=24, ignore_eos=True, seed=0))
    emitted = {t for o in outs for t in o.token_ids}
    assert not emitted & set(policy.adapter.vision_token_ids)


def test_stop_token_id_ends_the_sequence_and_is_kept():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=2)
    backend = HFGenerationBackend.from_policy(policy)
    free = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    stop = free[0].token_ids[3]
    outs = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                 stop_token_ids=(stop,)))
    first = free[0].token_ids.index(stop)
    assert outs[0].token_ids == free[0].token_ids[:first + 1]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", stop)
    assert len(outs[0].logprobs) == len(outs[0].token_ids)


def test_stop_string_ends_the_sequence_at_the_token_that_completes_it():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=1)
    backend = HFGenerationBackend.from_policy(policy)
    free = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
    full = policy.tokenizer.decode(free.token_ids)
    k = next(i for i in range(2, 10) if len(policy.tokenizer.decode(free.token_ids[:i])) >= 2)
    prefix = policy.tokenizer.decode(free.token_ids[:k])
    stop = prefix[-2:]
    assert stop in full
    out = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True,
                                                stop_strings=(stop,)))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert stop in policy.tokenizer.decode(out.token_ids)
    assert stop not in policy.tokenizer.decode(out.token_ids[:-1])
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_eos_stops_unless_ignored_and_length_is_reported():
    policy = fresh_policy("tiny-llava")
    eos = policy.tokenizer.eos_token_id
    with torch.no_grad():
        policy.model.lm_head.weight[eos] += 5 * policy.model.lm_head.weight.abs().max()
    reqs = requests(policy, n=2)
    backend = HFGenerationBackend.from_policy(policy)
    params = SamplingParams(temperature=0, max_new_tokens=5)
    logits_favour_eos = backend.generate(reqs, params)
    for out in logits_favour_eos:
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    for out in backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)):
        assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_repeated_image_is_encoded_once_and_reset_clears_the_cache():
    policy = shared_policy("tiny-llava")
    backend = HFGenerationBackend.from_policy(policy)
    image = noise(7)
    group = [GenerationRequest(chat_ids(policy, "Q", [image]), [image]) for _ in range(4)]
    backend.generate(group, SamplingParams(max_new_tokens=2))
    assert (backend.stats()["encoder_cache_misses"], backend.stats()["encoder_cache_hits"]) == (1, 3)
    backend.generate(group[:1], SamplingParams(max_new_tokens=2))
    assert (backend.stats()["encoder_cache_misses"], backend.stats()["encoder_cache_hits"]) == (1, 4)
    backend.reset_encoder_cache()
    backend.generate(group[:1], SamplingParams(max_new_tokens=2))
    assert backend.stats()["encoder_cache_misses"] == 2 and backend.stats()["encoder_cache_entries"] == 1


def test_encoder_cache_outlives_weight_updates_until_reset():
    policy = fresh_policy("tiny-llava")
    backend = HFGenerationBackend.from_policy(policy)
    req = requests(policy, n=1)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = backend.generate(req, greedy)[0].token_ids
    vision = {k: v * 0 for k, v in policy.model.state_dict().items() if "multi_modal_projector" in k}
    backend.update_weights(vision)
    assert backend.generate(req, greedy)[0].token_ids == before  # stale features by design: caller resets
    backend.reset_encoder_cache()
    assert backend.generate(req, greedy)[0].token_ids != before


def test_update_weights_changes_outputs_and_rejects_foreign_names():
    policy = fresh_policy("tiny-llava")
    backend = HFGenerationBackend.from_policy(policy)
    req = requests(policy, n=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = [o.token_ids for o in backend.generate(req, greedy)]
    sd = {k: v.clone() for k, v in policy.model.state_dict().items() if k == "lm_head.weight"}
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"], generator=torch.Generator().manual_seed(1))
    backend.update_weights(sd)
    assert [o.token_ids for o in backend.generate(req, greedy)] != before
    assert backend.stats()["weight_updates"] == 1
    with pytest.raises(GymvError, match="does not have"):
        backend.update_weights({"not.a.weight": torch.zeros(1)})


def test_same_seed_same_samples_and_other_seed_differs():
    policy = shared_policy("tiny-qwen2vl")
    backend = HFGenerationBackend.from_policy(policy)
    reqs = requests(policy, n=4)
    a, b, c = (backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=10, seed=s)) for s in (1, 1, 2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_p_keeps_only_the_nucleus():
    policy = shared_policy("tiny-llava")
    backend = HFGenerationBackend.from_policy(policy)
    reqs = requests(policy, n=1) * 6
    tiny_p = backend.generate(reqs, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=5, seed=4,
                                                   ignore_eos=True))
    greedy = backend.generate(reqs[:1], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert all(o.token_ids == greedy[0].token_ids for o in tiny_p)


def test_placeholder_mismatch_in_a_request_is_an_error_naming_it():
    policy = shared_policy("tiny-llava")
    req = requests(policy, n=1)[0]
    bad = GenerationRequest(req.prompt_token_ids[:-20] + req.prompt_token_ids[-5:], req.images, where="row 9 turn 3")
    with pytest.raises(GymvError, match="^row 9 turn 3: image placeholder tokens do not match"):
        HFGenerationBackend.from_policy(policy).generate([bad], SamplingParams(max_new_tokens=2))


def test_text_only_requests_and_mixed_batches_work():
    policy = shared_policy("tiny-qwen2vl")
    text_only = GenerationRequest(chat_ids(policy, "no image here", []), [])
    reqs = [text_only] + requests(policy, n=2)
    outs = HFGenerationBackend.from_policy(policy).generate(reqs, SamplingParams(temperature=0, max_new_tokens=5,
                                                                                  ignore_eos=True))
    assert outs[0].token_ids == no_cache_greedy(policy, text_only, 5)
    assert outs[1].token_ids == no_cache_greedy(policy, reqs[1], 5)


def test_bad_sampling_params_are_errors():
    policy = shared_policy("tiny-llava")
    backend = HFGenerationBackend.from_policy(policy)
    for params in (SamplingParams(temperature=-1), SamplingParams(top_p=0), SamplingParams(max_new_tokens=0)):
        with pytest.raises(GymvError):
            backend.generate(requests(policy, n=1), params)


@pytest.mark.parametrize("arch", ARCHES)
def test_requests_with_the_same_prompt_and_image_are_prefilled_once_and_decode_as_if_alone(arch):
    policy = shared_policy(arch)
    a, b = requests(policy, n=2)
    batch = [a, b, a, a, b]  # two groups, interleaved as a rollout batch may be
    layer = policy.model.model.language_model.layers[0]
    rows_seen = []
    hook = layer.register_forward_hook(lambda mod, args, out: rows_seen.append(tuple(args[0].shape[:2])))
    backend = HFGenerationBackend.from_policy(policy)
    try:
        outs = backend.generate(batch, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    finally:
        hook.remove()
    assert rows_seen[0][0] == 2 and all(r == (5, 1) for r in rows_seen[1:])  # prefill of 2 rows, then 5 per step
    assert backend.last_timing["prefill_rows"] == 2
    for req, out in zip(batch, outs):
        alone = backend.generate([req], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
