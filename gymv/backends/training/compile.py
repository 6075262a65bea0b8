"""`training.compile`: torch.compile of each decoder layer of the trained model.

An eager decoder layer spends most of its non-matmul time in small memory-bound kernels: RMSNorm's fp32
upcast and downcast, rotary embeddings, the gated activation and residual adds, each reading and writing
the whole activation. Compiling the layer lets inductor fuse them. Only the layers' `forward` is compiled,
so the hooks around it (FSDP2's gathers, activation checkpointing) stay eager, and the layers share one
compiled graph (same code, parameters as inputs). Packed attention is a graph break
(gymv.backends.packed_attention): its segment bookkeeping and the varlen kernel run eagerly between two
compiled halves of the layer. Sequence lengths change from one micro-batch to the next, so after the first
micro-batch dynamo recompiles once with a dynamic length.
"""

from __future__ import annotations

import torch

from gymv.backends import packed_attention
from gymv.backends.compile_limits import lift_recompile_limit
from gymv.backends.training.units import decoder_units
from gymv.errors import GymvError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language side's decoder layers (the units FSDP2 shards, gymv.backends.training.fsdp)."""
    return [m for _, m in decoder_units(model)]


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Replace each decoder layer's forward with its compiled form (lazily: the first call compiles); returns
    how many layers. Call before sharding. A model with no layer to compile is a config error."""
    layers = decoder_layers(model)
    if not layers:
        raise GymvError(f"training.compile found no decoder layers in {type(model).__name__}",
                        where="training.compile", fix="set training.compile: false for this model")
    # each layer and each graph break adds cache entries to the one shared code object
    lift_recompile_limit(8 * len(layers), 32 * len(layers))
    packed_attention.eager_under_compile()
    for layer in layers:
        if not getattr(layer, "gymv_compiled", False):
            layer.forward = torch.compile(layer.forward, backend=backend)
            layer.gymv_compiled = True
    return len(layers)


def compiled(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gymv_compiled", False) for m in model.modules())
