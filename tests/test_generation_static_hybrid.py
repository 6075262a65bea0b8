"""The static-cache decoder on the tiny Nemotron 3 Omni (its language model: Mamba-2, attention, mixture-of-experts
and MLP layers): the HF loop's tokens and logprobs, per-row Mamba states that a slot resets when it takes a new
request and that move with the rows when a batch shrinks.

The checkpoint is `gymv model init tiny-nemotron-omni` with every layer kind, its decoder weights redrawn at
the scale of a standard initialisation and its SSM decay slowed, so that every layer and the Mamba state
carried from the prompt change the next tokens (at the checkpoint's 0.02 the residual stream is mostly the
token embedding). On CPU the step runs eagerly on the buffers a CUDA graph captures on a GPU (the GPU tests at
the end check the capture).
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from gymv.backends.generation import static_hybrid as hybrid
from gymv.backends.generation.base import GenerationRequest, RequestFeed, SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.generation.static import StaticDecodeBackend, _State, text_model
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.backends.policy import load_policy
from gymv.errors import GymvError
from gymv.models.tiny import init_tiny
from test_generation_hf import requests

PATTERN = "ME*E-M"  # Mamba, MoE, attention, MoE, MLP, Mamba


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return init_tiny("tiny-nemotron-omni", tmp_path_factory.mktemp("omni") / "model", layer_pattern=PATTERN,
                     experts=8, hidden=64, intermediate=128, vision_layers=1)


def hybrid_policy(path, device: str = "cpu", dtype=torch.float32):
    """The checkpoint with every layer mattering (module docstring)."""
    policy = load_policy(path, device=device, dtype=dtype)
    lm = hybrid.decoder(policy.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.layers.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith("e_score_correction_bias"):  # a router whose correction bias matters
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for layer in lm.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.dt_bias.fill_(0.5)
                layer.mixer.A_log.fill_(-3.0)
    return policy


@pytest.fixture(scope="module")
def policy(checkpoint):
    return hybrid_policy(checkpoint)


TEXTS = ("How many red circles?", "Click the blue one, please.", "Hi", "Count the squares in the picture.",
         "What is it?", "Name the shape at the top left corner")


def prompts(policy, n: int) -> list[GenerationRequest]:
    """Prompts with an image and texts of different lengths (the batch is left-padded: Mamba layers see pads)."""
    return requests(policy, n=n, texts=TEXTS)


def stops(policy) -> tuple[int, ...]:
    """A third of the vocabulary: greedy rows end after different numbers of tokens."""
    return tuple(i for i in range(len(policy.tokenizer)) if i % 3 == 0)


def same_outputs(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_layer_pattern_is_read_from_the_model(policy):
    tm = text_model(policy.model)
    assert tm.kinds == ("mamba", "moe", "attention", "moe", "mlp", "mamba")
    assert (tm.mamba.conv_dim, tm.moe.experts, tm.moe.top_k, tm.rotary) == (64 + 2 * 2 * 16, 8, 2, None)


def test_every_layer_of_a_kind_hands_the_step_one_activation_object(policy):
    backend = StaticDecodeBackend.from_policy(policy)
    backend._fuse()
    acts = {}
    for kind, _, act in backend._fused:
        acts.setdefault(kind, set()).add(id(act))
    assert all(len(ids) == 1 for ids in acts.values())  # a compiled step guards on it: one compile, not one a layer


def test_the_router_picks_the_experts_and_weights_transformers_picks_with_grouped_top_k():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    cfg = NemotronHConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, norm_topk_prob=True)
    router = NemotronHTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.1)
    h = torch.randn(64, 32)
    _, want_w, want_ids = router(h)
    shape = hybrid.MoeShape(experts=16, top_k=3, n_group=4, topk_group=2, norm_topk=True, scale=2.5)
    ids, w = hybrid.route(h, router.weight, router.e_score_correction_bias, shape)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(w.gather(1, order), want_w.gather(1, want_order))
    assert max(len(set(row)) for row in (ids // 4).tolist()) == 2  # experts of topk_group groups per row


@pytest.mark.slow  # every window, both experts kernels, against the HF loop: about 7 s
def test_greedy_tokens_and_logprobs_equal_the_hf_loop_across_attention_windows_with_either_experts_kernel(policy):
    reqs = prompts(policy, 3)
    params = SamplingParams(temperature=0, max_new_tokens=34, ignore_eos=True)  # crosses a 32-column window
    want = HFGenerationBackend.from_policy(policy).generate(reqs, params)
    for moe in ("dense", "grouped"):
        same_outputs(StaticDecodeBackend.from_policy(policy, moe=moe).generate(reqs, params), want)


def test_sampled_logprobs_equal_the_models_own_logprobs_of_the_drawn_tokens(policy):
    reqs = prompts(policy, 4)
    outs = StaticDecodeBackend.from_policy(policy).generate(
        reqs, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3))
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [r.images for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch, temperature=0.7)
    for b, (r, o) in enumerate(zip(reqs, outs)):
        n = len(r.prompt_token_ids)
        assert train[b, n:n + len(o.token_ids)].tolist() == pytest.approx(o.logprobs, abs=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_slot_that_takes_a_new_request_starts_from_that_requests_own_mamba_state(policy, greedy):
    reqs = prompts(policy, 7)
    params = SamplingParams(temperature=0 if greedy else 1.0, max_new_tokens=10, stop_token_ids=stops(policy),
                            seed=None if greedy else 4)
    want = StaticDecodeBackend.from_policy(policy).generate(reqs, params)
    slotted = StaticDecodeBackend.from_policy(policy, max_batch=2, sync_every=1)
    got = slotted.generate(reqs, params)
    assert slotted.last_timing["refills"] == 5 and len({len(o.token_ids) for o in want}) > 1
    same_outputs(got, want)
    if greedy:  # and the eager loop, whose finished rows leave its batch
        same_outputs(got, HFGenerationBackend.from_policy(policy).generate(reqs, params))


def test_a_session_that_shrinks_its_batch_moves_the_mamba_states_with_the_rows(policy):
    reqs = prompts(policy, 4)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=stops(policy))
    want = StaticDecodeBackend.from_policy(policy).generate(reqs, params)
    backend = StaticDecodeBackend.from_policy(policy, sync_every=1)
    feed, got = RequestFeed(enumerate(reqs)), {}

    def on_output(key, out):
        got[key] = out
        feed.open_keys = len(reqs) - len(got)  # the finished episodes will not come back
        if len(got) == len(reqs):
            feed.close()

    backend.serve(feed, params, on_output, max_seq_len=256)
    assert backend.last_timing["repacks"] >= 1
    same_outputs([got[i] for i in range(len(reqs))], want)


def test_a_refit_reaches_every_layer_kind(checkpoint):
    policy = hybrid_policy(checkpoint)  # its own copy: the refit changes it
    backend = StaticDecodeBackend.from_policy(policy)
    reqs = prompts(policy, 2)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = backend.generate(reqs, params)
    own = policy.model.state_dict()
    parts = ("layers.0.mixer.in_proj.weight", "layers.1.mixer.experts.up_proj", "layers.2.mixer.k_proj.weight",
             "layers.3.mixer.gate.e_score_correction_bias", "layers.4.mixer.up_proj.weight")
    g = torch.Generator().manual_seed(1)
    new = {name: torch.randn(own[name].shape, generator=g) * own[name].std().clamp(min=0.05)
           for name in own if name.endswith(parts)}
    assert len(new) == len(parts)  # Mamba, experts, attention, router, MLP
    backend.update_weights(new)
    after = backend.generate(reqs, params)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before))
    same_outputs(after, HFGenerationBackend.from_policy(policy).generate(reqs, params))


def test_layer_kinds_left_out_of_the_graphs_decode_the_same(policy):
    reqs = prompts(policy, 3)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    whole = StaticDecodeBackend.from_policy(policy).generate(reqs, params)
    backend = StaticDecodeBackend.from_policy(policy, eager_layers=("moe",))
    assert [captured for *_, captured in backend._runs()] == [True, False, True, False, True]  # M E * E - M
    same_outputs(backend.generate(reqs, params), whole)
    assert backend.last_timing["eager_layers"] == ["moe"]
    with pytest.raises(GymvError, match="decoder"):
        StaticDecodeBackend.from_policy(policy, eager_layers=("decoder",))


def test_a_kind_whose_capture_fails_runs_eagerly_and_the_rest_stays_captured(policy):
    class MoeFailsCapture(StaticDecodeBackend):
        """A capture that fails wherever an MoE layer is in a captured run (CUDA graphs do not run here)."""

        def _capture(self, st, greedy, nucleus, window):
            moe = [i for i, kind in enumerate(self.tm.kinds) if kind == "moe"]
            if any(lo <= i + 1 < hi for lo, hi, captured in self._runs() if captured for i in moe):
                raise RuntimeError("operation not permitted when stream is capturing")
            st.graphs[window] = "captured"

    backend = MoeFailsCapture.from_policy(policy, compile=False)
    backend._fuse()
    st, _ = backend._state(2, 64, 64, len(policy.tokenizer), True, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend._capture_or_uncompile(st, True, False, 32)
    assert backend.eager_layers == {"moe"} and st.graphs == {32: "captured"}
    assert "moe layers cannot be captured" in str(caught[-1].message)


def test_the_cache_size_estimate_counts_every_buffer_of_a_row(policy):
    tm = text_model(policy.model)
    one, two = (_State(tm, B, 64, 8, 16, torch.float32, torch.device("cpu")) for B in (1, 2))

    def cache_bytes(st):
        return sum(t.numel() * t.element_size() for t in (*st.k, *st.v, *st.conv, *st.ssm) if t is not None)

    assert tm.row_bytes(64, 4) == cache_bytes(two) - cache_bytes(one) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [(), ("moe",)])
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decoding_of_a_hybrid_in_float32_equals_the_hf_loop(checkpoint, compile, eager):
    policy = hybrid_policy(checkpoint, "cuda")
    reqs = prompts(policy, 3)
    params = SamplingParams(temperature=0, max_new_tokens=34, ignore_eos=True)
    graphs = StaticDecodeBackend.from_policy(policy, cuda_graphs=True, compile=compile, eager_layers=eager)
    new = graphs.generate(reqs, params)
    assert graphs.last_timing["capture_s"] > 0 and graphs.last_timing["eager_layers"] == list(eager)
    for a, b in zip(new, HFGenerationBackend.from_policy(policy).generate(reqs, params)):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [(), ("mamba",)])
def test_grouped_experts_in_bfloat16_replay_exactly_what_they_compute_eagerly(checkpoint, eager):
    policy = hybrid_policy(checkpoint, "cuda", torch.bfloat16)
    reqs = prompts(policy, 3)
    params = SamplingParams(temperature=0.8, max_new_tokens=34, ignore_eos=True, seed=2)
    kw = dict(compile=False, moe="grouped")
    graphs = StaticDecodeBackend.from_policy(policy, cuda_graphs=True, eager_layers=eager, **kw)
    new = graphs.generate(reqs, params)
    assert graphs.last_timing["capture_s"] > 0
    same_outputs(new, StaticDecodeBackend.from_policy(policy, cuda_graphs=False, **kw).generate(reqs, params))


@pytest.mark.slow  # inductor compiles each stage for the CPU: about a minute
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles CPU kernels with a C++ compiler, and none is installed")
def test_compiled_stages_around_the_grouped_experts_decode_as_the_uncompiled_step(policy):
    reqs = prompts(policy, 2)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    compiled = StaticDecodeBackend.from_policy(policy, compile=True, moe="grouped")
    assert compiled._moe.keywords["stages"][0] is not hybrid.moe_in  # the stages, compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stage that fails to compile would fall back with a warning
        got = compiled.generate(reqs, params)
    assert compiled.compile
    same_outputs(got, StaticDecodeBackend.from_policy(policy, compile=False, moe="grouped").generate(reqs, params))


@pytest.mark.gpu
def test_compiled_stages_with_the_kernels_between_them_replay_what_the_eager_step_decodes(checkpoint):
    policy = hybrid_policy(checkpoint, "cuda", torch.bfloat16)
    reqs = prompts(policy, 3)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    graphs = StaticDecodeBackend.from_policy(policy, cuda_graphs=True, compile=True, moe="grouped")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = graphs.generate(reqs, params)
    assert graphs.compile and graphs.last_timing["eager_layers"] == []
    uncompiled = StaticDecodeBackend.from_policy(policy, cuda_graphs=False, compile=False, moe="grouped")
    eager = uncompiled.generate(reqs, params)
    for a, b in zip(new, eager):  # bf16: fused kernels round differently; the first tokens agree
        assert a.token_ids[:8] == b.token_ids[:8]
        assert a.logprobs[:8] == pytest.approx(b.logprobs[:8], abs=5e-2)
