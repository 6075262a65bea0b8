"""training.parallel.expert on the megatron backend: two gloo ranks of one expert-parallel group train the tiny
Nemotron 3 Omni (RADIO tower, hybrid decoder, its routed experts split over the two ranks) exactly as one rank
of the torch backend does: the same logprobs, loss, gradient norm and weights after a step, padded and packed,
with the ranks holding different numbers of samples and micro-batches. A checkpoint written at EP2 resumes to
the same next step, and an export at EP2 loads in HF and equals the model it came from bit for bit. On four
ranks, TP2 x EP2, CP2 x EP2 and TP2 x CP2 x EP4 (replicas of three samples and of one, a rank handed none)
take the same step with the MoE aux loss in the loss and the routers' bias update on: the same aux loss,
busiest-expert load, router gradients and correction biases too."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from megatron_helpers import keep_router_grads, spawn_ranks  # noqa: E402

PACKING = (False, True)
SPLIT = (slice(0, 3), slice(3, 4))  # rank 0: three samples (three micro-batches), rank 1: one
AUX = 0.5
BIAS_RATE = 0.01  # the routers' bias update, on in the combined layouts


def setup(expert: int, packing: bool, path: str | None = None, aux: float = 0.0, bias_rate: float = 0.0):
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import ParallelSection, TrainingSection
    from gymv.sections import MoeSection
    from tiny_models import tiny_path

    # a budget of one token: every sample is a micro-batch of its own
    section = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=1,
                              sequence_packing=packing, parallel=ParallelSection(expert=expert),
                              moe=MoeSection(aux_loss_coef=aux, router_bias_update_rate=bias_rate))
    return TrainingSetup(model_path=path or str(tiny_path("tiny-nemotron-omni")), training=section)


def _ep_rank(rank, world, port, out, paths):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.errors import GymvError
    from test_megatron_model import _image_samples

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    path = paths["omni"]
    result = {}
    try:
        for packing in PACKING:
            backend = MegatronBackend.create(setup(2, packing, path), device="cpu", rank=rank, world_size=world)
            mine = _image_samples(backend.policy, n=4)[SPLIT[rank]]
            got = {"logp": backend.compute_logprobs(copy.deepcopy(mine))}
            if not packing:
                backend.export_hf(f"{out}/export")
            got["metrics"] = backend.train_step(copy.deepcopy(mine), PolicyLoss())
            got["weights"] = {k: v.clone() for k, v in backend.named_weights()}
            if not packing:
                backend.save(f"{out}/ckpt")
                got["next"] = backend.train_step(copy.deepcopy(mine), PolicyLoss())
                parallel_state.destroy_model_parallel()
                resumed = MegatronBackend.create(setup(2, packing, path), device="cpu", rank=rank, world_size=world)
                resumed.load(f"{out}/ckpt")
                got["resumed"] = resumed.train_step(copy.deepcopy(mine), PolicyLoss())
                got["resumed_steps"] = resumed.trainer.steps
            result[packing] = got
            parallel_state.destroy_model_parallel()
        backend = MegatronBackend.create(setup(2, False, path, aux=AUX), device="cpu", rank=rank, world_size=world)
        mine = _image_samples(backend.policy, n=4)[SPLIT[rank]]
        result["aux"] = backend.train_step(mine, PolicyLoss())
        parallel_state.destroy_model_parallel()
        try:
            MegatronBackend.create(setup(2, False, paths["qwen3"]), device="cpu", rank=rank, world_size=world)
            result["refused"] = None
        except GymvError as e:
            result["refused"] = (str(e), e.where)
        return result
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    from tiny_models import tiny_path

    out = tmp_path_factory.mktemp("ep2_backend")  # the checkpoint and export the ranks write, read by the tests
    paths = {"omni": str(tiny_path("tiny-nemotron-omni")), "qwen3": str(tiny_path("tiny-qwen3"))}  # built once
    ranks = spawn_ranks(_ep_rank, 2, str(out), paths)
    got = {p: [r[p] for r in ranks] for p in PACKING}
    got["out"], got["path"], got["refused"] = out, paths["omni"], ranks[0]["refused"]
    got["aux"] = [r["aux"] for r in ranks]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("packing", PACKING, ids=["padded", "packed"])
def test_two_expert_parallel_ranks_with_uneven_micro_batches_take_the_torch_backends_step(packing, ep2):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_torch import HFTorchBackend
    from test_megatron_model import _image_samples

    plain = HFTorchBackend.create(setup(1, packing), device="cpu")
    samples = _image_samples(plain.policy, n=4)
    want = plain.compute_logprobs(copy.deepcopy(samples))
    for r, got in enumerate(ep2[packing]):
        for g, w in zip(got["logp"], want[SPLIT[r]], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    metrics = plain.train_step(copy.deepcopy(samples), PolicyLoss())
    assert [got["metrics"]["train/num_micro_batches"] for got in ep2[packing]] == [4.0, 4.0]  # 3 + 1, summed
    for got in ep2[packing]:
        assert got["metrics"]["train/grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-4)
        assert got["metrics"]["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-5, abs=1e-7)
    weights = ep2[packing][0]["weights"]
    for name, tensor in plain.named_weights():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_checkpoint_written_at_ep2_resumes_to_the_same_next_step(ep2):
    for got in ep2[False]:
        assert got["resumed_steps"] == 2
        for key in ("train/loss", "train/grad_norm"):
            assert got["resumed"][key] == pytest.approx(got["next"][key], rel=1e-6, abs=1e-9)
    assert sorted(p.name for p in (ep2["out"] / "ckpt").glob("optimizer*")) == ["optimizer_tp0_ep0.pt",
                                                                              "optimizer_tp0_ep1.pt"]


@pytest.mark.slow
def test_an_export_at_ep2_loads_in_hf_and_equals_the_model_bit_for_bit(ep2):
    from safetensors.torch import load_file

    from gymv.backends.policy import load_policy

    exported = load_policy(str(ep2["out"] / "export"), device="cpu", dtype=torch.float32)
    original = load_policy(ep2["path"], device="cpu", dtype=torch.float32)
    want = original.model.state_dict()
    written = load_file(str(ep2["out"] / "export" / "model.safetensors"))
    assert any(".experts." in k for k in written)
    for name, tensor in exported.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.slow
def test_expert_parallelism_is_refused_for_a_gptmodel_decoder_naming_the_key(ep2):
    message, where = ep2["refused"]
    assert "expert parallelism" in message and where == "training.parallel.expert"


@pytest.mark.slow
def test_the_router_aux_loss_at_ep2_is_the_torch_backends_when_each_sample_is_a_micro_batch(ep2):
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_torch import HFTorchBackend
    from test_megatron_model import _image_samples

    plain = HFTorchBackend.create(setup(1, False, aux=AUX), device="cpu")
    metrics = plain.train_step(_image_samples(plain.policy, n=4), PolicyLoss())
    for got in ep2["aux"]:
        for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss"):
            assert got[key] == pytest.approx(metrics[key], rel=1e-4), key


SPLIT4 = (slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 4))  # replicas of 3 and 1 samples; rank 3 gets none
# experts whole (expert TP 1): TP2 x EP2 folds each EP group onto a TP group; TP2 x CP2 x EP4 is the reference
# layouts' shape (one EP group over the TP and CP ranks of a replica)
LAYOUTS = {"tp2xep2": {"tensor": 2, "expert": 2}, "cp2xep2": {"context": 2, "expert": 2},
           "tp2xcp2xep4": {"tensor": 2, "context": 2, "expert": 4}}


def _combined_rank(rank, world, port, path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.config.schema import ParallelSection
    from test_megatron_model import _image_samples

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        for name, sizes in LAYOUTS.items():
            base = setup(2, False, path, aux=AUX, bias_rate=BIAS_RATE)
            training = base.training.model_copy(update={"parallel": ParallelSection(**sizes)})
            backend = MegatronBackend.create(TrainingSetup(model_path=path, training=training), device="cpu",
                                             rank=rank, world_size=world)
            mine = _image_samples(backend.policy, n=4)[SPLIT4[rank]]
            router_grads = keep_router_grads(backend)
            metrics = backend.train_step(copy.deepcopy(mine), PolicyLoss())
            weights = {k: v.clone() for k, v in backend.named_weights()}
            result[name] = {"metrics": metrics, "weights": weights if rank == 0 else None,
                            "router_grads": router_grads}
            parallel_state.destroy_model_parallel()
        return result
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def combined():
    from tiny_models import tiny_path

    ranks = spawn_ranks(_combined_rank, 4, str(tiny_path("tiny-nemotron-omni")))
    return {n: [r[n] for r in ranks] for n in LAYOUTS}


@pytest.fixture(scope="module")
def one_rank_step():
    """The torch backend's step over the four samples, each a micro-batch: its metrics, router gradients and
    weights after it."""
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_torch import HFTorchBackend
    from test_megatron_model import _image_samples

    plain = HFTorchBackend.create(setup(1, False, aux=AUX, bias_rate=BIAS_RATE), device="cpu")
    router_grads = keep_router_grads(plain)
    metrics = plain.train_step(copy.deepcopy(_image_samples(plain.policy, n=4)), PolicyLoss())
    return metrics, router_grads, dict(plain.named_weights())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_context_and_expert_parallelism_combined_take_the_torch_backends_step_with_the_aux_loss(
        layout, combined, one_rank_step):
    metrics, router_grads, want = one_rank_step
    for got in combined[layout]:
        assert got["metrics"]["train/grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-4)
        assert got["metrics"]["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-5, abs=1e-7)
        for key in ("train/moe_aux_loss", "train/moe_load_max", "train/moe_bias_absmax"):
            assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
        for g, w in zip(got["router_grads"], router_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
    weights = combined[layout][0]["weights"]
    for name, tensor in want.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_every_tp_and_ep_shard_pair_is_written_once_even_where_ep_is_below_tp():
    from gymv.backends.training.megatron import first_holder

    # expert TP 1: EP groups are consecutive blocks of EP ranks, so rank r holds TP shard r % TP, experts r % EP
    tp4_ep2 = [(r % 4, r % 2) for r in range(4)]  # no replica of EP ranks covers TP shards 2 and 3: all write
    assert [first_holder(tp4_ep2, r) for r in range(4)] == [True, True, True, True]
    tp2_ep2 = [(r % 2, r % 2) for r in range(4)]  # ranks 2 and 3 repeat 0 and 1
    assert [first_holder(tp2_ep2, r) for r in range(4)] == [True, True, False, False]
