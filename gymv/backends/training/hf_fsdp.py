"""The `fsdp2` training backend: the `torch` backend's model, losses and batching, with the policy (and the
KL reference) sharded over the trainer's ranks by FSDP2 (gymv.backends.training.fsdp).

Options come from `training.fsdp` (the trainer reads its section). Checkpoints are sharded
(torch.distributed.checkpoint) and resume at another number of ranks; `export_hf` gathers one tensor at a
time into rank 0's host memory and writes a Hugging Face folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from gymv.backends.training.checkpointing import enable_checkpointing
from gymv.backends.training.fsdp import FSDPTrainer
from gymv.backends.training.hf_torch import HFTorchBackend, copy_hf_files
from gymv.models.load import checkpoint_dtype
from gymv.models.quiet import quiet_transformers


class HFFSDPBackend(HFTorchBackend):
    gathers_weights = True

    def reference_dtype(self) -> torch.dtype:
        """bfloat16 where that loses nothing, else float32. Under bfloat16 mixed precision FSDP2 gathers every
        sharded weight in bfloat16 for compute, so a reference read from a bfloat16 checkpoint computes the same
        numbers held in bfloat16: half the memory (17 instead of 33 GB at 8B parameters). The replicated vision
        tower runs under autocast either way (its matrix products the same, a few elementwise sums rounded in
        bfloat16 instead of float32)."""
        compute = self.trainer._resolve_precision(self.config.dtype)
        return reference_dtype(checkpoint_dtype(self.setup.model_path), compute)

    def _make_trainer(self, model, device, *, frozen: bool = False):
        if self.setup.training.gradient_checkpointing and not frozen:
            # non-reentrant checkpointing: FSDP2's gathers re-run inside the recomputed forward
            model.gradient_checkpointing_disable()
            enable_checkpointing(model, vision=self.setup.training.vision_checkpointing, use_reentrant=False)
        layout = self.layout(model)
        self.compile_layers(model, frozen)
        return FSDPTrainer(model, self.trainer_logprob_fn(frozen), self.config, collate_fn=layout.collate, device=device,
                           plan_fn=layout.plan, images_fn=layout.step_images, trainable=not frozen)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Each weight gathered in full, one at a time; a collective, so every rank iterates it."""
        yield from self.trainer.named_full_weights()

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.trainer.model.parameters())  # DTensors count their global size

    def checkpoint_bytes(self) -> int:
        return self.trainer.checkpoint_bytes()  # every rank writes its shards

    def save(self, path: str | os.PathLike) -> None:
        """Every rank writes its shards; rank 0 adds the HF config, tokenizer and processor files."""
        self.trainer.save(path)
        if self.rank == 0:
            copy_hf_files(self.setup.model_path, path)

    def export_hf(self, path: str | os.PathLike) -> None:
        full: dict[str, Any] = {}
        for name, t in self.trainer.named_full_weights():
            if self.rank == 0:
                full[name] = t.detach().to("cpu", copy=True)
        if self.rank != 0:
            return
        with quiet_transformers():
            self.trainer.model.save_pretrained(path, state_dict=full)
        copy_hf_files(self.setup.model_path, path)


def reference_dtype(stored: str | None, compute: torch.dtype | None) -> torch.dtype:
    """A frozen copy's dtype under FSDP2: the compute dtype where the checkpoint is stored in it, else float32."""
    if compute is not None and stored == str(compute).removeprefix("torch."):
        return compute
    return torch.float32
