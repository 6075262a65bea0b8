"""The hybrid model (Nemotron-H) over megatron's TP x CP x EP groups on four gloo ranks
(gymv.backends.training.megatron_parallel): every layout gives each data-parallel replica HF's logprobs for its
own batch, and at TP 1 the gradients, summed as megatron sums them (dense weights over data x context ranks,
experts over the ranks holding the same experts), equal one rank's over all the batches."""

import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training import megatron_hybrid_weights as W  # noqa: E402
from gymv.backends.training.megatron_parallel import build_parallel_hybrid, init_model_parallel  # noqa: E402
from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from megatron_helpers import batch, packed_token_logprobs, token_logprobs  # noqa: E402
from test_megatron_cp import tiny_hybrid  # noqa: E402

LAYOUTS = {"ep2": (1, 1, 2), "ep2_cp2": (1, 2, 2), "tp2_ep2": (2, 1, 2), "tp2_cp2": (2, 2, 1)}  # (tp, cp, ep)
WORLD = 4


def _rank(rank, world, port, out):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        hf = tiny_hybrid()
        for name, (tp, cp, ep) in LAYOUTS.items():
            init_model_parallel(tp, cp, ep)
            dp = ps.get_data_parallel_rank()
            model = build_parallel_hybrid(hf.config, W.HybridShape.of(hf.config), hf.state_dict())
            ids, mask = batch(seed=1 + dp)
            logp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
            (logp * mask[:, 1:]).sum().backward()
            packed = packed_token_logprobs(model, ids, mask).detach()
            torch.save({"dp": dp, "ep": ps.get_expert_model_parallel_rank(), "logp": logp.detach(), "packed": packed,
                        "grads": {k: p.grad for k, p in model.gpt.named_parameters()}}, f"{out}/{name}{rank}.pt")
            ps.destroy_model_parallel()
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("hybrid_parallel")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(WORLD, port, str(out)), nprocs=WORLD, join=True)
    return {name: [torch.load(out / f"{name}{r}.pt") for r in range(WORLD)] for name in LAYOUTS}


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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2_cp2"])
def test_gradients_summed_as_megatron_sums_them_equal_hfs_over_every_batch(layout, ranks):
    shape = W.HybridShape.of(tiny_hybrid().config)
    want: dict = {}
    for dp in sorted({r["dp"] for r in ranks[layout]}):
        for k, g in hf_reference(dp)[1].items():
            want[k] = want[k] + g if k in want else g
    ep = LAYOUTS[layout][2]
    summed: list[dict] = [{} for _ in range(ep)]  # per EP rank: the sum over the ranks holding its experts
    for r in ranks[layout]:
        for k, g in r["grads"].items():
            mine = summed[r["ep"]]
            mine[k] = mine[k] + g if k in mine else g
    dense = {k: sum(s[k] for s in summed) for k in summed[0] if ".experts." not in k}  # data x context ranks
    names = W.hf_to_megatron(tiny_hybrid().state_dict(), shape)  # buffers too, which have no gradient
    grid = [[{**{k: torch.zeros_like(v) for k, v in names.items() if ".experts." not in k}, **dense,
              **{k: g for k, g in s.items() if ".experts." in k}}] for s in summed]
    got = dict(W.megatron_to_hf(grid[0], shape, expert_shards=grid))
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=5e-6 * g.abs().max().item(), msg=name)
