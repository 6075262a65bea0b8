"""The static-cache decoder: the HF backend's outputs and logprob definition, decoding on fixed buffers.

On CPU the decode step runs eagerly on the same buffers a CUDA graph captures on a GPU, so these tests
check the logic CI can run; the graph replay itself is measured by bench/gpu_decode.py on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gymv.backends.generation.base import GenerationRequest, SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.generation.static import (
    StaticDecodeBackend,
    _fuse_params,
    gumbel_noise,
    hf_backend,
    text_model,
    with_decode,
)
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.errors import GymvError
from test_generation_hf import no_cache_greedy, requests
from tiny_models import chat_ids, fresh_policy, noise, shared_policy

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_greedy_equals_no_cache_greedy_with_the_batch_padded_to_its_bucket():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=3)
    backend = StaticDecodeBackend.from_policy(policy)
    outs = backend.generate(reqs, GREEDY)
    assert backend.last_timing["batch_bucket"] == 4
    for req, out in zip(reqs, outs):
        assert out.token_ids == no_cache_greedy(policy, req, 8)
        assert (out.finish_reason, len(out.logprobs)) == ("length", 8)


@pytest.mark.parametrize("fuse_weights", [True, False])
def test_greedy_tokens_and_logprobs_equal_the_hf_loop_across_attention_windows(fuse_weights):
    policy = fresh_policy("tiny-llava")
    reqs = requests(policy, n=3)
    params = SamplingParams(temperature=0, max_new_tokens=34, ignore_eos=True)  # crosses a 32-column window
    new = StaticDecodeBackend.from_policy(policy, fuse_weights=fuse_weights).generate(reqs, params)
    old = HFGenerationBackend.from_policy(policy).generate(reqs, params)
    for a, b in zip(new, old):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_sampled_logprobs_equal_training_logprobs():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=6)
    outs = StaticDecodeBackend.from_policy(policy).generate(
        reqs, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3))
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [r.images for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=0.7)
    deltas = [train[b, len(r.prompt_token_ids):len(r.prompt_token_ids) + len(o.token_ids)] - torch.tensor(o.logprobs)
              for b, (r, o) in enumerate(zip(reqs, outs))]
    assert torch.exp(torch.cat(deltas).abs()).mean().item() < 1.0001


def test_a_rows_samples_depend_on_its_seed_and_place_not_on_the_rest_of_the_batch():
    policy = shared_policy("tiny-llava")
    backend = StaticDecodeBackend.from_policy(policy)
    reqs = requests(policy, n=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=5)
    alone = backend.generate(reqs[:1], params)[0]
    batched = backend.generate(reqs, params)
    again = backend.generate(reqs, params)
    other = backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=6))
    assert batched[0].token_ids == alone.token_ids
    assert [o.token_ids for o in batched] == [o.token_ids for o in again]
    assert [o.token_ids for o in batched] != [o.token_ids for o in other]
    group = backend.generate([reqs[0]] * 4, params)  # the G samples of one prompt differ from each other
    assert len({tuple(o.token_ids) for o in group}) > 1


def test_gumbel_max_draws_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, float("-inf"), 1.5, -0.5])
    n = 20000
    noise_ = gumbel_noise(torch.arange(n), torch.tensor([3]), torch.arange(8))
    draws = (logits + noise_).argmax(-1)
    freq = torch.bincount(draws, minlength=8).float() / n
    assert freq[5] == 0
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.015)
    steps = gumbel_noise(torch.arange(4), torch.tensor([4]), torch.arange(8))
    assert not torch.equal(steps, noise_[:4])  # another step, other noise


def test_sampling_never_emits_a_vision_token_even_when_the_model_prefers_it():
    policy = fresh_policy("tiny-llava")
    image_id = policy.adapter.image_token_id
    with torch.no_grad():
        policy.model.lm_head.weight[image_id] += 50 * policy.model.lm_head.weight.abs().max()
    reqs = requests(policy, n=4)
    outs = StaticDecodeBackend.from_policy(policy).generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=16))
    for out in outs:
        assert image_id not in out.token_ids
        assert all(torch.isfinite(torch.tensor(out.logprobs)))


def test_stop_token_id_ends_the_sequence_and_is_kept():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=2)
    backend = StaticDecodeBackend.from_policy(policy)
    free = backend.generate(reqs, GREEDY)
    stop = free[0].token_ids[3]
    out = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                stop_token_ids=(stop,)))[0]
    first = free[0].token_ids.index(stop)
    assert out.token_ids == free[0].token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason, len(out.logprobs)) == ("stop", stop, first + 1)


def test_stop_string_ends_the_sequence_at_the_token_that_completes_it():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=1)
    backend = StaticDecodeBackend.from_policy(policy)
    free = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
    k = next(i for i in range(2, 10) if len(policy.tokenizer.decode(free.token_ids[:i])) >= 2)
    stop = policy.tokenizer.decode(free.token_ids[:k])[-2:]
    out = backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True,
                                                stop_strings=(stop,)))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert stop in policy.tokenizer.decode(out.token_ids)
    assert stop not in policy.tokenizer.decode(out.token_ids[:-1])
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_eos_stops_every_row_and_the_loop_ends_early():
    policy = fresh_policy("tiny-llava")
    eos = policy.tokenizer.eos_token_id
    with torch.no_grad():
        policy.model.lm_head.weight[eos] += 5 * policy.model.lm_head.weight.abs().max()
    backend = StaticDecodeBackend(policy.model, policy.tokenizer, policy.adapter, sync_every=4)
    outs = backend.generate(requests(policy, n=2), SamplingParams(temperature=0, max_new_tokens=40))
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    longest = max(len(o.token_ids) for o in outs)
    assert backend.last_timing["decode_steps"] <= -(-longest // 4) * 4 + 1 < 40  # checked every 4 steps
    long = backend.generate(requests(policy, n=2), SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 5 for o in long)


def test_group_is_prefilled_once_and_images_encoded_once():
    policy = shared_policy("tiny-llava")
    backend = StaticDecodeBackend.from_policy(policy)
    image = noise(7)
    group = [GenerationRequest(chat_ids(policy, "Q", [image]), [image]) for _ in range(4)]
    backend.generate(group, SamplingParams(max_new_tokens=2))
    assert backend.last_timing["prefill_rows"] == 1
    assert (backend.stats()["encoder_cache_misses"], backend.stats()["encoder_cache_hits"]) == (1, 3)


@pytest.mark.parametrize("part", ["self_attn.k_proj", "mlp.up_proj", "mlp.down_proj"])
def test_update_weights_reaches_the_decoder_through_fused_and_plain_weights(part):
    policy = fresh_policy("tiny-llava")
    backend = StaticDecodeBackend.from_policy(policy)
    reqs = requests(policy, n=2)
    before = backend.generate(reqs, GREEDY)
    name = next(n for n in policy.model.state_dict() if n.endswith(f"language_model.layers.0.{part}.weight"))
    new = torch.randn_like(policy.model.state_dict()[name], generator=torch.Generator().manual_seed(1))
    backend.update_weights({name: new})
    after = backend.generate(reqs, GREEDY)
    reference = HFGenerationBackend.from_policy(policy).generate(reqs, GREEDY)
    moved = max(abs(x - y) for a, b in zip(after, before) for x, y in zip(a.logprobs, b.logprobs))
    assert moved > 1e-3
    for a, b in zip(after, reference):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("fuse_weights", [True, False])
def test_a_replaced_parameter_is_read_from_its_new_place(fuse_weights):
    policy = fresh_policy("tiny-llava")
    backend = StaticDecodeBackend.from_policy(policy, fuse_weights=fuse_weights)
    reqs = requests(policy, n=2)
    before = [o.token_ids for o in backend.generate(reqs, GREEDY)]
    proj = policy.model.model.language_model.layers[0].self_attn.q_proj
    proj.weight = torch.nn.Parameter(torch.randn_like(proj.weight, generator=torch.Generator().manual_seed(2)))
    after = [o.token_ids for o in backend.generate(reqs, GREEDY)]
    assert after != before
    assert after == [o.token_ids for o in HFGenerationBackend.from_policy(policy).generate(reqs, GREEDY)]


def test_decode_mode_selection():
    llava, qwen = shared_policy("tiny-llava"), shared_policy("tiny-qwen2vl")
    assert type(hf_backend(llava)) is HFGenerationBackend  # auto on CPU: the HF loop
    assert type(hf_backend(llava, decode="static")) is StaticDecodeBackend
    assert isinstance(text_model(qwen.model), str)  # 3-D rotary positions
    assert type(hf_backend(qwen, decode="auto")) is HFGenerationBackend
    with pytest.raises(GymvError, match="static decoding does not support"):
        hf_backend(qwen, decode="static")
    with pytest.raises(GymvError, match="generation.decode must be one of"):
        hf_backend(llava, decode="fast")
    eager = HFGenerationBackend.from_policy(llava, seed=3)
    assert with_decode(eager, "auto") is eager and with_decode(eager, "eager") is eager
    static = with_decode(eager, "static", seed=3)
    assert type(static) is StaticDecodeBackend and static.model is eager.model
    assert static.chat_template == eager.chat_template


def test_the_recipes_decode_mode_reaches_the_generation_worker_spec():
    from pathlib import Path

    from gymv.config import load_recipe
    from gymv.train.setup import worker_spec

    recipe = Path(__file__).resolve().parents[1] / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
    assert worker_spec(load_recipe(recipe).validated, "m").generation.decode == "auto"
    cfg = load_recipe(recipe, overrides=["generation.decode=static"]).validated
    assert worker_spec(cfg, "m").generation.decode == "static"
    with pytest.raises(GymvError, match="decode"):
        load_recipe(recipe, overrides=["generation.decode=fast"]).validated


def test_the_recipes_max_batch_caps_the_static_decoders_slots():
    from pathlib import Path

    from gymv.config import load_recipe
    from gymv.train.setup import worker_spec

    recipe = Path(__file__).resolve().parents[1] / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
    assert worker_spec(load_recipe(recipe).validated, "m").generation.max_batch == 256
    spec = worker_spec(load_recipe(recipe, overrides=["generation.max_batch=8"]).validated, "m")
    eager = HFGenerationBackend.from_policy(shared_policy("tiny-llava"))
    assert with_decode(eager, "static", max_batch=spec.generation.max_batch).max_batch == 8
    with pytest.raises(GymvError, match="max_batch"):
        load_recipe(recipe, overrides=["generation.max_batch=0"]).validated


def test_fusing_views_again_keeps_them_in_place():
    layer = torch.nn.ModuleList([torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)])
    params = [m.weight for m in layer]
    values = [p.detach().clone() for p in params]
    fused = _fuse_params(params)
    assert torch.equal(fused, torch.cat(values))
    where = [p.data_ptr() for p in params]
    again = _fuse_params(params)  # a second backend on the same model
    assert again.data_ptr() == fused.data_ptr() and [p.data_ptr() for p in params] == where
    with torch.no_grad():
        params[1].copy_(torch.ones(2, 4))  # a refit writes through the view
    assert torch.equal(again[3:], torch.ones(2, 4))


def _stop_at_varied_lengths(reqs, backend, params):
    """A stop token id that ends the rows of `reqs` after different numbers of tokens."""
    free = backend.generate(reqs, params)
    for tok in {t for o in free for t in o.token_ids}:
        ends = {o.token_ids.index(tok) if tok in o.token_ids else len(o.token_ids) for o in free}
        if len(ends) >= 3:
            return tok
    return free[0].token_ids[2]


@pytest.mark.parametrize("greedy", [True, False])
def test_requests_beyond_the_slots_take_finished_slots_and_get_the_outputs_they_get_together(greedy):
    policy = shared_policy("tiny-llava")
    texts = ("How many red circles?", "Click the blue one, please.", "Hi", "Count the squares in the picture.")
    reqs = requests(policy, n=5, texts=texts)  # prompts of different lengths
    together = StaticDecodeBackend.from_policy(policy)
    params = SamplingParams(temperature=0 if greedy else 1.0, max_new_tokens=10, ignore_eos=True,
                            seed=None if greedy else 4)
    params = replace(params, stop_token_ids=(_stop_at_varied_lengths(reqs, together, params),))
    want = together.generate(reqs, params)
    slotted = StaticDecodeBackend.from_policy(policy, max_batch=2, sync_every=1)
    got = slotted.generate(reqs, params)
    assert slotted.last_timing["batch_bucket"] == 2 and slotted.last_timing["refills"] == 3
    assert len({len(o.token_ids) for o in want}) > 1  # rows finish at different times
    for a, b in zip(got, want):
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_seeded_request_draws_the_same_tokens_in_any_slot():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=11)
    one_slot = StaticDecodeBackend.from_policy(policy, max_batch=1, sync_every=3).generate(reqs, params)
    three = StaticDecodeBackend.from_policy(policy, max_batch=3, sync_every=2).generate(reqs, params)
    assert [o.token_ids for o in one_slot] == [o.token_ids for o in three]


def test_a_stop_string_ends_its_row_inside_the_loop_and_the_result_is_unchanged():
    policy = shared_policy("tiny-llava")
    reqs = requests(policy, n=1)
    free = StaticDecodeBackend.from_policy(policy).generate(
        reqs, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))[0]
    k = next(i for i in range(2, 10) if len(policy.tokenizer.decode(free.token_ids[:i])) >= 2)
    stop = policy.tokenizer.decode(free.token_ids[:k])[-2:]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, stop_strings=(stop,))
    backend = StaticDecodeBackend.from_policy(policy, sync_every=4)
    out = backend.generate(reqs, params)[0]
    old = HFGenerationBackend.from_policy(policy).generate(reqs, params)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (old.token_ids, old.finish_reason, old.stop_reason)
    assert backend.last_timing["decode_steps"] <= -(-len(out.token_ids) // 4) * 4 < 40  # not run to the end


def test_a_longer_kept_state_serves_a_shorter_call_with_its_graphs():
    policy = shared_policy("tiny-llava")
    backend = StaticDecodeBackend.from_policy(policy)
    reqs = requests(policy, n=2)
    backend.generate(reqs, SamplingParams(temperature=0, max_new_tokens=70, ignore_eos=True))
    backend.generate(reqs[:1] * 2, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert len(backend._states) == 1
    backend.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True))  # another mode
    assert len(backend._states) == 2


def test_a_compiled_decoder_lifts_dynamos_recompile_limit_above_its_graph_count():
    import torch._dynamo.config as dynamo

    old = dynamo.recompile_limit
    try:
        dynamo.recompile_limit = 8  # torch's default: past it a function would silently run eagerly
        StaticDecodeBackend.from_policy(shared_policy("tiny-llava"), compile=True)
        assert dynamo.recompile_limit >= len(StaticDecodeBackend.BATCH_BUCKETS) * 3
    finally:
        dynamo.recompile_limit = old


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["split", "sdpa"])
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoding_equals_the_hf_loop_compiled_or_not(compile, attention):
    from gymv.backends.policy import load_policy
    from tests.tiny_models import tiny_path

    policy = load_policy(tiny_path("tiny-llava"), device="cuda")
    reqs = requests(policy, n=3)
    params = SamplingParams(temperature=0, max_new_tokens=34, ignore_eos=True, stop_token_ids=(5,))
    try:
        graphs = StaticDecodeBackend.from_policy(policy, cuda_graphs=True, compile=compile, attention=attention)
    except GymvError as e:
        pytest.skip(f"no split kernel here: {e.message}")
    new = graphs.generate(reqs, params)
    old = HFGenerationBackend.from_policy(policy).generate(reqs, params)
    assert graphs.last_timing["capture_s"] > 0  # the step was captured, not run eagerly
    for a, b in zip(new, old):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
