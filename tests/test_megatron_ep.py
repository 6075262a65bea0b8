"""Expert parallelism (gymv.backends.training.megatron_ep): Nemotron-H's MoE layer with its routed experts split
over two gloo ranks gives one rank's outputs and gradients (float32), experts without tokens included."""

import pytest
import torch

from gymv.backends.training.megatron_ep import ExpertParallelMoE, expert_rows, route
from gymv.backends.training.process_group import leave_process_group
from megatron_helpers import spawn_ranks

TOKENS = 7  # per rank


def tiny_moe(seed: int = 0, **overrides):
    """HF's NemotronHMoE at toy widths, router and correction bias random (HF initialises them to zero)."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    knobs = dict(hidden_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                 moe_shared_expert_intermediate_size=5, routed_scaling_factor=2.5, norm_topk_prob=True,
                 layers_block_type=["moe"], mlp_hidden_act="relu2")
    knobs.update(overrides)
    torch.manual_seed(seed)
    moe = NemotronHMoE(NemotronHConfig(**knobs)).float()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.3)
    return moe


def tokens(rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return torch.randn(1, TOKENS, 8)


CASES = ("busy", "idle", "idle_rank")
BIAS = {  # the router chooses on the biased score: -100 is an expert never chosen
    "idle": torch.tensor([0.0, 0.1, -0.1, -100.0]),  # expert 3 (rank 1's second) gets no tokens
    "idle_rank": torch.tensor([0.0, 0.1, -100.0, -100.0]),  # rank 1's experts get no tokens at all
}


def set_case(moe, case: str):
    if case in BIAS:
        moe.gate.e_score_correction_bias.copy_(BIAS[case])
    return moe


def _ep_rank(rank, world, port, backend="gloo"):
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        for case in CASES:
            layer = ExpertParallelMoE(set_case(tiny_moe(), case).to(device))
            x = tokens(rank).to(device).requires_grad_(True)
            y = layer(x)
            (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
            result[case] = {"y": y.detach().cpu(), "dx": x.grad.cpu(),
                            "grads": {k: p.grad.cpu() for k, p in layer.named_parameters()}}
        return result
    finally:
        leave_process_group()


def spawn_ep2(backend: str) -> dict:
    ranks = spawn_ranks(_ep_rank, 2, backend)
    return {case: [r[case] for r in ranks] for case in CASES}


@pytest.fixture(scope="module")
def ep2():
    return spawn_ep2("gloo")


def reference(case: str):
    """One rank, HF's own MoE layer, over both ranks' tokens."""
    moe = set_case(tiny_moe(), case)
    x = torch.cat([tokens(0), tokens(1)], dim=1).requires_grad_(True)
    y = moe(x)
    (y * torch.cat([torch.linspace(-1, 1, TOKENS * 8).view(1, TOKENS, 8)] * 2, dim=1)).sum().backward()
    return y.detach(), x.grad, dict(moe.named_parameters())


def test_route_picks_the_experts_and_weights_of_hfs_nemotron_router():
    moe = tiny_moe(n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1)
    x = torch.randn(5, 8)
    _, want_w, want_i = moe.gate(x)
    got_i, got_w = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, top_k=3, n_group=2, topk_group=1,
                         norm_topk_prob=True, scaling=2.5)
    order_got, order_want = got_i.sort(-1), want_i.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=0, atol=0)


def test_one_rank_equals_hfs_moe_layer():
    moe = tiny_moe()
    x = torch.randn(2, 5, 8)
    # float32 sums in another order
    torch.testing.assert_close(ExpertParallelMoE(tiny_moe())(x), moe(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_expert_parallel_gloo_ranks_give_one_ranks_outputs_and_gradients(case, ep2):
    y, dx, params = reference(case)
    ranks = ep2[case]
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks], dim=1), y, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks], dim=1), dx, rtol=1e-6, atol=1e-5)
    for name, p in params.items():
        if name.startswith("experts."):
            for r, got in enumerate(ranks):  # each rank holds its experts' rows, their gradient whole
                torch.testing.assert_close(got["grads"][name], p.grad[expert_rows(4, 2, r)], rtol=1e-6, atol=1e-5,
                                           msg=name)
        else:  # replicated: each rank's share for its own tokens, summed as data parallel sums them
            torch.testing.assert_close(ranks[0]["grads"][name] + ranks[1]["grads"][name], p.grad, rtol=0,
                                       atol=1e-5, msg=name)


@pytest.mark.slow
def test_an_expert_that_receives_no_tokens_gets_a_zero_gradient_not_none(ep2):
    got = ep2["idle"][1]["grads"]["experts.up_proj"]  # rank 1 holds experts 2 and 3; 3 is never chosen
    assert got is not None and torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[0]) > 0
    idle = ep2["idle_rank"][1]["grads"]  # a rank none of whose experts is chosen still joins both exchanges
    assert idle["experts.up_proj"] is not None and torch.count_nonzero(idle["experts.up_proj"]) == 0


@pytest.mark.gpu
def test_the_same_exchange_over_nccl_gives_one_ranks_outputs_and_gradients():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    got = spawn_ep2("nccl")
    for case in CASES:
        y, dx, params = reference(case)
        torch.testing.assert_close(torch.cat([r["y"] for r in got[case]], dim=1), y, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(torch.cat([r["dx"] for r in got[case]], dim=1), dx, rtol=1e-5, atol=1e-4)
        for r in range(2):
            torch.testing.assert_close(got[case][r]["grads"]["experts.down_proj"],
                                       params["experts.down_proj"].grad[expert_rows(4, 2, r)], rtol=1e-5, atol=1e-4)
