"""The `torch` teacher: a frozen Hugging Face checkpoint that scores a student's tokens (a vision-language
model that sees the row's images, or a text-only causal LM that never receives an image argument), and the
text-only checkpoints cut out of a VLM. Built by the MOPD teacher workers (gymv.cluster.teachers) through
TEACHER_BACKENDS.

Scores follow the logprob convention of the trainer (docs/algorithms.md §1): `[T]` per row, aligned with the
row's tokens, column 0 and vision-token targets 0, the sampling temperature applied, the student's vision
special tokens removed from the distribution (the student can never sample them, so both distributions
share one support). Rows are gymv.algorithms.teacher_batch.TeacherRow: tokens and their own images.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from gymv.backends.logprobs import right_pad, sequence_logprobs, sequence_topk
from gymv.backends.multimodal import make_adapter
from gymv.backends.policy import check_remote_code, load_policy, load_processors, load_weights
from gymv.backends.teacher_spec import TeacherSpec
from gymv.backends.training.micro_batches import plan_micro_batches
from gymv.errors import GymvError
from gymv.models.config_check import check_checkpoint
from gymv.models.quiet import quiet_transformers


_TEACHER_FIX = "point the teacher at a Hugging Face checkpoint that loads with transformers"


def is_text_only(path: str | Path) -> bool:
    """A checkpoint without a vision tower (its config has no vision_config)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise GymvError(f"cannot read the teacher's config.json: {e}", where=str(path),
                        fix="point the teacher at a Hugging Face checkpoint folder") from None
    return "vision_config" not in config


def student_vision_ids(student_path: str | Path) -> tuple[int, ...]:
    """The student's vision special-token ids (what it can never sample), from its tokenizer, config and
    image processor alone (no weights)."""
    from transformers import AutoConfig

    path = Path(student_path)
    if is_text_only(path):  # a text-only student samples every token
        return ()
    with quiet_transformers():
        cls, hf_processor, tok, improc, _ = load_processors(path)
        config = AutoConfig.from_pretrained(path)
    return make_adapter(cls, tok, improc, config, hf_processor).vision_token_ids


def check_same_tokenizer(teacher_tok, student_tok, alias: str) -> None:
    a, b = teacher_tok.get_vocab(), student_tok.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise GymvError(f"teacher {alias!r} does not share the student's tokenizer ({len(a)} vs {len(b)} tokens; "
                        f"e.g. {', '.join(repr(k) for k, _ in differ)} differ)", where=f"mopd.teachers.{alias}.path",
                        fix="MOPD compares logprobs token by token: use a teacher built with the student's tokenizer")


class TeacherModel:
    """A loaded teacher: model, tokenizer, the adapter it scores with, and whether it is text-only."""

    def __init__(self, spec: TeacherSpec):
        from transformers import AutoTokenizer

        self.spec = spec
        dtype = getattr(torch, spec.dtype)
        self.text_only = spec.text_of or is_text_only(spec.path)
        with quiet_transformers():
            student_tok = AutoTokenizer.from_pretrained(spec.student_path)
        self.forbidden_ids = student_vision_ids(spec.student_path)
        if self.text_only:
            trust = spec.trust_remote_code
            check_remote_code(Path(spec.path), trust)
            check_checkpoint(spec.path)
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=trust)
            self.model = self._text_model(spec, dtype)
            self.adapter = TextOnlyAdapter(self.forbidden_ids, spec.alias)
        else:
            policy = self._policy(spec, dtype)
            self.model, self.tokenizer, self.adapter = policy.model, policy.tokenizer, policy.adapter
        check_same_tokenizer(self.tokenizer, student_tok, spec.alias)
        self.model.to(spec.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _text_model(self, spec: TeacherSpec, dtype: torch.dtype):
        """The text-only teacher's model: a causal LM checkpoint, or the text cut of a VLM checkpoint."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        with quiet_transformers():
            if spec.text_of and not is_text_only(spec.path):
                vlm = load_weights(AutoModelForImageTextToText, spec.path, "the teacher's vision-language model",
                                   _TEACHER_FIX, dtype=dtype, trust_remote_code=spec.trust_remote_code)
                return text_model_of(vlm, where=spec.path)
            return load_weights(AutoModelForCausalLM, spec.path, "the teacher's causal language model",
                                _TEACHER_FIX, dtype=dtype, trust_remote_code=spec.trust_remote_code)

    def _policy(self, spec: TeacherSpec, dtype: torch.dtype):
        """A vision-language teacher's model, tokenizer and adapter."""
        return load_policy(spec.path, device="cpu", dtype=dtype, seed=spec.seed,
                           trust_remote_code=spec.trust_remote_code)

    def score(self, rows) -> list:
        return teacher_logprobs(self.model, self.adapter, rows, pad_id=self.pad_id, temperature=self.spec.temperature,
                                forbidden_ids=self.forbidden_ids, max_tokens=self.spec.max_tokens, top_k=self.spec.top_k)


# --------------------------------------------------------------------------------- text-only checkpoints


def check_text_cut(config, where: str | None = None) -> None:
    """GymvError unless a text-only model can be cut out of a VLM of this config (a Llama text model)."""
    if config.text_config.model_type != "llama":
        raise GymvError(f"cannot take a text-only model out of a {config.model_type} checkpoint", where=where,
                        fix="text:<checkpoint> supports LLaVA-style checkpoints (Llama text model)")


def text_model_of(vlm, *, where: str | None = None):
    """The language model of a LLaVA-style VLM as a text-only Llama causal LM (weights copied)."""
    from transformers import LlamaForCausalLM

    check_text_cut(vlm.config, where)
    lm = LlamaForCausalLM(vlm.config.text_config).to(next(vlm.parameters()).dtype)
    lm.model.load_state_dict(vlm.model.language_model.state_dict())
    lm.lm_head.load_state_dict(vlm.lm_head.state_dict())
    lm.generation_config = vlm.generation_config
    return lm


def save_text_model(vlm_path: str | Path, out_dir: str | Path) -> Path:
    """Write the language model of a LLaVA-style checkpoint as a text-only causal LM folder (same tokenizer
    and chat template): a text-only teacher with the weights a VLM learned."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    src, out = Path(vlm_path), Path(out_dir)
    with quiet_transformers():
        vlm = load_weights(AutoModelForImageTextToText, src, "an image-text-to-text model", _TEACHER_FIX,
                           dtype=torch.float32)
        lm = text_model_of(vlm, where=str(src))
        tok = AutoTokenizer.from_pretrained(src)
        out.mkdir(parents=True, exist_ok=True)
        lm.save_pretrained(out)
        tok.save_pretrained(out)
    template = src / "chat_template.jinja"
    if template.exists() and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template.read_text())
    return out


# ------------------------------------------------------------------------------------------- scoring


class TextOnlyAdapter:
    """The adapter a text-only teacher scores with: the same logprob path as a VLM, with no images allowed.

    `vision_token_ids` are the student's, so the teacher's distribution is renormalised over the tokens the
    student can sample.
    """

    style = "text"
    image_token_id = None

    def __init__(self, vision_token_ids: Sequence[int] = (), alias: str = "teacher"):
        self.vision_token_ids = tuple(vision_token_ids)
        self.alias = alias

    def check_batch(self, rows, images: Sequence[Sequence], where=None, attention_mask=None) -> None:
        for b, imgs in enumerate(images):
            if imgs:
                row = (where[b] if where else None) or f"batch row {b}"
                raise GymvError(f"teacher {self.alias!r} is text-only but {row} has {len(imgs)} image(s)",
                                where=row, fix="route rows with images to a vision-language teacher in "
                                               "mopd.agent_to_teacher")

    def position_ids(self, model, input_ids, attention_mask, image_grid_thw=None):
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def teacher_logprobs(model, adapter, rows: Sequence, *, pad_id: int, temperature: float = 1.0,
                     forbidden_ids: Sequence[int] | None = None, max_tokens: int = 8192, top_k: int = 0) -> list:
    """Per-row teacher logprobs `[len(row)]` (float32, CPU), in row order; no gradients.

    With `top_k` > 0 each row's entry is a dict: `logp` [len], and the teacher's k most likely tokens at
    every position with their logprobs, `topk_ids` [len, k] and `topk_logp` [len, k] (top-k distillation).
    Rows are packed into micro-batches by padded token count (`max_tokens`); each micro-batch is one
    right-padded batch of whole rows, so images always travel with their row.
    """
    out: list[torch.Tensor | None] = [None] * len(rows)
    plan = plan_micro_batches([len(r.input_ids) for r in rows], max_tokens)
    with torch.no_grad():
        for idx in plan:
            part = [rows[i] for i in idx]
            batch = right_pad([r.input_ids for r in part], [r.images for r in part], pad_id,
                              [r.where or f"teacher row {i}" for i, r in zip(idx, part)])
            if top_k > 0:
                lp, ids, top = sequence_topk(model, adapter, batch, top_k, temperature, forbidden_ids)
                for k, i in enumerate(idx):
                    n = len(rows[i].input_ids)
                    out[i] = {"logp": lp[k, :n].float().cpu(), "topk_ids": ids[k, :n].cpu(),
                              "topk_logp": top[k, :n].float().cpu()}
                continue
            lp = sequence_logprobs(model, adapter, batch, temperature, forbidden_ids)
            for k, i in enumerate(idx):
                out[i] = lp[k, :len(rows[i].input_ids)].float().cpu()
    return out  # type: ignore[return-value]
