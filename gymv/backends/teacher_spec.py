"""What a MOPD teacher replica builds itself from: a `TeacherSpec`, on the floor of the teacher backends that
take it (gymv.backends.teacher, teacher_vllm, teacher_megatron), so that they take it typed. The workers that
start the replicas (gymv.cluster.teachers) build one per teacher alias from the recipe."""

from __future__ import annotations

from dataclasses import dataclass, field

from gymv.sections import TeacherSection


@dataclass(frozen=True)
class TeacherSpec:
    """Everything a teacher replica needs to build itself (plain data, pickled into the actor): the recipe's
    `mopd.teachers.<alias>` section as it is (`section`: its backend, parallel sizes and engine arguments),
    and the facts of this run around it."""

    alias: str
    path: str  # resolved checkpoint folder (the section's path, `text:` and `embedded:` resolved)
    student_path: str  # the student's checkpoint: its tokenizer must equal the teacher's
    text_of: bool = False  # score with only the language model of this (vision-language) checkpoint
    device: str = "cpu"
    dtype: str = "float32"
    temperature: float = 1.0
    max_tokens: int = 8192  # padded tokens per forward pass
    threads: int | None = None
    seed: int = 0
    top_k: int = 0  # > 0: also the teacher's k most likely tokens per position (top-k distillation)
    trust_remote_code: bool = False  # the recipe's model.trust_remote_code, for teachers too
    section: TeacherSection = field(kw_only=True)  # mopd.teachers.<alias>
