"""The hybrid model (Nemotron-H) over megatron's tensor x context x expert parallel process groups.

Ranks are laid out as megatron-core's parallel_state lays them out (its default order `tp-cp-ep-dp-pp`):
consecutive ranks form a TP group; CP groups join ranks TP apart; the data-parallel dimension is what is
left (world / (TP * CP)). Expert parallelism folds over the data x context ranks: with expert TP equal to
TP, consecutive groups of TP * EP ranks form an EP group per TP rank, so an EP group's ranks hold different
tokens (of other sequences, or other chunks of the same one) and exchange them by all-to-all
(gymv.backends.training.megatron_ep). Gradients: dense weights are summed over data x context ranks;
expert weights over the ranks that hold the same experts (megatron's expert-data-parallel group, world /
(TP * EP)).
"""

from __future__ import annotations

from typing import Any

import torch

from gymv.backends.training.megatron_cp import ContextParallelCausalLM, build_context_parallel_hybrid
from gymv.backends.training.megatron_ep import AllToAllDispatch
from gymv.backends.training.megatron_hybrid import HybridMoE, build_hybrid
from gymv.backends.training.megatron_hybrid_weights import HybridShape, hf_to_megatron
from gymv.backends.training.megatron_model import MegatronCausalLM, allow_cpu, require_megatron
from gymv.errors import GymvError


def init_model_parallel(tensor: int = 1, context: int = 1, expert: int = 1, device: torch.device | str = "cpu") -> None:
    """megatron's process groups over the default group (already up: one per trainer rank); a CPU model gets
    gymv's stand-ins for megatron's CUDA-only pieces (megatron_model.allow_cpu)."""
    import torch.distributed as dist

    require_megatron()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tensor * context) or world % (tensor * expert):
        raise GymvError(f"tensor ({tensor}) x context ({context}) and tensor x expert ({expert}) parallel sizes "
                        f"must divide the {world} trainer ranks", where="training.parallel",
                        fix="choose sizes whose products divide the number of training ranks")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor, context_parallel_size=context,
                                             expert_model_parallel_size=expert)
    if torch.device(device).type == "cpu":
        allow_cpu()


def groups() -> dict[str, Any]:
    """This rank's TP, CP and EP groups, as HybridModel's factories take them."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
            "ep": ps.get_expert_model_parallel_group()}


def expert_parallel_factories(shape: HybridShape, ep_group) -> dict:
    """HybridModel's MoE factory with the all-to-all token exchange over `ep_group`."""

    def moe(shape_, config, layer_number, *, tp_group=None, ep_group=ep_group):
        return HybridMoE(shape_, config, tp_group=tp_group, ep_group=ep_group,
                         dispatch=AllToAllDispatch(shape.experts, ep_group))

    return {"E": moe}


def build_parallel_hybrid(hf_config: Any, shape: HybridShape, hf_state: dict, *, device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32, padding_idx: int | None = None) -> MegatronCausalLM:
    """This rank's twin of the HF decoder under megatron's current TP x CP x EP groups (init_model_parallel),
    its weights taken from `hf_state` (HF names), with the HF call gymv's logprob functions make."""
    from megatron.core import parallel_state as ps

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    shape.check_parallel(tp, ep)
    g = groups()
    factories = expert_parallel_factories(shape, g["ep"]) if ep > 1 else None
    kw = dict(tensor_parallel=tp, dtype=dtype, device=device, groups={k: v for k, v in g.items() if k != "cp"},
              factories=factories)
    model = (build_context_parallel_hybrid(hf_config, shape, cp_group=g["cp"], **kw) if cp > 1
             else build_hybrid(hf_config, shape, **kw))
    state = hf_to_megatron(hf_state, shape, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                           ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep)
    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
    wrap = ContextParallelCausalLM if cp > 1 else MegatronCausalLM
    return wrap(model, shape, hf_config, padding_idx)
