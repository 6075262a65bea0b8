"""training.parallel.context on the megatron backend: two gloo ranks of one context-parallel replica train the
tiny Nemotron 3 Omni (RADIO tower, hybrid decoder) exactly as one rank of the torch backend does: the same
logprobs, gradient norm and weights after a step, padded and packed, with the MoE aux loss in the loss and the
routers' bias update on: the same aux loss and busiest-expert load (each rank routes its own positions, the
figures are the rows'), the same router gradients and correction biases."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from megatron_helpers import keep_router_grads, spawn_ranks  # noqa: E402

PACKING = (False, True)
AUX = 0.5  # the aux term's share of the router gradient is then as large as the loss's
BIAS_RATE = 0.01


def setup(context: int, packing: bool, path: str | None = None):
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import ParallelSection, TrainingSection
    from gymv.sections import MoeSection
    from tiny_models import tiny_path

    section = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=4096,
                              sequence_packing=packing, parallel=ParallelSection(context=context),
                              moe=MoeSection(aux_loss_coef=AUX, router_bias_update_rate=BIAS_RATE))
    return TrainingSetup(model_path=path or str(tiny_path("tiny-nemotron-omni")), training=section)


def _cp_rank(rank, world, port, paths):
    import torch.distributed as dist

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.errors import GymvError
    from test_megatron_model import _image_samples

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        got = {}
        for packing in PACKING:
            backend = MegatronBackend.create(setup(2, packing, paths["omni"]), device="cpu", rank=rank,
                                             world_size=world)
            mine = _image_samples(backend.policy)[rank::2]  # the driver hands each rank its share
            logp = backend.compute_logprobs(copy.deepcopy(mine))
            router_grads = keep_router_grads(backend)
            metrics = backend.train_step(copy.deepcopy(mine), PolicyLoss())
            weights = {k: v.clone() for k, v in backend.named_weights()}
            got[packing] = {"logp": logp, "metrics": metrics, "weights": weights if rank == 0 else None,
                            "router_grads": router_grads}
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        try:
            gpt = setup(2, False, paths["qwen3"])
            MegatronBackend.create(gpt, device="cpu", rank=rank, world_size=world)
            got["refused"] = None
        except GymvError as e:
            got["refused"] = str(e)
        return got
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def cp2():
    from tiny_models import tiny_path

    paths = {"omni": str(tiny_path("tiny-nemotron-omni")), "qwen3": str(tiny_path("tiny-qwen3"))}  # built once
    ranks = spawn_ranks(_cp_rank, 2, paths)
    got = {p: [r[p] for r in ranks] for p in PACKING}
    got["refused"] = ranks[0]["refused"]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("packing", PACKING, ids=["padded", "packed"])
def test_two_context_parallel_ranks_take_the_torch_backends_step(packing, cp2):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_torch import HFTorchBackend
    from test_megatron_model import _image_samples

    plain = HFTorchBackend.create(setup(1, packing), device="cpu")
    samples = _image_samples(plain.policy)
    want = plain.compute_logprobs(copy.deepcopy(samples))
    for r, got in enumerate(cp2[packing]):
        for g, w in zip(got["logp"], want[r::2]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    router_grads = keep_router_grads(plain)
    metrics = plain.train_step(copy.deepcopy(samples), PolicyLoss())
    for got in cp2[packing]:
        assert got["metrics"]["train/grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-4)
        assert got["metrics"]["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-5, abs=1e-7)
        for key in ("train/moe_aux_loss", "train/moe_load_max", "train/moe_bias_absmax"):
            assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
        for g, w in zip(got["router_grads"], router_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
    weights = cp2[packing][0]["weights"]
    for name, tensor in plain.named_weights():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_context_parallelism_is_refused_for_a_gptmodel_decoder_naming_the_key(cp2):
    assert cp2["refused"] is not None and "context parallelism" in cp2["refused"]
