"""Megatron-core's GPTModel loaded through gymv's mapping gives the HF model's logprobs: fp32 on CPU (TP=1 in
process, TP=2 over two gloo ranks, gradients included), bf16 on CUDA."""

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training.process_group import leave_process_group
from gymv.backends.training.megatron_model import MegatronCausalLM, build_gpt, init_parallel, release_parallel  # noqa: E402,E501
from gymv.backends.training.megatron_weights import (  # noqa: E402
    DecoderShape, hf_to_megatron, megatron_to_hf, tp_partial_gradient)
from gymv.config.schema import TrainingSection  # noqa: E402
from megatron_helpers import batch, packed_token_logprobs, spawn_ranks, tiny_hf, token_logprobs  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_parallel():
    """The in-process tests share one private process group; later test modules find none."""
    yield
    release_parallel()


def megatron_twin(hf_model, *, device="cpu", dtype=torch.float32, tp=1, rank=0):
    shape = DecoderShape.of(hf_model.config)
    init_parallel(tp, torch.device(device))
    gpt = build_gpt(hf_model.config, shape, tensor_parallel=tp, dtype=dtype, device=device)
    state = hf_to_megatron(hf_model.state_dict(), shape, tp_rank=rank, tp_size=tp)
    gpt.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
    return MegatronCausalLM(gpt, shape, hf_model.config).eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_megatron_logprobs_equal_the_hf_models_in_fp32(family):
    hf = tiny_hf(family)
    ids, mask = batch()
    with torch.no_grad():
        want = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
        got = token_logprobs(megatron_twin(hf)(input_ids=ids, attention_mask=mask).logits, ids)
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)


def test_input_embeddings_feed_the_decoder_as_token_ids_do():
    twin = megatron_twin(tiny_hf("qwen2"))
    ids, mask = batch()
    with torch.no_grad():
        by_ids = twin(input_ids=ids, attention_mask=mask).logits
        by_embeds = twin(inputs_embeds=twin.get_input_embeddings()(ids), attention_mask=mask).logits
    torch.testing.assert_close(by_embeds, by_ids, rtol=0, atol=1e-6)


FAMILIES = ("qwen2", "qwen3", "llama")


def _tp_rank(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        for family in FAMILIES:
            twin = megatron_twin(tiny_hf(family), tp=world, rank=rank)
            ids, mask = batch()
            logp = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
            (logp * mask[:, 1:]).sum().backward()
            grads = {k: p.grad.detach().clone() for k, p in twin.gpt.named_parameters()}
            twin.zero_grad(set_to_none=True)
            packed = packed_token_logprobs(twin, ids, mask)
            (packed * mask[:, 1:]).sum().backward()
            packed_grads = {k: p.grad.detach().clone() for k, p in twin.gpt.named_parameters()}
            result[family] = {"logp": logp.detach(), "grads": grads, "packed_logp": packed.detach(),
                              "packed_grads": packed_grads}
        return result
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def tp2_ranks():
    """Every family's logprobs and gradient shards from one run of two gloo TP ranks."""
    ranks = spawn_ranks(_tp_rank, 2)
    return {f: [r[f] for r in ranks] for f in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_two_gloo_ranks_give_the_hf_logprobs_and_gradients(family, tp2_ranks):
    ranks = tp2_ranks[family]
    hf = tiny_hf(family)
    ids, mask = batch()
    logp = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
    (logp * mask[:, 1:]).sum().backward()
    valid = mask[:, 1:].bool()
    for r in ranks:
        torch.testing.assert_close(r["logp"][valid], logp.detach()[valid], rtol=0, atol=1e-5)
    shape = DecoderShape.of(hf.config)
    shards = [dict(r["grads"]) for r in ranks]
    for name in shards[0]:
        if tp_partial_gradient(name):  # per-head norms: each rank's gradient covers its own heads only
            shards[0][name] = shards[1][name] = shards[0][name] + shards[1][name]
    grads = dict(megatron_to_hf(shards, shape))
    for name, p in hf.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert len(grads) == len(dict(hf.named_parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_ranks_give_a_packed_row_the_padded_rows_logprobs_and_gradients(family, tp2_ranks):
    """Each TP rank attends over its own heads of the packed row's segments: its shard's gradients are the
    padded batch's."""
    valid = batch()[1][:, 1:].bool()
    for r in tp2_ranks[family]:
        torch.testing.assert_close(r["packed_logp"][valid], r["logp"][valid], rtol=0, atol=1e-5)
        for name, g in r["grads"].items():
            torch.testing.assert_close(r["packed_grads"][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_a_packed_row_gives_the_padded_rows_logprobs_with_each_sequences_positions_from_0():
    twin = megatron_twin(tiny_hf("llama"))
    ids, mask = batch()
    with torch.no_grad():
        padded = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
        packed = packed_token_logprobs(twin, ids, mask)
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(packed[valid], padded[valid], rtol=0, atol=1e-5)


def test_logits_to_keep_runs_the_head_on_those_positions_alone_with_the_same_logits_and_gradients():
    twin = megatron_twin(tiny_hf("qwen2"))
    ids, mask = batch()
    cols = torch.tensor([2, 5, 10])
    full = twin(input_ids=ids, attention_mask=mask).logits
    full[:, cols].square().sum().backward()
    want = {k: p.grad.clone() for k, p in twin.gpt.named_parameters()}
    twin.zero_grad(set_to_none=True)
    kept = twin(input_ids=ids, attention_mask=mask, logits_to_keep=cols).logits
    assert kept.shape == (2, 3, full.shape[-1])
    torch.testing.assert_close(kept, full[:, cols], rtol=0, atol=1e-6)
    kept.square().sum().backward()
    for name, g in want.items():
        torch.testing.assert_close(twin.gpt.get_parameter(name).grad, g, rtol=1e-5, atol=1e-6, msg=name)
    last = twin(input_ids=ids, attention_mask=mask, logits_to_keep=2).logits
    torch.testing.assert_close(last, full[:, -2:].detach(), rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_bf16_megatron_logprobs_match_hf_on_cuda(family):
    hf = tiny_hf(family).to("cuda", torch.bfloat16)
    twin = megatron_twin(hf, device="cuda", dtype=torch.bfloat16)
    ids, mask = (t.cuda() for t in batch())
    with torch.no_grad():
        want = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
        got = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
    valid = mask[:, 1:].bool()
    assert (got[valid] - want[valid]).abs().max().item() < 0.05  # bf16 rounding of two kernels' sums


def test_a_backend_checkpoint_is_an_hf_folder_and_resumes_the_same_training(tmp_path):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.policy import load_policy
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from tiny_lm import make_samples
    from tiny_models import tiny_path

    setup = TrainingSetup(model_path=str(tiny_path("tiny-qwen3")), training=TrainingSection(lr=1e-3, weight_decay=0.01, dtype="float32"))
    first = MegatronBackend.create(setup, device="cpu")
    first.train_step(make_samples(4, seed=1), PolicyLoss())
    first.save(tmp_path / "ckpt")
    saved = load_policy(tmp_path / "ckpt").model.state_dict()
    for name, tensor in first.named_weights():
        assert torch.equal(saved[name], tensor), name

    resumed = MegatronBackend.create(setup, device="cpu")
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps == 1
    for b in (first, resumed):
        b.train_step(make_samples(4, seed=2), PolicyLoss())
    for (name, a), (_, b) in zip(first.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_a_cuda_backend_step_matches_the_torch_backends_in_bf16_autocast():
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend
    from tiny_lm import make_samples
    from tiny_models import tiny_path

    setup = TrainingSetup(model_path=str(tiny_path("tiny-qwen3")), training=TrainingSection(lr=1e-3, weight_decay=0.01, dtype="bfloat16"))
    metrics = [cls.create(setup, device="cuda").train_step(make_samples(4, seed=1), PolicyLoss())
               for cls in (MegatronBackend, HFTorchBackend)]
    assert metrics[0]["train/grad_norm"] > 0
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"], rel=0.05)


def _image_samples(policy, n: int = 3) -> list[dict]:
    from gymv.backends.training.samples import training_sample
    from tiny_models import chat_ids, noise

    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(n):
        images = [noise(i)]
        prompt = chat_ids(policy, "Which color?", images)
        answer = [t for t in torch.randint(0, 200, (8 + i,), generator=g).tolist()
                  if t not in policy.adapter.vision_token_ids][:4 + i]
        samples.append(training_sample(prompt + answer, [0] * len(prompt) + [1] * len(answer), images=images,
                                       advantage=float(i) - 1.0, where=f"sample {i}"))
    return samples


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2_5vl"])  # plain and 3-D rotary positions
def test_a_vlm_trains_its_vision_tower_and_gptmodel_decoder_as_the_torch_backend_does(arch):
    import copy

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend
    from tiny_models import tiny_path

    setup = TrainingSetup(model_path=str(tiny_path(arch)), training=TrainingSection(**BACKEND_OPTIMIZER))
    megatron, plain = MegatronBackend.create(setup, device="cpu"), HFTorchBackend.create(setup, device="cpu")
    samples = _image_samples(plain.policy)
    for got, want in zip(megatron.compute_logprobs(copy.deepcopy(samples)), plain.compute_logprobs(copy.deepcopy(samples))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    m, p = (b.train_step(copy.deepcopy(samples), PolicyLoss()) for b in (megatron, plain))
    assert m["train/grad_norm"] > 0 and m["train/grad_norm"] == pytest.approx(p["train/grad_norm"], rel=1e-5)
    want = dict(plain.named_weights())
    got = dict(megatron.named_weights())
    assert got.keys() == want.keys() and any(".visual." in k or "vision_tower" in k for k in got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_a_vlm_whose_features_feed_several_layers_is_refused_naming_the_backends_that_train_it():
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.errors import GymvError
    from tiny_models import tiny_path

    with pytest.raises(GymvError, match="feature_inputs") as e:
        MegatronBackend.create(TrainingSetup(model_path=str(tiny_path("tiny-qwen3vl")), training=TrainingSection()), device="cpu")
    assert "training.backend: torch or fsdp2" in e.value.fix


def test_checkpointed_layers_give_the_same_gradients():
    from gymv.backends.training.megatron_model import checkpoint_layers

    ids, mask = batch()
    grads = []
    for checkpointed in (False, True):
        twin = megatron_twin(tiny_hf("qwen2"))
        if checkpointed:
            checkpoint_layers(twin.gpt)
        (token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids) * mask[:, 1:]).sum().backward()
        grads.append({k: p.grad for k, p in twin.gpt.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-6, msg=name)


BACKEND_OPTIMIZER = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01, "dtype": "float32"}


def test_a_backend_step_equals_the_torch_backends_and_never_trains_the_padding_row():
    """The samples hold the padding token (id 0) as a real token too: the HF embedding's padding_idx gives
    its row no gradient, and the GPTModel twin follows the same rule."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend
    from tiny_lm import make_samples
    from tiny_models import tiny_path

    setup = TrainingSetup(model_path=str(tiny_path("tiny-qwen3")), training=TrainingSection(**BACKEND_OPTIMIZER))
    backends = [cls.create(setup, device="cpu") for cls in (MegatronBackend, HFTorchBackend)]
    assert any(0 in s["input_ids"].tolist() for s in make_samples(6, seed=1))
    m, p = (b.train_step(make_samples(6, seed=1), PolicyLoss()) for b in backends)
    assert m["train/grad_norm"] == pytest.approx(p["train/grad_norm"], rel=1e-5)
    got, want = (dict(b.named_weights()) for b in backends)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)


def _tp_cuda_rank(rank, world, port):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        for family in FAMILIES:
            hf = tiny_hf(family).to(f"cuda:{rank}", torch.bfloat16)
            twin = megatron_twin(hf, device=f"cuda:{rank}", dtype=torch.bfloat16, tp=world, rank=rank)
            ids, mask = (t.cuda() for t in batch())
            with torch.no_grad():
                got = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
                want = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
            result[family] = (got.cpu(), want.cpu())
        return result
    finally:
        leave_process_group()


@pytest.mark.gpu
def test_tensor_parallel_two_cuda_ranks_match_hf_in_bf16():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    valid = batch()[1][:, 1:].bool()
    for result in spawn_ranks(_tp_cuda_rank, 2):
        for family, (got, want) in result.items():
            assert (got[valid] - want[valid]).abs().max().item() < 0.05, family  # bf16 rounding of two kernels


def test_the_fused_attention_slot_scores_real_positions_as_megatrons_masked_attention_does():
    from gymv.backends.training.megatron_model import build_gpt

    hf = tiny_hf("qwen3")
    shape = DecoderShape.of(hf.config)
    init_parallel(1, torch.device("cpu"))
    ids, mask = batch()
    logp = []
    for attention in ("sdpa", "local"):
        gpt = build_gpt(hf.config, shape, attention=attention)
        gpt.load_state_dict(hf_to_megatron(hf.state_dict(), shape), strict=True)
        with torch.no_grad():
            logp.append(token_logprobs(MegatronCausalLM(gpt, shape)(input_ids=ids, attention_mask=mask).logits, ids))
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(logp[0][valid], logp[1][valid], rtol=0, atol=1e-5)
