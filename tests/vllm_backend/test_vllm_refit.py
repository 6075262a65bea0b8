"""Refit into a running vLLM engine: after new weights load, its greedy outputs are exactly the HF backend's
outputs under those weights (text and vision weights; prefix and encoder caches reset), by both the in-call
and the shared-memory-file paths; a bad refit changes nothing.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from gymv.backends.generation.base import GenerationRequest, SamplingParams  # noqa: E402
from gymv.backends.generation.hf import HFGenerationBackend  # noqa: E402
from gymv.backends.weights import weights_hash  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from tiny_models import chat_ids, fresh_policy, noise, tiny_path  # noqa: E402
from vllm_helpers import max_logprob_gap, mult_prob_error, vllm_backend  # noqa: E402

pytestmark = pytest.mark.slow
ARCHES = ["tiny-llava", "tiny-qwen2vl"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def requests(policy):
    images = [noise(5, (90, 70)), noise(6, (60, 60))]
    return [GenerationRequest(chat_ids(policy, t, [im]), [im], where=f"row {i}")
            for i, (t, im) in enumerate(zip(["How many?", "Where is it?"], images))]


def perturbed(policy, seed: int) -> dict[str, torch.Tensor]:
    """Every weight moved by noise of its own scale: outputs change, text and vision tower alike."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in policy.model.state_dict().items():
        scale = t.float().std() if t.numel() > 1 else t.float().abs()
        out[name] = (t + 0.5 * scale * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


@pytest.fixture(scope="module", params=ARCHES)
def case(request):
    policy = fresh_policy(request.param)
    backend = vllm_backend(tiny_path(request.param))
    yield request.param, policy, backend
    backend.close()


def test_refit_gives_exactly_the_hf_outputs_of_the_new_weights(case):
    arch, policy, backend = case
    reqs = requests(policy)
    before = backend.generate(reqs, GREEDY)
    hf = HFGenerationBackend.from_policy(policy)
    new = perturbed(policy, 1)
    for b in (hf, backend):
        b.update_weights(new)
        b.reset_encoder_cache()
    after, want = backend.generate(reqs, GREEDY), hf.generate(reqs, GREEDY)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    assert max_logprob_gap(after, want) < 1e-3
    assert mult_prob_error(policy, reqs, after) < 1.05
    assert backend.weights_hash() == weights_hash(new)
    assert backend.stats()["prefix_cache_resets"] >= 1 and backend.stats()["encoder_cache_resets"] >= 1


def test_a_refit_through_a_shared_memory_file_loads_the_same_weights(case):
    arch, policy, backend = case
    reqs = requests(policy)
    new = perturbed(policy, 2)
    backend.weight_transfer = "file"
    try:
        backend.update_weights(new)
    finally:
        backend.weight_transfer = "auto"
    backend.reset_encoder_cache()
    hf = HFGenerationBackend.from_policy(policy)
    hf.update_weights(new)
    assert [o.token_ids for o in backend.generate(reqs, GREEDY)] == [o.token_ids for o in hf.generate(reqs, GREEDY)]


def test_a_vision_only_refit_reaches_images_the_engine_has_seen_before(case):
    """The same images before and after a refit of the vision tower alone, with no reset_encoder_cache()
    call: the backend resets vLLM's encoder cache itself (vLLM's reload drops the features anyway), so the
    outputs are the new encoder's, never features of the old one nor an "Encoder cache miss"."""
    arch, policy, backend = case
    reqs = requests(policy)
    backend.generate(reqs, GREEDY)  # the images' features are now cached
    vision = {k: v for k, v in perturbed(policy, 3).items() if "vision" in k or "visual" in k}
    assert vision
    new = {**policy.model.state_dict(), **vision}  # every weight: only the tower's changed
    hf = HFGenerationBackend.from_policy(policy)
    hf.update_weights(new)
    want = [o.token_ids for o in hf.generate(reqs, GREEDY)]
    backend.update_weights(new)
    assert [o.token_ids for o in backend.generate(reqs, GREEDY)] == want


def test_a_refit_of_some_weights_is_refused_and_loads_nothing(case):
    """vLLM's in-place reload rebuilds a layer from the weights sent and fills the rest with uninitialised
    memory (a Mamba mixer sent A and D without dt_bias decoded garbage), so a refit carries every weight."""
    arch, policy, backend = case
    reqs = requests(policy)
    before = [o.token_ids for o in backend.generate(reqs, GREEDY)]
    weights = perturbed(policy, 4)
    some = dict(list(weights.items())[: len(weights) // 2])
    with pytest.raises(GymvError, match=rf"refit sent {len(some)} of the model's \d+ weights \(missing .*nothing was loaded"):
        backend.update_weights(some)
    assert [o.token_ids for o in backend.generate(reqs, GREEDY)] == before


def test_a_refit_with_an_unknown_name_or_a_wrong_shape_loads_nothing(case):
    arch, policy, backend = case
    reqs = requests(policy)
    before = [o.token_ids for o in backend.generate(reqs, GREEDY)]
    good = {k: torch.zeros_like(v) for k, v in list(policy.model.state_dict().items())[:3]}
    name = next(iter(good))
    with pytest.raises(GymvError, match="does not have"):
        backend.update_weights({**good, "not.a.weight": torch.zeros(2)})
    with pytest.raises(GymvError, match="shape"):
        backend.update_weights({**good, name: torch.zeros(3, 3)})
    assert [o.token_ids for o in backend.generate(reqs, GREEDY)] == before
