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
    """One rank of a Megatron teacher replica; built from a TeacherSpec. Like the megatron trainer, the rank reads
    only its shard of the checkpoint (gymv.backends.training.megatron.shard_source): the HF model stays on the
    meta device but for its vision tower and projector, and its twin reads its TP slices and EP experts alone."""

    def __init__(self, spec: TeacherSpec):
        section = spec.section  # mopd.teachers.<alias>
        check_sizes(spec)
        if section.expert_parallel_size > 1:
            _check_experts(spec)
        _init_groups(section.tensor_parallel_size, section.expert_parallel_size, torch.device(spec.device), spec.seed)
        # the shard is read on the host in float32 (as the megatron trainer reads its checkpoint) and cast as the
        # twin takes it; the twin is the teacher's model
        super().__init__(spec)
        self.spec = spec

    def _policy(self, spec: TeacherSpec, dtype: torch.dtype):
        from gymv.backends.training.megatron import shard_source

        policy, weights = shard_source(spec.path, seed=spec.seed, trust_remote_code=spec.trust_remote_code)
        policy.model = self._twin(spec, policy, weights, policy.model.config)
        return policy

    def _text_model(self, spec: TeacherSpec, dtype: torch.dtype):
        """The twin of a text-only checkpoint, or of the text cut of a VLM checkpoint (its decoder read from the
        VLM's names; no vision tower)."""
        from gymv.backends.teacher import check_text_cut, is_text_only
        from gymv.backends.training.megatron import shard_source

        cut = spec.text_of and not is_text_only(spec.path)
        policy, weights = shard_source(spec.path, seed=spec.seed, trust_remote_code=spec.trust_remote_code,
                                       decoder_only=cut)
        config = policy.model.config
        if cut:
            check_text_cut(config, where=spec.path)
            config = config.text_config
        return self._twin(spec, policy, weights, config)

    def _twin(self, spec: TeacherSpec, policy, weights, hf_config):
        from gymv.backends.training.megatron import check_maps, megatron_twin

        tp, ep = spec.section.tensor_parallel_size, spec.section.expert_parallel_size
        shape = check_maps(policy)
        try:
            twin = megatron_twin(policy.model, hf_config, shape, tensor_parallel=tp, device=torch.device(spec.device),
                                 dtype=getattr(torch, spec.dtype), expert_parallel=ep, weights=weights)
        except GymvError as e:
            raise _as_teacher_error(e, spec.alias) from None
        finally:
            weights.files.close()
        return twin

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


def _check_experts(spec: TeacherSpec) -> None:
    """GymvError naming the teacher's key where expert parallelism is asked of a decoder without MoE layers (from
    its config alone: before any process group is asked for)."""
    from transformers import AutoConfig

    from gymv.backends.training.megatron import is_hybrid

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    if not is_hybrid(config):
        raise GymvError(f"teacher {spec.alias!r}: expert parallelism splits the MoE layers of Nemotron-H decoders, and "
                        f"this checkpoint's decoder ({config.get_text_config().model_type}) has none",
                        where=f"mopd.teachers.{spec.alias}.expert_parallel_size",
                        fix="set expert_parallel_size: 1 for this teacher")


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
