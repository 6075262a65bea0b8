"""`training.moe.freeze_router` (NeMo RL's `freeze_moe_router`): the routers' weights stay as loaded on every
training backend while the rest of the model trains and the expert bias still follows its update; refused
beside a balancing loss (whose gradient reaches only those weights) and for a model without a router."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from gymv.errors import GymvError
from gymv.sections import MoeSection
from test_train_nemotron_omni import _backend, _samples_with
from tiny_models import fresh_policy, tiny_path

FROZEN = {"freeze_router": True, "router_bias_update_rate": 0.01}


def _step_changes(backend) -> tuple[dict, dict]:
    """(router parameters, every other parameter): whether one GRPO step changed each."""
    from gymv.algorithms.loss_fns import PolicyLoss

    routers = {id(r.weight) for r in backend.router_terms.routers}
    biases = [r.e_score_correction_bias.clone() for r in backend.router_terms.routers]
    params = dict(backend.trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    backend.train_step(_samples_with(backend.policy, [1, -1, 0.5], shared_prompt=False), PolicyLoss())
    moved = {n: not torch.equal(before[n], p.detach()) for n, p in params.items()}
    router = {n: m for n, m in moved.items() if id(params[n]) in routers}
    assert any(not torch.equal(b, r.e_score_correction_bias) for b, r in zip(biases, backend.router_terms.routers))
    return router, {n: m for n, m in moved.items() if id(params[n]) not in routers}


@pytest.mark.parametrize("backend_name", ["torch", "fsdp2"])
def test_a_step_leaves_the_frozen_routers_as_they_were_and_trains_the_rest(backend_name):
    from gymv.backends.training.hf_fsdp import HFFSDPBackend

    backend = _backend(HFFSDPBackend if backend_name == "fsdp2" else None, moe=FROZEN)
    router, rest = _step_changes(backend)
    assert len(router) == 2 and not any(router.values())  # the two MoE layers of the tiny model
    assert sum(rest.values()) > len(rest) // 2


def test_without_the_knob_the_same_step_moves_the_routers():
    router, _ = _step_changes(_backend(moe={"router_bias_update_rate": 0.01}))
    assert all(router.values())


def test_the_megatron_backend_freezes_its_twins_routers():
    pytest.importorskip("megatron.core")
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.megatron import MegatronBackend
    from gymv.config.schema import TrainingSection

    training = TrainingSection(lr=1e-2, eps=1e-3, weight_decay=0.0, dtype="float32", micro_batch_tokens=4096,
                               moe=MoeSection(**FROZEN))
    backend = MegatronBackend.create(TrainingSetup(model_path=str(tiny_path("tiny-nemotron-omni")), training=training),
                                     device="cpu", rank=0, world_size=1)
    routers = backend.router_terms.routers
    assert routers and not any(r.weight.requires_grad for r in routers)
    before = [r.weight.detach().clone() for r in routers]
    backend.train_step(_samples_with(backend.policy, [1, -1, 0.5], shared_prompt=False), PolicyLoss())
    assert all(torch.equal(b, r.weight) for b, r in zip(before, routers))


def test_a_balancing_loss_beside_frozen_routers_is_refused():
    with pytest.raises(ValidationError, match="aux_loss_coef > 0 with freeze_router"):
        MoeSection(freeze_router=True, aux_loss_coef=0.1)


def test_a_model_without_a_router_refuses_the_knob_naming_it():
    from gymv.backends.moe_router import RouterTerms

    with pytest.raises(GymvError, match="no mixture-of-experts router") as e:
        RouterTerms.attach(fresh_policy("tiny-llava").model, MoeSection(freeze_router=True))
    assert e.value.where == "training.moe.freeze_router"
