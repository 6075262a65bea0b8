"""MOPD teachers on vLLM (`mopd.teachers.*.backend: vllm`): a vllm teacher's scores of a student's tokens
equal the torch teacher's (own-token logprobs, top-k ids and logprobs) on the tiny LLaVA with images, on a
VLM's language model for text rows, and on a text LM whose student samples every token.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from gymv.algorithms.teacher_batch import TeacherRow  # noqa: E402
from gymv.backends.teacher import TeacherModel  # noqa: E402
from gymv.backends.teacher_spec import TeacherSpec  # noqa: E402
from gymv.backends.teacher_vllm import VllmTeacher  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from gymv.sections import TeacherSection  # noqa: E402
from tiny_models import chat_ids, noise, shared_policy, solid, tiny_path  # noqa: E402
from vllm_helpers import tiny_text_llama  # noqa: E402

pytestmark = pytest.mark.slow
GAP = 1e-3  # the generation parity tests' tolerance on logprobs


def vllm_section(path: str) -> TeacherSection:
    """A recipe's `mopd.teachers.<alias>` on the vllm backend."""
    return TeacherSection(path=path, backend="vllm")


def student_rows(policy, images_too: bool = True) -> list[TeacherRow]:
    """Prompt + an answer per row (what a student sampled), with the row's own images."""
    answer = policy.tokenizer.encode(" There are \\boxed{3} red circles.", add_special_tokens=False)
    rows = []
    for i, text in enumerate(["How many red circles?", "Click the blue one.", "Hi"]):
        images = ([noise(i), solid((0, 0, 200), (64, 64))][: 1 + i % 2]) if images_too and i < 2 else []
        rows.append(TeacherRow(chat_ids(policy, text, images) + answer[: 4 + 3 * i], images, where=f"row {i}"))
    return rows


def assert_same_scores(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert (g["logp"] - w["logp"]).abs().max().item() < GAP
            assert torch.equal(g["topk_ids"], w["topk_ids"])
            assert (g["topk_logp"] - w["topk_logp"]).abs().max().item() < GAP
        else:
            assert g.shape == w.shape and (g - w).abs().max().item() < GAP


def both(spec: TeacherSpec, rows):
    teacher = VllmTeacher(spec)
    try:
        got = teacher.score(rows)
    finally:
        teacher.close()
    return got, TeacherModel(spec).score(rows), teacher


def test_a_vlm_teachers_scores_with_images_equal_the_torch_teachers_at_a_temperature_with_top_k():
    llava = str(tiny_path("tiny-llava"))
    rows = student_rows(shared_policy("tiny-llava"))
    spec = TeacherSpec("count", llava, llava, temperature=0.7, top_k=4, section=vllm_section(llava))
    got, want, teacher = both(spec, rows)
    assert not teacher.text_only and not teacher.direct  # the student's vision ids: every logit comes back
    assert_same_scores(got, want)
    assert got[0]["logp"][0] == 0 and got[0]["logp"][rows[0].input_ids.index(teacher.adapter.image_token_id)] == 0


def test_a_text_teacher_cut_from_a_vlm_scores_text_rows_as_the_torch_one_and_refuses_images():
    llava = str(tiny_path("tiny-llava"))
    rows = student_rows(shared_policy("tiny-llava"), images_too=False)
    spec = TeacherSpec("arith", llava, llava, text_of=True, section=vllm_section(llava))
    teacher = VllmTeacher(spec)
    try:
        assert teacher.text_only and teacher.num_parameters() > 0
        assert_same_scores(teacher.score(rows), TeacherModel(spec).score(rows))
        with pytest.raises(GymvError, match="text-only"):
            teacher.score(student_rows(shared_policy("tiny-llava"))[:1])
    finally:
        teacher.close()


def test_a_text_lm_with_a_text_student_is_scored_from_vllms_own_logprobs(tmp_path_factory):
    lm = str(tiny_text_llama(tmp_path_factory.mktemp("text-lm") / "lm"))
    rows = student_rows(shared_policy("tiny-llava"), images_too=False)  # same tokenizer, text only
    spec = TeacherSpec("arith", lm, lm, top_k=3, section=vllm_section(lm))
    got, want, teacher = both(spec, rows)
    assert teacher.direct  # temperature 1 and nothing masked: vLLM's raw logprobs are the definition
    assert_same_scores(got, want)
