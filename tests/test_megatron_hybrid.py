"""Nemotron-H (the Nemotron 3 Omni decoder) in gymv's Megatron hybrid model: HF weights map onto TP/EP shards
and back bit-exactly, and the model gives the HF model's logprobs and gradients in float32 (TP=1 in process,
TP=2 over two gloo ranks), packed rows those of padded rows, checkpointed layers the same gradients."""

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training import megatron_hybrid_weights as W  # noqa: E402
from gymv.backends.training.megatron_hybrid import build_hybrid  # noqa: E402
from gymv.backends.training.megatron_model import MegatronCausalLM, init_parallel, release_parallel  # noqa: E402
from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from megatron_helpers import batch, packed_token_logprobs, spawn_ranks, token_logprobs  # noqa: E402

VOCAB = 96


def tiny_nemotron_h(seed: int = 0, pattern=("linear_attention", "moe", "full_attention", "mlp")):
    """A seeded NemotronH decoder: Mamba-2 (2 groups, 4 heads, chunks of 8 so a row spans two), MoE (4
    experts, top 2 of 2 expert groups, a shared expert), attention (4 heads, 2 kv heads), relu^2 MLP; every
    weight and the routers' correction bias random (HF starts some at 0 or 1, which would hide a misplaced
    one)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(vocab_size=VOCAB, hidden_size=32, layers_block_type=list(pattern), num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
                          mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                          moe_intermediate_size=24, moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if ("norm" in name or name.endswith(".D")) else 0.0
            p.normal_(mean=centre, std=0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def _release_parallel():
    yield
    release_parallel()


def hybrid_twin(hf_model, *, tp=1, rank=0, device="cpu", dtype=torch.float32):
    shape = W.HybridShape.of(hf_model.config)
    init_parallel(tp, torch.device(device))
    model = build_hybrid(hf_model.config, shape, tensor_parallel=tp, device=device, dtype=dtype)
    model.load_state_dict(W.hf_to_megatron(hf_model.state_dict(), shape, tp_rank=rank, tp_size=tp), strict=True)
    return MegatronCausalLM(model, shape, hf_model.config).eval()


def test_hybrid_model_gives_the_hf_logprobs_in_fp32():
    hf = tiny_nemotron_h()
    ids, mask = batch()
    with torch.no_grad():
        want = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
        got = token_logprobs(hybrid_twin(hf)(input_ids=ids, attention_mask=mask).logits, ids)
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_bf16_hybrid_logprobs_are_as_close_to_hfs_float32_ones_as_hfs_own_bf16_logprobs():
    """In bf16 on CUDA the twin (mamba_ssm's kernels where they import, else the torch scan) and HF's own path
    round differently, so each is held to HF's float32 logprobs: the twin's mean error may not exceed HF's bf16
    mean error by more than half again (a wrong layer is off by far more). The largest error is one token's,
    noisier (on a CPU in bf16: the twin 0.13, HF 0.05), so its bound is looser."""
    hf = tiny_nemotron_h().to("cuda")
    ids, mask = (t.cuda() for t in batch())
    valid = mask[:, 1:].bool()
    with torch.no_grad():
        exact = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)[valid]
        twin = hybrid_twin(hf, device="cuda", dtype=torch.bfloat16)
        got = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits.float(), ids)[valid]
        own = token_logprobs(hf.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float(), ids)[valid]
    twin_err, hf_err = (got - exact).abs(), (own - exact).abs()
    assert twin_err.mean() <= 1.5 * hf_err.mean() + 1e-3, (twin_err.mean().item(), hf_err.mean().item())
    assert twin_err.max() <= 3 * hf_err.max() + 0.05, (twin_err.max().item(), hf_err.max().item())


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (1, 4), (2, 4)])
def test_hf_weights_round_trip_through_tp_and_ep_shards_bit_exactly(tp, ep):
    hf = tiny_nemotron_h().state_dict()
    shape = W.HybridShape.of(tiny_nemotron_h().config)
    grid = [[W.hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep) for t in range(tp)]
            for e in range(ep)]
    experts = [row[: W.expert_tensor_size(tp, ep)] for row in grid]  # under EP each expert is whole on a rank
    back = dict(W.megatron_to_hf(grid[0], shape, expert_shards=experts))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_tp_shards_split_mamba_heads_and_groups_and_ep_shards_hold_a_block_of_whole_experts():
    model = tiny_nemotron_h()
    shape = W.HybridShape.of(model.config)
    shard = W.hf_to_megatron(model.state_dict(), shape, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    hf = model.state_dict()
    assert torch.equal(shard["decoder.layers.0.mixer.A_log"], hf["model.layers.0.mixer.A_log"][2:])
    assert shard["decoder.layers.0.mixer.in_proj.weight"].shape[0] == (2 * 32 + 2 * 2 * 16 + 4) // 2
    # expert TP 1 under EP (megatron's folding): the block of experts whole, not split over TP
    assert torch.equal(shard["decoder.layers.1.mixer.experts.up_proj"], hf["model.layers.1.mixer.experts.up_proj"][2:])
    no_ep = W.hf_to_megatron(model.state_dict(), shape, tp_rank=1, tp_size=2)  # EP 1: each expert split over TP
    assert torch.equal(no_ep["decoder.layers.1.mixer.experts.up_proj"],
                       hf["model.layers.1.mixer.experts.up_proj"][:, 12:])
    assert torch.equal(shard["decoder.layers.1.mixer.router.weight"], hf["model.layers.1.mixer.gate.weight"])


def test_a_parallel_size_that_does_not_divide_the_model_is_a_one_line_error():
    shape = W.HybridShape.of(tiny_nemotron_h().config)
    with pytest.raises(GymvError, match="tensor parallel size 4 does not divide the model.s key/value heads \\(2\\)"):
        shape.check_parallel(4)
    with pytest.raises(GymvError, match="expert parallel size 3"):
        shape.check_parallel(1, 3)


def test_a_packed_row_gives_the_padded_rows_logprobs_no_mamba_state_crossing_sequences():
    twin = hybrid_twin(tiny_nemotron_h())
    ids, mask = batch()
    with torch.no_grad():
        padded = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
        packed = packed_token_logprobs(twin, ids, mask)
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(packed[valid], padded[valid], rtol=0, atol=1e-5)


def test_checkpointed_hybrid_layers_give_the_same_gradients():
    from gymv.backends.training.megatron_model import checkpoint_layers

    hf = tiny_nemotron_h()
    ids, mask = batch()
    grads = []
    for checkpointed in (False, True):
        twin = hybrid_twin(hf).train()
        if checkpointed:
            checkpoint_layers(twin.gpt)
        (token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids) * mask[:, 1:]).sum().backward()
        grads.append({k: p.grad for k, p in twin.gpt.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-6, msg=name)


def _full_grads(model) -> dict:
    """Parameter gradients, and zeros for the state dict's buffers (the routers' correction bias)."""
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return {k: grads.get(k, torch.zeros_like(v)) for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _tp_rank(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        twin = hybrid_twin(tiny_nemotron_h(), tp=world, rank=rank)
        ids, mask = batch()
        logp = token_logprobs(twin(input_ids=ids, attention_mask=mask).logits, ids)
        (logp * mask[:, 1:]).sum().backward()
        grads = _full_grads(twin.gpt)
        twin.zero_grad(set_to_none=True)
        packed = packed_token_logprobs(twin, ids, mask)
        (packed * mask[:, 1:]).sum().backward()
        return {"logp": logp.detach(), "grads": grads, "packed_logp": packed.detach(),
                "packed_grads": _full_grads(twin.gpt)}
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def tp2_ranks():
    return spawn_ranks(_tp_rank, 2)


@pytest.mark.slow
def test_tensor_parallel_two_gloo_ranks_give_the_hf_logprobs_and_gradients(tp2_ranks):
    hf = tiny_nemotron_h()
    ids, mask = batch()
    logp = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
    (logp * mask[:, 1:]).sum().backward()
    valid = mask[:, 1:].bool()
    for r in tp2_ranks:
        torch.testing.assert_close(r["logp"][valid], logp.detach()[valid], rtol=0, atol=1e-5)
    shards = [dict(r["grads"]) for r in tp2_ranks]
    for name in shards[0]:
        if any(part in name for part in W.TP_PARTIAL_GRADIENTS):  # each rank's covers its share of the experts
            shards[0][name] = shards[1][name] = shards[0][name] + shards[1][name]
    grads = dict(W.megatron_to_hf(shards, W.HybridShape.of(hf.config)))
    for name, p in hf.named_parameters():  # float32 rounding, relative to the gradient's scale (up to ~60)
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.slow
def test_tensor_parallel_ranks_give_a_packed_row_the_padded_rows_logprobs_and_gradients(tp2_ranks):
    valid = batch()[1][:, 1:].bool()
    for r in tp2_ranks:
        torch.testing.assert_close(r["packed_logp"][valid], r["logp"][valid], rtol=0, atol=1e-5)
        for name, g in r["grads"].items():
            torch.testing.assert_close(r["packed_grads"][name], g, rtol=1e-4, atol=1e-5, msg=name)


def _omni_backends(**training):
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    section = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=4096, **training)
    setup = TrainingSetup(model_path=str(tiny_path("tiny-nemotron-omni")), training=section)
    return MegatronBackend.create(setup, device="cpu"), HFTorchBackend.create(setup, device="cpu")


@pytest.mark.parametrize("packing,checkpointing", [(False, False), (True, False), (True, True)])
def test_the_omni_trains_its_radio_tower_and_hybrid_decoder_as_the_torch_backend_does(packing, checkpointing):
    """Image samples through the RADIO tower and projector (HF torch modules) into the hybrid decoder, padded
    or packed, with or without activation checkpointing: the logprobs, the step's gradient norm and router
    metrics, and the weights after it are the torch backend's."""
    import copy

    from gymv.algorithms.loss_fns import PolicyLoss
    from test_megatron_model import _image_samples

    megatron, plain = _omni_backends(sequence_packing=packing, gradient_checkpointing=checkpointing)
    samples = _image_samples(plain.policy)
    for got, want in zip(megatron.compute_logprobs(copy.deepcopy(samples)), plain.compute_logprobs(copy.deepcopy(samples))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    m, p = (b.train_step(copy.deepcopy(samples), PolicyLoss()) for b in (megatron, plain))
    assert m["train/grad_norm"] > 0 and m["train/grad_norm"] == pytest.approx(p["train/grad_norm"], rel=1e-4)
    for key in ("train/moe_aux_loss", "train/moe_load_max"):
        assert m[key] == pytest.approx(p[key], rel=1e-5), key
    want, got = dict(plain.named_weights()), dict(megatron.named_weights())
    assert got.keys() == want.keys() and any(k.startswith("vision_model.") for k in got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)


AUX = 0.5  # the MoE aux loss's weight in the TP2 step: its share of the router gradient is then the loss's


def _backend_rank(rank, world, port, model_path):
    """A TP2 training backend rank on the tiny Omni, the MoE aux loss in its loss: the step's metrics, router
    gradients and the gathered HF weights after it."""
    import copy
    import datetime

    import torch.distributed as dist

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.config.schema import ParallelSection, TrainingSection
    from gymv.sections import MoeSection
    from megatron_helpers import keep_router_grads
    from test_megatron_model import _image_samples

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=3))
    try:
        section = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=4096,
                                  parallel=ParallelSection(tensor=world), moe=MoeSection(aux_loss_coef=AUX))
        setup = TrainingSetup(model_path=model_path, training=section)
        backend = MegatronBackend.create(setup, device="cpu", rank=rank, world_size=world)
        samples = _image_samples(backend.policy)
        mine = samples[rank::world]  # each rank is handed its share; the TP group runs them all
        router_grads = keep_router_grads(backend)
        metrics = backend.train_step(copy.deepcopy(mine), PolicyLoss())
        weights = {k: v.clone() for k, v in backend.named_weights()}
        return {"metrics": metrics, "weights": weights if rank == 0 else None, "router_grads": router_grads}
    finally:
        leave_process_group()
        release_parallel()


@pytest.mark.slow
def test_a_tp2_backend_step_on_the_omni_with_the_moe_aux_loss_equals_the_torch_backends():
    """Every TP rank routes every token and the router's gradient is summed over TP: the aux term's gradient
    still counts once."""
    import copy

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.sections import MoeSection
    from megatron_helpers import keep_router_grads
    from tiny_models import tiny_path

    ranks = spawn_ranks(_backend_rank, 2, str(tiny_path("tiny-nemotron-omni")))
    _, plain = _omni_backends(moe=MoeSection(aux_loss_coef=AUX))
    from test_megatron_model import _image_samples

    router_grads = keep_router_grads(plain)
    want = plain.train_step(copy.deepcopy(_image_samples(plain.policy)), PolicyLoss())
    for got in ranks:
        for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_load_max"):
            assert got["metrics"][key] == pytest.approx(want[key], rel=1e-4 if key == "train/grad_norm" else 1e-5), key
        for g, w in zip(got["router_grads"], router_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
    got = ranks[0]
    weights = dict(plain.named_weights())
    assert got["weights"].keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
