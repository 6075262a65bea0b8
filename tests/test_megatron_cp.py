"""Context parallelism for the Megatron hybrid model (gymv.backends.training.megatron_cp): a row split over two
gloo ranks (load-balanced chunks; attention over gathered keys and values, Mamba-2 through the all-to-all to
head shards) gives one rank's logprobs and, summed over the ranks, its gradients, in float32; packed rows keep
their segments apart across ranks."""

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training import megatron_hybrid_weights as W  # noqa: E402
from gymv.backends.training.megatron_cp import (  # noqa: E402
    ContextLayout, ContextParallelCausalLM, build_context_parallel_hybrid)
from gymv.backends.training.megatron_hybrid import build_hybrid  # noqa: E402
from gymv.backends.training.megatron_model import MegatronCausalLM, init_parallel, release_parallel  # noqa: E402
from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from megatron_helpers import batch, packed_token_logprobs, spawn_ranks, token_logprobs  # noqa: E402

VOCAB = 96


def tiny_hybrid(groups: int = 2, seed: int = 0):
    """A seeded NemotronH decoder with every kind of layer (Mamba-2 with `groups` groups of 4 heads, chunks of
    8 so a row spans two; MoE; attention with 2 kv heads; MLP), all weights random."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], head_dim=8,
                          intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16,
                          n_groups=groups, conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                          n_shared_experts=1, n_group=2, topk_group=1, moe_intermediate_size=24,
                          moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if ("norm" in name or name.endswith(".D")) else 0.0, std=0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    return model.eval()


def twin(hf, *, cp_group=None):
    shape = W.HybridShape.of(hf.config)
    if cp_group is None:
        model, wrap = build_hybrid(hf.config, shape), MegatronCausalLM
    else:
        model, wrap = build_context_parallel_hybrid(hf.config, shape, cp_group=cp_group), ContextParallelCausalLM
    model.load_state_dict(W.hf_to_megatron(hf.state_dict(), shape), strict=True)
    return wrap(model, shape, hf.config)


def run(model) -> dict:
    """Logprobs and gradients of a padded batch and of the same rows packed into one row."""
    ids, mask = batch()
    out = {}
    for kind in ("padded", "packed"):
        model.zero_grad(set_to_none=True)
        logp = (token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids) if kind == "padded"
                else packed_token_logprobs(model, ids, mask))
        (logp * mask[:, 1:] * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
        grads = {k: p.grad.detach().clone() for k, p in model.gpt.named_parameters()}
        out[kind] = {"logp": logp.detach(), "grads": grads}
    return out


def _cp_rank(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        init_parallel(1, torch.device("cpu"))
        return {groups: run(twin(tiny_hybrid(groups), cp_group=dist.group.WORLD)) for groups in (2, 1)}
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def cp2():
    ranks = spawn_ranks(_cp_rank, 2)
    return {g: [r[g] for r in ranks] for g in (2, 1)}


@pytest.fixture(scope="module", autouse=True)
def _release_parallel():
    """The in-process tests share one private process group; later test modules find none."""
    yield
    release_parallel()


@pytest.fixture(scope="module")
def cp1():
    init_parallel(1, torch.device("cpu"))
    return {g: run(twin(tiny_hybrid(g))) for g in (2, 1)}


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert ContextLayout(8, 2, 0).positions().tolist() == [0, 1, 6, 7]
    assert ContextLayout(8, 2, 1).positions().tolist() == [2, 3, 4, 5]
    layout = ContextLayout(12, 3, 0)
    every = torch.cat([layout.positions(r) for r in range(3)])
    assert every[layout.natural()].tolist() == list(range(12))
    assert ContextLayout.padded(21, 2) == 24


def test_one_rank_context_parallel_model_equals_the_plain_hybrid_model():
    import torch.distributed as dist

    init_parallel(1, torch.device("cpu"))
    hf = tiny_hybrid()
    ids, mask = batch()
    with torch.no_grad():
        want = twin(hf)(input_ids=ids, attention_mask=mask).logits
        got = twin(hf, cp_group=dist.group.WORLD)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 1], ids=["groups_split", "groups_repeated"])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_two_context_parallel_gloo_ranks_give_one_ranks_logprobs_and_gradients(groups, kind, cp2, cp1):
    want = cp1[groups][kind]
    valid = batch()[1][:, 1:].bool()
    for r in cp2[groups]:
        torch.testing.assert_close(r[kind]["logp"][valid], want["logp"][valid], rtol=0, atol=1e-5)
    for name, g in want["grads"].items():  # each rank's covers its own positions
        got = cp2[groups][0][kind]["grads"][name] + cp2[groups][1][kind]["grads"][name]
        # float32 sums taken in another order: a few ulps of the tensor's largest gradient (up to ~75 here)
        torch.testing.assert_close(got, g, rtol=0, atol=5e-6 * g.abs().max().item(), msg=name)


@pytest.mark.slow
def test_context_parallel_logprobs_are_hfs(cp2):
    hf = tiny_hybrid()
    ids, mask = batch()
    with torch.no_grad():
        want = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(cp2[2][0]["packed"]["logp"][valid], want[valid], rtol=0, atol=1e-5)
