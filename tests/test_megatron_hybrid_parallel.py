"""The hybrid model (Nemotron-H) over megatron's TP x CP x EP groups on four gloo ranks
(gymv.backends.training.megatron_parallel): every layout gives each data-parallel replica HF's logprobs for its
own batch, and the gradients, summed as megatron sums them (dense weights over data x context ranks, the
router over TP too, experts over the ranks holding the same experts), equal one rank's over all the batches.
Under EP the experts are whole (expert TP 1): TP2 x EP2 folds the EP group onto the TP group, TP2 x EP4 and
TP2 x CP2 x EP4 spread one expert per rank over TP, data and context ranks."""

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training import megatron_hybrid_weights as W  # noqa: E402
from gymv.backends.training.megatron_parallel import build_parallel_hybrid, init_model_parallel  # noqa: E402
from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from megatron_helpers import batch, packed_token_logprobs, spawn_ranks, token_logprobs  # noqa: E402
from test_megatron_cp import tiny_hybrid  # noqa: E402

LAYOUTS = {"ep2": (1, 1, 2), "ep2_cp2": (1, 2, 2), "tp2_ep2": (2, 1, 2), "tp2_cp2": (2, 2, 1),  # (tp, cp, ep)
           "tp2_ep4": (2, 1, 4), "tp2_cp2_ep4": (2, 2, 4)}
WORLD = 4


def _rank(rank, world, port):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        hf = tiny_hybrid()
        result = {}
        for name, (tp, cp, ep) in LAYOUTS.items():
            init_model_parallel(tp, cp, ep)
            dp = ps.get_data_parallel_rank()
            model = build_parallel_hybrid(hf.config, W.HybridShape.of(hf.config), hf.state_dict())
            ids, mask = batch(seed=1 + dp)
            logp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
            (logp * mask[:, 1:]).sum().backward()
            grads = {k: p.grad.clone() for k, p in model.gpt.named_parameters()}
            model.zero_grad()
            packed = packed_token_logprobs(model, ids, mask)  # one row of 21 tokens: TP does not divide it
            (packed * mask[:, 1:]).sum().backward()
            packed_grads = {k: p.grad.clone() for k, p in model.gpt.named_parameters()}
            model.zero_grad()
            one = model(input_ids=ids[:1, :1], attention_mask=mask[:1, :1]).logits.float().log_softmax(-1)
            one[..., 0].sum().backward()  # one token: a TP rank's share of it is empty, yet it joins every exchange
            result[name] = {"one": one.detach(), "dp": dp, "ep": ps.get_expert_model_parallel_rank(),
                            "tp": ps.get_tensor_model_parallel_rank(), "logp": logp.detach(), "packed": packed.detach(),
                            "grads": grads, "packed_grads": packed_grads}
            ps.destroy_model_parallel()
        return result
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def ranks():
    results = spawn_ranks(_rank, WORLD)
    return {name: [r[name] for r in results] for name in LAYOUTS}


def hf_reference(dp: int):
    hf = tiny_hybrid()
    ids, mask = batch(seed=1 + dp)
    logp = token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, ids)
    (logp * mask[:, 1:]).sum().backward()
    return logp.detach(), {k: p.grad for k, p in hf.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_gives_hfs_logprobs_for_its_replicas_batch_padded_and_packed(layout, ranks):
    for r in ranks[layout]:
        want, _ = hf_reference(r["dp"])
        valid = batch(seed=1 + r["dp"])[1][:, 1:].bool()
        torch.testing.assert_close(r["logp"][valid], want[valid], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["packed"][valid], want[valid], rtol=0, atol=1e-5)


def _add(into: dict, name: str, grad) -> None:
    into[name] = into[name] + grad if name in into else grad


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_single_token_fewer_than_the_tp_ranks_gives_hfs_distribution(layout, ranks):
    hf = tiny_hybrid()
    for r in ranks[layout]:
        ids, mask = batch(seed=1 + r["dp"])
        want = hf(input_ids=ids[:1, :1], attention_mask=mask[:1, :1]).logits.float().log_softmax(-1)
        torch.testing.assert_close(r["one"], want.detach(), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["padded", "packed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_summed_as_megatron_sums_them_equal_hfs_over_every_batch(layout, rows, ranks):
    shape = W.HybridShape.of(tiny_hybrid().config)
    want: dict = {}
    for dp in sorted({r["dp"] for r in ranks[layout]}):
        for k, g in hf_reference(dp)[1].items():
            _add(want, k, g)
    tp, _, ep = LAYOUTS[layout]
    et = W.expert_tensor_size(tp, ep)
    dense: list[dict] = [{} for _ in range(tp)]  # per TP rank: the sum over data x context ranks
    experts: list[list[dict]] = [[{} for _ in range(et)] for _ in range(ep)]  # over the ranks holding them
    for r in ranks[layout]:
        for k, g in r["grads" if rows == "padded" else "packed_grads"].items():
            _add(experts[r["ep"]][r["tp"] % et] if ".experts." in k else dense[r["tp"]], k, g)
    for k in [k for k in dense[0] if k.endswith("router.weight")]:  # each TP rank's covers its share: over TP
        total = sum(d[k] for d in dense)
        for d in dense:
            d[k] = total
    shards = [{**{k: torch.zeros_like(v) for k, v in W.hf_to_megatron(tiny_hybrid().state_dict(), shape, tp_rank=t,
                                                                       tp_size=tp).items()},  # buffers too
               **dense[t]} for t in range(tp)]
    got = dict(W.megatron_to_hf(shards, shape, expert_shards=experts))
    for name, g in want.items():  # float32 sums in another order over rows and ranks: up to ~6e-6 of the largest
        torch.testing.assert_close(got[name], g, rtol=0, atol=2e-5 * g.abs().max().item(), msg=name)


@pytest.mark.parametrize("sizes, key", [({"tensor": 2, "context": 2, "expert": 4}, None),  # folded: 4 ranks
                                        ({"tensor": 2, "context": 1, "expert": 8}, "training.parallel.expert"),
                                        ({"tensor": 4, "context": 2, "expert": 2}, "training.parallel.tensor")])
def test_tp_x_cp_and_ep_must_each_divide_the_ranks_naming_the_key(sizes, key):
    from gymv.backends.training.megatron_parallel import check_divides
    from gymv.errors import GymvError

    if key is None:
        check_divides(WORLD, **sizes)  # TP x EP = 8 ranks would be needed with the experts TP-split
        return
    with pytest.raises(GymvError) as e:
        check_divides(WORLD, **sizes)
    assert e.value.where == key


def _nccl_rank(rank, world, port):
    """TP2 x EP2 on two GPUs (each expert whole, the EP group the TP group): the padded batch's logprobs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # float32 against the CPU
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        init_model_parallel(2, 1, 2, device=device)
        model_parallel_cuda_manual_seed(0)
        hf = tiny_hybrid()
        model = build_parallel_hybrid(hf.config, W.HybridShape.of(hf.config), hf.state_dict(), device=device)
        ids, mask = batch(seed=1 + ps.get_data_parallel_rank())
        logp = token_logprobs(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits, ids.to(device))
        result = {"dp": ps.get_data_parallel_rank(), "logp": logp.detach().cpu()}
        ps.destroy_model_parallel()
        return result
    finally:
        leave_process_group()


@pytest.mark.gpu
def test_tp2_x_ep2_with_whole_experts_over_nccl_gives_hfs_logprobs():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for got in spawn_ranks(_nccl_rank, 2):
        want, _ = hf_reference(got["dp"])
        valid = batch(seed=1 + got["dp"])[1][:, 1:].bool()
        torch.testing.assert_close(got["logp"][valid], want[valid], rtol=0, atol=1e-4)


@pytest.mark.parametrize("recipe, ep_groups", [
    ("vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-megatron-tp2ep8cp2.yaml", 1),  # 8 policy GPUs: one EP group
    ("vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated.yaml", 4),  # 64: four
])
def test_the_reference_layouts_pass_the_trainer_start_with_ep_groups_folded_over_tp_and_cp(recipe, ep_groups):
    from megatron.core.parallel_state import RankGenerator

    from conftest import REPO
    from gymv.backends.training.megatron_parallel import check_divides
    from gymv.config.compat import training_ranks
    from gymv.config.loader import load_recipe

    cfg = load_recipe(REPO / "recipes" / "vlm" / recipe).validated
    ranks, _ = training_ranks(cfg)
    p = cfg.training.parallel
    check_divides(ranks, tensor=p.tensor, context=p.context, expert=p.expert)  # what init_model_parallel checks
    assert ranks % (p.tensor * p.expert)  # experts split over TP (TP x EP ranks an EP group) would not fit
    # megatron's expert grid as init_model_parallel asks for it: expert TP 1, order tp-ep-dp
    grid = RankGenerator(tp=W.expert_tensor_size(p.tensor, p.expert), ep=p.expert, dp=ranks // p.expert, pp=1,
                         cp=1, order="tp-cp-ep-dp-pp")
    groups = grid.get_ranks("ep")
    assert len(groups) == ep_groups and groups[0] == list(range(p.expert))
