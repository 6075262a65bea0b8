"""Activation checkpointing of a transformers model for the torch and fsdp2 backends, with the vision tower
left out on request (`training.vision_checkpointing: false`)."""

from __future__ import annotations

import torch

from gymv.backends.training.replicated_precision import is_vision


def enable_checkpointing(model: torch.nn.Module, vision: bool = True, **kwargs) -> int:
    """transformers' activation checkpointing on every layer of `model` that takes it (`kwargs`: its
    gradient_checkpointing_kwargs), or (`vision` false) on all but the vision side's; how many vision layers
    were left out. Without the tower's recomputation a step dispatches about a quarter fewer operators (the
    RADIO tower's 32 blocks of Nemotron 3 Omni) for the tower's activations kept to the backward."""
    model.gradient_checkpointing_enable(**({"gradient_checkpointing_kwargs": kwargs} if kwargs else {}))
    if vision:
        return 0
    left = 0
    for name, module in model.named_modules():
        if is_vision(name) and getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False
            left += 1
    return left
