"""The `megatron` teacher: a frozen checkpoint scored by the Megatron-core twin that the megatron training
backend trains (gymv.backends.training.megatron.megatron_twin), for scoring only: no optimizer, no gradients.

It loads as the torch teacher does (gymv.backends.teacher.TeacherModel: the shared-tokenizer check, text-only
checkpoints and `text:` cuts, the student's vision special tokens), then swaps the HF decoder for its Megatron
twin, so its scores follow the same convention and equal the torch teacher's to float error.

A replica of `tensor_parallel_size` T is T ranks, one process each, in a process group of their own
(gymv.cluster.teachers starts them): each rank holds its shard of the decoder, every rank scores the same
rows (the vocabulary-parallel logits are gathered on every rank) and the first rank's scores are used.

`expert_parallel_size` E > 1 (a Nemotron-H decoder's MoE layers; E divides T) splits the routed experts over
E of the replica's ranks, each expert whole (megatron's expert tensor parallel size 1), as the megatron
trainer splits them (gymv.backends.training.megatron_parallel): the EP groups are consecutive blocks of E
ranks, so at E = T (the reference Super Omni teacher, TP 8 x EP 8) the EP group is the TP group. A TP rank
dispatches its share of the replicated tokens by all-to-all. Every rank scores the same rows, so every rank
plans the same micro-batches (gymv.backends.teacher.teacher_logprobs: by the rows' lengths alone) and runs the same
forward passes with the same shapes: the all-to-alls meet in lock step.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from gymv.backends.teacher import TeacherModel
from gymv.backends.teacher_spec import TeacherSpec
from gymv.errors import GymvError


def check_sizes(spec: TeacherSpec) -> None:
    """GymvError naming the teacher's key unless its expert parallel size divides its tensor parallel size
    (the replica's ranks, over which the experts fold)."""
    section = spec.section
    tp, ep = section.tensor_parallel_size, section.expert_parallel_size
    if tp % ep:
        raise GymvError(f"teacher {spec.alias!r}: expert_parallel_size {ep} does not divide tensor_parallel_size "
                        f"{tp} (the replica's {tp} ranks, over which its experts are split)",
                        where=f"mopd.teachers.{spec.alias}.expert_parallel_size",
                        fix=f"use a divisor of {tp} (e.g. {tp}: the experts split over all the replica's GPUs, or 1)")


def _as_teacher_error(err: GymvError, alias: str) -> GymvError:
    """A model-shape error of the megatron builders (naming training.parallel.*) renamed to the teacher's key."""
    keys = {"training.parallel.tensor": "tensor_parallel_size", "training.parallel.expert": "expert_parallel_size"}
    if err.where not in keys:
        return err
    return GymvError(f"teacher {alias!r}: {err.message}", where=f"mopd.teachers.{alias}.{keys[err.where]}",
                     fix=err.fix.replace("a tensor parallel size", "a tensor_parallel_size")
                     .replace("an expert parallel size", "an expert_parallel_size") if err.fix else None)


class MegatronTeacher(TeacherModel):
    """One rank of a Megatron teacher replica; built from a TeacherSpec."""

    def __init__(self, spec: TeacherSpec):
        from gymv.backends.training.megatron import check_maps, megatron_twin
        from gymv.backends.training.megatron_hybrid_weights import HybridShape

        section = spec.section  # mopd.teachers.<alias>
        tp, ep = section.tensor_parallel_size, section.expert_parallel_size
        check_sizes(spec)
        device = torch.device(spec.device)
        # the HF model is read on the host in float32 (as the megatron trainer reads its checkpoint) and
        # dropped once its weights are in the twin
        super().__init__(replace(spec, device="cpu", dtype="float32"))
        self.spec = spec
        shape = check_maps(SimpleNamespace(model=self.model, adapter=self.adapter))
        if ep > 1 and not isinstance(shape, HybridShape):
            raise GymvError(f"teacher {spec.alias!r}: expert parallelism splits the MoE layers of Nemotron-H "
                            f"decoders, and this checkpoint's decoder ({shape.__class__.__name__}) has none",
                            where=f"mopd.teachers.{spec.alias}.expert_parallel_size",
                            fix="set expert_parallel_size: 1 for this teacher")
        _init_groups(tp, ep, device, spec.seed)
        try:
            twin = megatron_twin(self.model, self.model.config, shape, tensor_parallel=tp, device=device,
                                 dtype=getattr(torch, spec.dtype), expert_parallel=ep)
        except GymvError as e:
            raise _as_teacher_error(e, spec.alias) from None
        twin.eval()
        twin.requires_grad_(False)
        self.model = twin

    def num_parameters(self) -> int:
        """The whole model's parameter count (this rank holds 1/T of the decoder's TP-sharded weights and
        1/E of its routed experts: under EP each expert is whole, on one rank of E)."""
        from gymv.backends.training.megatron_hybrid_weights import EXPERT_SHARDED
        from gymv.backends.training.megatron_weights import tp_sharded

        tp, ep = self.spec.section.tensor_parallel_size, self.spec.section.expert_parallel_size
        if tp == 1 and ep == 1:
            return sum(p.numel() for p in self.model.parameters())

        def copies(name: str) -> int:
            if not name.startswith("gpt."):
                return 1
            if ep > 1 and any(part in name for part in EXPERT_SHARDED):
                return ep
            return tp if tp_sharded(name) else 1

        return sum(p.numel() * copies(name) for name, p in self.model.named_parameters())


def _init_groups(tp: int, ep: int, device: torch.device, seed: int) -> None:
    """Megatron's groups for one replica: TP alone as before, or TP x EP through the trainer's
    init_model_parallel (expert TP 1, EP folded over the replica's ranks)."""
    from gymv.backends.training.megatron_model import init_parallel

    if ep == 1:
        init_parallel(tp, device, seed=seed)
        return
    from gymv.backends.training.megatron_parallel import init_model_parallel

    init_model_parallel(tp, expert=ep, device=device)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
