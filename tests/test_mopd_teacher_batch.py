"""Teacher batches: rows travel with their own images, data-parallel padding repeats whole rows and is trimmed,
and a text-only teacher is called with text arguments only. Real tiny checkpoints throughout."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from gymv.algorithms.teacher_batch import TeacherRow, pad_rows, shard_rows, trim
from gymv.backends.teacher import TeacherModel, TextOnlyAdapter, check_same_tokenizer, save_text_model, teacher_logprobs
from gymv.backends.teacher_spec import TeacherSpec
from gymv.errors import GymvError
from gymv.sections import TeacherSection
from tiny_models import chat_ids, noise, shared_policy, tiny_path


def _rows() -> list[TeacherRow]:
    """Image row, text row, image row (another image, another length), text row: a mixed batch."""
    p = shared_policy("tiny-llava")
    g = torch.Generator().manual_seed(0)

    def gen(k):
        return torch.randint(10, 200, (k,), generator=g).tolist()

    a, b = noise(1), noise(2, size=(40, 70))
    return [
        TeacherRow(chat_ids(p, "How many red circles?", [a]) + gen(5), [a], "row 0"),
        TeacherRow(chat_ids(p, "3 + 4=?", []) + gen(9), [], "row 1"),
        TeacherRow(chat_ids(p, "Count the blue ones.", [b]) + gen(3), [b], "row 2"),
        TeacherRow(chat_ids(p, "7 + 1=?", []) + gen(2), [], "row 3"),
    ]


def _vlm_scores(rows, **kw):
    p = shared_policy("tiny-llava")
    return teacher_logprobs(p.model, p.adapter, rows, pad_id=p.tokenizer.pad_token_id, **kw)


@lru_cache(maxsize=None)
def _text_teacher_dir():
    import tempfile

    return save_text_model(tiny_path("tiny-llava"), tempfile.mkdtemp(prefix="gymv-text-teacher-"))


# -- padding to a multiple of the data-parallel size ---------------------------------------------------


def test_padding_repeats_whole_rows_tokens_and_images_together():
    rows = _rows()[:3]
    padded, n = pad_rows(rows, 4)
    assert n == 3 and len(padded) == 4
    assert padded[3].input_ids == rows[0].input_ids and padded[3].images is rows[0].images


def test_padding_pads_by_repeating_the_matching_row_of_each_padding_slot():
    rows = _rows()[:3]
    padded, _ = pad_rows(rows, 8)
    for k in range(3, 8):
        src = rows[k % 3]
        assert (padded[k].input_ids, padded[k].images) == (src.input_ids, src.images)


def test_a_batch_already_a_multiple_is_not_padded():
    rows = _rows()
    assert pad_rows(rows, 2) == (rows, 4)


def test_shards_are_equal_and_contiguous():
    rows = _rows()
    assert shard_rows(rows, 2) == [rows[:2], rows[2:]]
    with pytest.raises(RuntimeError, match="do not split evenly"):
        shard_rows(rows[:3], 2)


def test_scores_of_a_padded_batch_trimmed_equal_the_unpadded_scores():
    rows = _rows()[:3]
    padded, n = pad_rows(rows, 2)
    shards = shard_rows(padded, 2)
    scored = trim([lp for s in shards for lp in _vlm_scores(s)], n)
    for got, want in zip(scored, _vlm_scores(rows)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert len(scored) == 3


# -- mixed batches stay aligned ---------------------------------------------------------------------------


def test_batched_scores_of_a_mixed_batch_equal_each_row_scored_alone():
    rows = _rows()
    batched = _vlm_scores(rows)
    for row, got in zip(rows, batched):
        torch.testing.assert_close(got, _vlm_scores([row])[0], atol=1e-5, rtol=0)
        assert got.shape == (len(row.input_ids),)


def test_micro_batching_by_tokens_keeps_each_row_with_its_scores():
    rows = _rows()
    small = _vlm_scores(rows, max_tokens=1)  # one row per forward pass, longest first
    for got, want in zip(small, _vlm_scores(rows)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_row_scored_with_another_rows_image_scores_differently():
    rows = _rows()
    swapped = TeacherRow(rows[0].input_ids, rows[2].images, "row 0 with row 2's image")
    assert not torch.allclose(_vlm_scores([swapped])[0], _vlm_scores([rows[0]])[0], atol=1e-4)


# -- text-only teachers -----------------------------------------------------------------------------------


class _StrictTextLM:
    """A real tiny Llama causal LM whose forward takes exactly the text arguments: any other keyword raises."""

    def __new__(cls, path):
        from transformers import LlamaForCausalLM

        class Strict(LlamaForCausalLM):
            calls: list = []

            def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
                Strict.calls.append({"input_ids": input_ids, "attention_mask": attention_mask,
                                     "position_ids": position_ids, "use_cache": use_cache})
                return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=use_cache)

        return Strict.from_pretrained(path)


def test_a_text_only_teacher_is_called_with_text_arguments_only():
    model = _StrictTextLM(_text_teacher_dir())
    text_rows = [r for r in _rows() if not r.images]
    out = teacher_logprobs(model, TextOnlyAdapter((4,)), text_rows, pad_id=0)
    assert len(out) == 2 and len(type(model).calls) == 1
    call = type(model).calls[0]
    assert call["input_ids"].shape[0] == 2 and call["use_cache"] is False


def test_a_text_only_teacher_refuses_a_row_with_images_naming_the_row():
    model = _StrictTextLM(_text_teacher_dir())
    with pytest.raises(GymvError, match=r"teacher 'arith' is text-only but row 0 has 1 image"):
        teacher_logprobs(model, TextOnlyAdapter((4,), "arith"), _rows()[:2], pad_id=0)


def test_the_text_model_of_a_vlm_scores_text_rows_like_the_vlm():
    text_lm = str(_text_teacher_dir())
    spec = TeacherSpec("arith", text_lm, str(tiny_path("tiny-llava")), section=TeacherSection(path=text_lm))
    teacher = TeacherModel(spec)
    assert teacher.text_only and teacher.forbidden_ids == shared_policy("tiny-llava").adapter.vision_token_ids
    text_rows = [r for r in _rows() if not r.images]
    for got, want in zip(teacher.score(text_rows), _vlm_scores(text_rows)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_text_prefixed_teacher_is_the_language_model_of_a_vlm_and_gets_text_only():
    spec = TeacherSpec("arith", str(tiny_path("tiny-llava")), str(tiny_path("tiny-llava")), text_of=True,
                       section=TeacherSection(path=f"text:{tiny_path('tiny-llava')}"))
    teacher = TeacherModel(spec)
    text_rows = [r for r in _rows() if not r.images]
    assert teacher.text_only and type(teacher.model).__name__ == "LlamaForCausalLM"
    for got, want in zip(teacher.score(text_rows), _vlm_scores(text_rows)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(GymvError, match="text-only"):
        teacher.score(_rows())


def test_a_vlm_teacher_loads_as_one_and_scores_images():
    spec = TeacherSpec("count", str(tiny_path("tiny-llava")), str(tiny_path("tiny-llava")),
                       section=TeacherSection(path=str(tiny_path("tiny-llava"))))
    teacher = TeacherModel(spec)
    assert not teacher.text_only
    torch.testing.assert_close(teacher.score(_rows())[2], _vlm_scores(_rows())[2], atol=1e-5, rtol=0)


def test_a_teacher_with_another_tokenizer_is_refused():
    from gymv.models.tokenizer import hf_tokenizer, train_bpe

    other = hf_tokenizer(train_bpe(1, 1024, ["<image>"]), image_token="<image>")
    with pytest.raises(GymvError, match="does not share the student's tokenizer"):
        check_same_tokenizer(other, shared_policy("tiny-llava").tokenizer, "count")


# -- top-k distillation -------------------------------------------------------------------------------------


def test_top_k_scores_are_the_teachers_k_likeliest_next_tokens_of_every_row():
    from gymv.backends.logprobs import MultimodalBatch, policy_logits

    p = shared_policy("tiny-llava")
    rows = _rows()
    got = _vlm_scores(rows, top_k=5)
    for row, plain, top in zip(rows, _vlm_scores(rows), got):
        torch.testing.assert_close(top["logp"], plain, atol=1e-5, rtol=0)  # the own tokens' logprobs unchanged
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            from gymv.backends.logprobs import _forward_logits, forbidden_mask

            logits = _forward_logits(p.model, p.adapter, MultimodalBatch(ids, torch.ones_like(ids), [row.images], [row.where]))
            z = policy_logits(logits[0, :-1], 1.0, forbidden_mask(logits.shape[-1], p.adapter.vision_token_ids, logits.device))
            want_lp, want_ids = torch.log_softmax(z, -1).topk(5, -1)
        assert top["topk_ids"].shape == (len(row.input_ids), 5)
        assert torch.equal(top["topk_ids"][1:], want_ids)  # position t holds the distribution of token t
        torch.testing.assert_close(top["topk_logp"][1:], want_lp, atol=1e-5, rtol=0)
        assert not set(top["topk_ids"][1:].flatten().tolist()) & set(p.adapter.vision_token_ids)
