"""Training the tiny Nemotron 3 Omni on the torch and fsdp2 backends: its MoE routers' load-balancing terms
(logged every step, `training.moe`), activation checkpointing, and one fsdp2 rank stepping like the torch
backend, packed rows stepping like padded ones."""

from __future__ import annotations

import pytest
import torch

from test_sequence_packing import _group, _samples
from tiny_models import fresh_policy, solid, tiny_path
from train_helpers import no_shared_ray

ARCH = "tiny-nemotron-omni"


def _backend(cls=None, *, moe=None, checkpointing=False, lr=1e-2, packing="auto", vision_checkpointing=True):
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import MoeSection, TrainingSection

    training = TrainingSection(lr=lr, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=4096,
                               gradient_checkpointing=checkpointing, moe=MoeSection(**(moe or {})),
                               sequence_packing=packing, vision_checkpointing=vision_checkpointing)
    setup = TrainingSetup(model_path=str(tiny_path(ARCH)), training=training)
    return (cls or HFTorchBackend)(fresh_policy(ARCH), setup, device="cpu")


def _samples_with(policy, advantages, *, shared_prompt=True):
    """A GRPO group (one prompt), or as many distinct prompts (where a step routes every token of every
    sample: a shared prompt runs, and is routed, once)."""
    samples = (_group(policy, len(advantages), seed=5) if shared_prompt
               else _samples(policy, [[solid(c)] for c in ("red", "blue", "green")][:len(advantages)], seed=5))
    for s, a in zip(samples, advantages):
        s["advantages"] = torch.tensor(float(a))
    return samples


def _routers(backend):
    return backend.router_terms.routers


def test_padding_is_not_routed_in_the_balancing_terms():
    from gymv.backends.logprobs import right_pad, token_scores
    from gymv.backends.moe_router import RouterTerms
    from gymv.sections import MoeSection

    policy = fresh_policy(ARCH)
    terms = RouterTerms.attach(policy.model, MoeSection())
    fn = terms.wrap_logprob(lambda model, batch: token_scores(model, policy.adapter, batch))
    short = _samples(policy, [[solid("red")]], seed=1)[0]["input_ids"].tolist()
    long = _samples(policy, [[solid("blue")]], seed=2)[0]["input_ids"].tolist() + [40] * 30
    images = [[solid("red")], [solid("blue")]]
    with torch.no_grad():
        fn(policy.model, right_pad([short, long], images, 0))
        together = [(i, layer.slots.clone(), layer.tokens) for i, layer in terms._take_layers()]
        apart = []
        for ids, ims in zip((short, long), images):
            fn(policy.model, right_pad([ids], [ims], 0))
            apart.append({i: (layer.slots, layer.tokens) for i, layer in terms._take_layers()})
    for i, slots, tokens in together:
        assert tokens == len(short) + len(long)
        assert torch.equal(slots, apart[0][i][0] + apart[1][i][0])


@pytest.mark.slow
def test_aux_loss_coef_trains_the_routers_through_the_balancing_term_alone():
    from gymv.algorithms.loss_fns import PolicyLoss

    moved = []
    for coef in (0.0, 1.0):
        backend = _backend(moe={"aux_loss_coef": coef})
        before = [r.weight.detach().clone() for r in _routers(backend)]
        backend.train_step(_samples_with(backend.policy, [0, 0, 0]), PolicyLoss())  # no policy gradient at all
        moved.append(any(not torch.equal(b, r.weight) for b, r in zip(before, _routers(backend))))
    assert moved == [False, True]


def test_a_step_logs_the_balancing_terms_and_the_bias_update_moves_each_expert_towards_the_mean_load():
    from gymv.algorithms.loss_fns import PolicyLoss

    backend = _backend(moe={"router_bias_update_rate": 0.01})
    loads = []
    terms = backend.router_terms
    take = terms._take_layers

    def spy():  # the loads the step saw, per MoE layer
        layers = take()
        loads.extend(layer.slots.clone() for _, layer in layers)
        return layers

    terms._take_layers = spy
    metrics = backend.train_step(_samples_with(backend.policy, [1, -1, 0.5]), PolicyLoss())
    assert len(loads) == len(_routers(backend)) == 2  # the two MoE layers of ME*E
    for load, router in zip(loads, _routers(backend)):
        want = 0.01 * torch.sign(load.mean() - load)
        assert torch.equal(router.e_score_correction_bias, want)
    assert metrics["train/moe_bias_absmax"] == pytest.approx(0.01)
    assert 1.0 <= metrics["train/moe_aux_loss"] < 4.0  # 1.0 balanced, 4 (the expert count) all on one expert
    assert 1.0 <= metrics["train/moe_load_max"] <= 4.0


def test_the_balancing_loss_reads_nothing_back_from_the_device():
    """A read (`.item()`, `float()` of a tensor) between a micro-batch's forward and backward would make the
    host wait for the forward on a GPU before it queues the backward."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from gymv.algorithms.loss_fns import PolicyLoss

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_local_scalar_dense"):  # the innermost caller outside torch
                caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
                reads.append((caller.filename.rsplit("/", 1)[-1], caller.name))
            return func(*args, **(kwargs or {}))

    backend = _backend(moe={"aux_loss_coef": 0.01, "router_bias_update_rate": 0.01})
    samples = _samples_with(backend.policy, [1, -1, 0.5])
    with Reads():
        metrics = backend.train_step(samples, PolicyLoss())
    assert metrics["train/moe_aux_loss"] > 0
    assert reads and ("moe_router.py", "wrapped") not in reads, reads


@pytest.mark.slow
def test_activation_checkpointing_steps_like_the_plain_backward_with_the_balancing_loss_on():
    from gymv.algorithms.loss_fns import PolicyLoss

    runs = []
    for checkpointing, vision in ((False, True), (True, True), (True, False)):
        backend = _backend(moe={"aux_loss_coef": 0.1}, checkpointing=checkpointing, vision_checkpointing=vision)
        samples = _samples_with(backend.policy, [1, -1, 0.5], shared_prompt=False)
        metrics = backend.train_step(samples, PolicyLoss())
        runs.append((metrics, dict(backend.named_weights())))
    (m0, w0), *checkpointed = runs
    for m1, w1 in checkpointed:
        assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-6)
        assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-5)
        for k in w0:
            torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend_name", ["torch", "fsdp2"])
def test_vision_checkpointing_off_recomputes_the_decoder_layers_alone(backend_name):
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.replicated_precision import is_vision

    backend = _backend(HFFSDPBackend if backend_name == "fsdp2" else None, checkpointing=True,
                       vision_checkpointing=False)
    from transformers.modeling_layers import GradientCheckpointingLayer

    flags = {name: m.gradient_checkpointing for name, m in backend.policy.model.named_modules()
             if isinstance(m, GradientCheckpointingLayer)}
    vision = [on for name, on in flags.items() if is_vision(name)]
    decoder = [on for name, on in flags.items() if not is_vision(name)]
    assert vision and not any(vision)
    assert decoder and all(decoder)


@pytest.mark.slow
def test_one_fsdp2_rank_steps_like_the_torch_backend():
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.hf_fsdp import HFFSDPBackend

    runs = []
    for cls in (None, HFFSDPBackend):
        backend = _backend(cls, moe={"aux_loss_coef": 0.1, "router_bias_update_rate": 0.01})
        samples = _samples_with(backend.policy, [1, -1, 0.5], shared_prompt=False)  # fsdp2 runs no shared prompt
        metrics = backend.train_step(samples, PolicyLoss())
        runs.append((metrics, {k: v.clone() for k, v in backend.named_weights()}))
    (m0, w0), (m1, w1) = runs
    for key in ("train/loss", "train/moe_aux_loss", "train/moe_load_max"):
        assert m1[key] == pytest.approx(m0[key], abs=1e-6)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_packed_micro_batches_step_like_padded_ones():
    """Two GRPO groups, each sharing its prompt: packed, each group's prompt runs once in the row and its
    members' Mamba-2 layers continue the prompt's state; the step equals the padded one."""
    from gymv.algorithms.loss_fns import PolicyLoss

    runs = []
    for packing in (False, True):
        backend = _backend(packing=packing)
        samples = _samples_with(backend.policy, [1, -1, 0.5]) + _samples_with(backend.policy, [1, 0], shared_prompt=False)
        metrics = backend.train_step(samples, PolicyLoss())
        runs.append((metrics, {k: v.clone() for k, v in backend.named_weights()}))
    (m0, w0), (m1, w1) = runs
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], abs=1e-6)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("key,edit", [
    ("text_config.layers_block_type", lambda t: t.update(layers_block_type=t["layers_block_type"][:-1])),
    ("text_config.num_experts_per_tok", lambda t: t.update(num_experts_per_tok=0)),
])
def test_gymv_train_refuses_a_config_that_does_not_match_its_weights_before_ray_starts(tmp_path, key, edit):
    import json
    import shutil

    import ray

    from gymv.errors import GymvError
    from gymv.train import train

    no_shared_ray()
    folder = tmp_path / "omni"
    shutil.copytree(tiny_path(ARCH), folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["text_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GymvError) as err:
        train("recipes/vlm/vlm_sft-tinyomni-1n0g-torch.yaml", [f"model.path={folder}",
                                                              f"checkpoint.dir={tmp_path / 'runs'}"])
    assert f"`{key}`" in err.value.message and err.value.where == str(folder / "config.json")
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_the_capability_table_no_longer_refuses_the_family_on_megatron():
    from gymv.capabilities import table

    assert "megatron" not in table().get("training.backend [nemotron_h_omni]", {})


def test_a_checkpoint_saves_and_restores_every_weight(tmp_path):
    """The checkpoint stores RADIO's attention as one fused qkv tensor, which transformers splits into views on
    load; the trainer's own checkpoint must still save (each weight gets its own storage at load)."""
    backend = _backend()
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(0.01)
    backend.save(tmp_path / "ckpt")
    again = _backend()
    again.load(tmp_path / "ckpt")
    mine, theirs = dict(backend.named_weights()), dict(again.named_weights())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
