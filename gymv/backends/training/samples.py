"""The training-sample contract: the keys a sample may carry, their dtypes and shapes, and the one function
that builds a sample for SFT, GRPO and MOPD alike. Every loss (gymv.algorithms.loss_fns) reads these keys.

A sample is one sequence of L tokens. Sequence fields travel as plain lists (they cross Ray to the training
workers about 20x cheaper than small tensors pickled one by one) and per-sample fields as floats; the
training backend turns them into tensors of the dtype below (`as_tensors`). Images stay PIL images or data
URLs, in the order of their placeholder spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampleField:
    dtype: str  # torch dtype name
    shape: str  # "L": one per token; "": one per sample; "L,k": k per token
    meaning: str


FIELDS: dict[str, SampleField] = {
    "input_ids": SampleField("long", "L", "token ids of the whole sequence (prompt, generations, tool results)"),
    "loss_mask": SampleField("bool", "L", "True on the tokens the loss trains (generated, or the gold turn)"),
    "logp_behaviour": SampleField("float32", "L", "the generator's logprobs of the sampled tokens (0 elsewhere)"),
    "advantages": SampleField("float32", "", "the sample's advantage (GRPO; MOPD's reward term)"),
    "logp_teacher": SampleField("float32", "L", "the teacher's logprobs of the sequence's tokens (MOPD)"),
    "teacher_topk_ids": SampleField("long", "L,k", "the teacher's k likeliest tokens per position (MOPD top-k)"),
    "teacher_topk_logp": SampleField("float32", "L,k", "their teacher logprobs (MOPD top-k)"),
    "logp_old": SampleField("float32", "L", "the trainer's logprobs before this step's updates (added by the trainer)"),
    "logp_ref": SampleField("float32", "L", "the frozen reference policy's logprobs (added by the trainer)"),
}
NON_TENSOR_FIELDS = ("images", "where")  # images in placeholder order; `where` names the sample in errors


def training_sample(token_ids: Sequence[int], loss_mask: Sequence[Any], *, images: Sequence[Any] = (),
                    where: str | None = None, logp_behaviour: Sequence[float] | None = None,
                    advantage: float | None = None, logp_teacher: Any = None, teacher_topk: Any = None) -> dict:
    """One training sample. `teacher_topk` is (ids [L,k], logprobs [L,k]) tensors. Lengths that disagree
    are a bug upstream (the agent loop or a teacher), never bad input: they raise AssertionError."""
    n = len(token_ids)
    sample: dict[str, Any] = {"input_ids": [int(x) for x in token_ids], "loss_mask": [bool(m) for m in loss_mask],
                              "images": list(images), "where": where}
    if logp_behaviour is not None:
        sample["logp_behaviour"] = [float(x) for x in logp_behaviour]
    if advantage is not None:
        sample["advantages"] = float(advantage)
    if logp_teacher is not None:
        sample["logp_teacher"] = logp_teacher.tolist() if hasattr(logp_teacher, "tolist") else list(logp_teacher)
    if teacher_topk is not None:
        ids, logp = teacher_topk
        sample["teacher_topk_ids"], sample["teacher_topk_logp"] = ids, logp
    for key in ("loss_mask", "logp_behaviour", "logp_teacher", "teacher_topk_ids", "teacher_topk_logp"):
        if key in sample:
            assert len(sample[key]) == n, f"{where}: {key} has {len(sample[key])} entries for {n} tokens"
    return sample


def as_tensors(sample: dict) -> dict:
    """`sample` with tensors of the contract's dtypes in place of its fields (in place; tensors already of
    that dtype are kept). A key outside the contract is a bug: RuntimeError."""
    import torch

    for k, v in sample.items():
        if k in NON_TENSOR_FIELDS:
            continue
        spec = FIELDS.get(k)
        if spec is None:
            raise RuntimeError(f"training sample key {k!r} is not in the sample contract (gymv.backends.training.samples)")
        dtype = getattr(torch, spec.dtype)
        if not (isinstance(v, torch.Tensor) and v.dtype == dtype):
            sample[k] = torch.as_tensor(v, dtype=dtype)
    return sample
