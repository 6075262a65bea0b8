"""The hybrid model (Nemotron-H) over megatron's tensor x context x expert parallel process groups.

Ranks are laid out as megatron-core's parallel_state lays them out (its default order `tp-cp-ep-dp-pp`):
consecutive ranks form a TP group; CP groups join ranks TP apart; the data-parallel dimension is what is
left (world / (TP * CP)). Expert parallelism folds over all the ranks with each expert whole (megatron's
expert tensor parallel size 1, as the reference runs set it): megatron's expert grid is ETP x EP x EDP over the
same world, order tp-ep-dp, so with ETP 1 consecutive blocks of EP ranks form an EP group, spanning TP, CP
and data ranks alike (TP2 x EP8 x CP2 on 8 ranks: one EP group of all 8). An EP group's ranks hold different
tokens (a TP rank dispatches its 1/TP share of the replicated hidden states, HybridMoE) and exchange them by
all-to-all (gymv.backends.training.megatron_ep). Gradients: dense weights are summed over data x context
ranks; expert weights over the ranks that hold the same experts (megatron's expert-data-parallel group,
world / EP). At EP 1 there is no expert grid: the experts split over TP like the dense MLPs.
"""

from __future__ import annotations

from typing import Any

import torch

from gymv.backends.training.megatron_cp import ContextParallelCausalLM, build_context_parallel_hybrid
from gymv.backends.training.megatron_ep import AllToAllDispatch
from gymv.backends.training.megatron_hybrid import HybridMoE, build_hybrid
from gymv.backends.training.megatron_hybrid_weights import HybridShape, expert_tensor_size, hf_to_megatron
from gymv.backends.training.megatron_model import MegatronCausalLM, allow_cpu, require_megatron
from gymv.errors import GymvError


def check_divides(world: int, *, tensor: int = 1, context: int = 1, expert: int = 1) -> None:
    """GymvError unless TP x CP and EP (x expert TP 1) each divide the `world` trainer ranks."""
    if world % (tensor * context):
        raise GymvError(f"tensor ({tensor}) x context ({context}) parallel sizes do not divide the {world} trainer "
                        "ranks", where="training.parallel.tensor",
                        fix="choose tensor and context sizes whose product divides the number of training ranks")
    if world % expert:
        raise GymvError(f"expert parallel size {expert} does not divide the {world} trainer ranks",
                        where="training.parallel.expert",
                        fix="choose an expert parallel size that divides the number of training ranks")


def init_model_parallel(tensor: int = 1, context: int = 1, expert: int = 1, device: torch.device | str = "cpu") -> None:
    """megatron's process groups over the default group (already up: one per trainer rank); a CPU model gets
    gymv's stand-ins for megatron's CUDA-only pieces (megatron_model.allow_cpu)."""
    import torch.distributed as dist

    require_megatron()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    check_divides(world, tensor=tensor, context=context, expert=expert)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor, context_parallel_size=context,
                                             expert_model_parallel_size=expert,
                                             expert_tensor_parallel_size=expert_tensor_size(tensor, expert))
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
