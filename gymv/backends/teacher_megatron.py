"""The `megatron` teacher: a frozen checkpoint scored by the Megatron-core twin that the megatron training
backend trains (gymv.backends.training.megatron.megatron_twin), for scoring only: no optimizer, no gradients.

It loads as the torch teacher does (gymv.backends.teacher.TeacherModel: the shared-tokenizer check, text-only
checkpoints and `text:` cuts, the student's vision special tokens), then swaps the HF decoder for its Megatron
twin, so its scores follow the same convention and equal the torch teacher's to float error.

A replica of `tensor_parallel_size` T is T ranks, one process each, in a process group of their own
(gymv.cluster.teachers starts them): each rank holds its shard of the decoder, every rank scores the same
rows (the vocabulary-parallel logits are gathered on every rank) and the first rank's scores are used.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from gymv.backends.teacher import TeacherModel
from gymv.backends.teacher_spec import TeacherSpec
from gymv.errors import GymvError


class MegatronTeacher(TeacherModel):
    """One rank of a Megatron teacher replica; built from a TeacherSpec."""

    def __init__(self, spec: TeacherSpec):
        from gymv.backends.training.megatron import check_maps, megatron_twin
        from gymv.backends.training.megatron_model import init_parallel

        section = spec.section  # mopd.teachers.<alias>
        if section.expert_parallel_size > 1:
            raise GymvError(f"teacher {spec.alias!r}: the megatron teacher splits no experts here "
                            f"(expert_parallel_size {section.expert_parallel_size})",
                            where=f"mopd.teachers.{spec.alias}.expert_parallel_size",
                            fix="set expert_parallel_size: 1 (tensor parallelism is wired), or use backend: vllm")
        device = torch.device(spec.device)
        init_parallel(section.tensor_parallel_size, device, seed=spec.seed)
        # the HF model is read on the host in float32 (as the megatron trainer reads its checkpoint) and
        # dropped once its weights are in the twin
        super().__init__(replace(spec, device="cpu", dtype="float32"))
        self.spec = spec
        shape = check_maps(SimpleNamespace(model=self.model, adapter=self.adapter))
        twin = megatron_twin(self.model, self.model.config, shape, tensor_parallel=section.tensor_parallel_size,
                             device=device, dtype=getattr(torch, spec.dtype))
        twin.eval()
        twin.requires_grad_(False)
        self.model = twin

    def num_parameters(self) -> int:
        """The whole model's parameter count (this rank holds 1/T of the decoder's sharded weights)."""
        from gymv.backends.training.megatron_weights import tp_sharded

        tp = self.spec.section.tensor_parallel_size
        if tp == 1:
            return sum(p.numel() for p in self.model.parameters())
        return sum(p.numel() * (tp if name.startswith("gpt.") and tp_sharded(name) else 1)
                   for name, p in self.model.named_parameters())
