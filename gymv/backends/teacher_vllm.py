"""The `vllm` teacher: a frozen checkpoint that scores a student's tokens with vLLM's prompt logprobs.

Scores are the torch teacher's (gymv.backends.teacher), to float error: `[T]` per row, column 0 and
vision-token targets 0, the sampling temperature applied, the student's vision special tokens removed from
the distribution, and with top_k > 0 the teacher's k most likely tokens per position.

vLLM computes prompt logprobs from the raw logits, before temperature and before any token mask. Where
that is already the definition (temperature 1 and a student that can sample every token), the engine
returns the logprobs of the row's tokens (and its top k) directly. Otherwise no subset of vLLM's logprobs
renormalises exactly, so the engine returns every logit of every position (`prompt_logprobs=-1` in
`raw_logits` mode, flat) and gymv applies `gymv.backends.sampling.policy_logits` to them: exact, at
T x V numbers per row, which suits small vocabularies and short rows better than long rows of a large one.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence

import torch

from gymv.backends.generation.base import GenerationRequest
from gymv.backends.generation.vllm import VllmGenerationBackend, check_expansion, flat_to_dense
from gymv.backends.sampling import forbidden_mask, policy_logits
from gymv.backends.teacher import (
    TextOnlyAdapter,
    check_same_tokenizer,
    is_text_only,
    save_text_model,
    student_vision_ids,
)
from gymv.backends.teacher_spec import TeacherSpec
from gymv.errors import GymvError
from gymv.models.quiet import quiet_transformers
from gymv.sections import TeacherSection, VllmSection


def engine_section(teacher: TeacherSection) -> VllmSection:
    """The engine a teacher's section (`mopd.teachers.<alias>`) asks for: the GPUs it spans and its engine
    arguments. A teacher's section sets no memory share and no eager switch, so those stay at generation.vllm's
    defaults."""
    return VllmSection(tensor_parallel_size=teacher.tensor_parallel_size, engine_kwargs=teacher.engine_kwargs)


class VllmTeacher:
    """A teacher served by one in-process vLLM engine; built from a TeacherSpec."""

    def __init__(self, spec: TeacherSpec):
        from transformers import AutoTokenizer

        self.spec = spec
        self.text_only = spec.text_of or is_text_only(spec.path)
        path = spec.path
        self._tmp = None
        if spec.text_of and not is_text_only(spec.path):  # vLLM loads folders: write the language model out
            self._tmp = tempfile.TemporaryDirectory(prefix="gymv-text-teacher-")
            path = str(save_text_model(spec.path, self._tmp.name))
        self.forbidden_ids = tuple(student_vision_ids(spec.student_path))
        with quiet_transformers():
            student_tok = AutoTokenizer.from_pretrained(spec.student_path)
        config_vocab = _vocab_size(path)
        self.forbidden_in_vocab = [i for i in self.forbidden_ids if 0 <= i < config_vocab]
        temperature = float(spec.temperature)
        # raw logprobs are the definition when nothing is masked and nothing is rescaled
        self.direct = not self.forbidden_in_vocab and temperature in (0.0, 1.0)
        self.engine = VllmGenerationBackend.create(
            path, device=spec.device, dtype=spec.dtype, seed=spec.seed, trust_remote_code=spec.trust_remote_code,
            vllm=engine_section(spec.section), enable_expert_parallel=spec.section.expert_parallel_size > 1,
            logprobs_mode="raw_logprobs" if self.direct else "raw_logits",
            max_logprobs=max(spec.top_k, 1) if self.direct else -1, engine_section=f"mopd.teachers.{spec.alias}")
        self.tokenizer = self.engine.tokenizer
        check_same_tokenizer(self.tokenizer, student_tok, spec.alias)
        self.vocab_size = config_vocab
        self.adapter = self.engine.adapter if not self.text_only else TextOnlyAdapter(self.forbidden_ids, spec.alias)
        self.model = None  # no torch module in this process: vLLM holds the weights

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.engine.param_shapes.values())

    def score(self, rows: Sequence) -> list:
        from vllm import SamplingParams as VllmParams

        if not rows:
            return []
        prompts = []
        for i, r in enumerate(rows):
            where = r.where or f"teacher row {i}"
            if self.text_only:
                self.adapter.check_batch([r.input_ids], [r.images], [where])
            else:
                self.engine.adapter.check(r.input_ids, r.images, where=where)
            prompts.append(self.engine._prompt(GenerationRequest(prompt_token_ids=list(r.input_ids),
                                                                 images=list(r.images), where=where)))
        k = int(self.spec.top_k)
        params = VllmParams(max_tokens=1, temperature=0.0, detokenize=False, flat_logprobs=True,
                            prompt_logprobs=k if self.direct else -1)
        results = self.engine.llm.generate(prompts, params, use_tqdm=False)
        out = []
        for i, (r, res) in enumerate(zip(rows, results)):
            check_expansion(res.prompt_token_ids, r.input_ids, where=r.where or f"teacher row {i}",
                            fix="the teacher's processor settings and vLLM's disagree; use backend: torch")
            out.append(self._row_scores(list(r.input_ids), res.prompt_logprobs, k))
        return out

    def _row_scores(self, ids: list[int], flat, k: int):
        n = len(ids)
        target = torch.tensor(ids[1:], dtype=torch.long)
        if self.direct:
            own, top_ids, top_lp = _direct(flat, target, k)
        else:
            logits = flat_to_dense(flat, _rows_of(flat, n - 1), self.vocab_size)
            own, top_ids, top_lp = self._from_logits(logits, target, k)
        lp = torch.cat([own.new_zeros(1), own])
        if k <= 0:
            return lp
        pad = lambda x: torch.cat([x.new_zeros((1, x.shape[1])), x])  # noqa: E731
        return {"logp": lp, "topk_ids": pad(top_ids), "topk_logp": pad(top_lp)}

    def _from_logits(self, logits: torch.Tensor, target: torch.Tensor, k: int):
        forbidden = forbidden_mask(logits.shape[-1], self.forbidden_ids, logits.device)
        lsm = torch.log_softmax(policy_logits(logits, self.spec.temperature, forbidden), dim=-1)
        own = lsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if forbidden is not None:
            own = torch.where(forbidden[target], torch.zeros_like(own), own)
        if k <= 0:
            return own, None, None
        top_lp, top_ids = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
        return own, top_ids, top_lp.clamp(min=-1e4)

    def close(self) -> None:
        self.engine.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def _vocab_size(path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def _rows_of(flat, rows: int) -> range:
    """The positions of a prompt's FlatLogprobs that score its tokens 1..rows (position 0 has none)."""
    if len(flat) != rows + 1:
        raise GymvError(f"vLLM returned prompt logprobs for {len(flat)} positions, expected {rows + 1}",
                        where="mopd teacher", fix="report this: vLLM's prompt logprob output changed")
    return range(1, rows + 1)


def _direct(flat, target: torch.Tensor, k: int):
    """(logprob of each target, top-k ids, top-k logprobs) from a FlatLogprobs of raw logprobs: each position
    holds the target (rank may exceed k) and the k most likely tokens."""
    rows = target.numel()
    positions = _rows_of(flat, rows)
    starts = [flat.start_indices[p] for p in positions]
    ends = [flat.end_indices[p] for p in positions]
    own = torch.empty(rows)
    top_ids = torch.zeros((rows, max(k, 0)), dtype=torch.long)
    top_lp = torch.zeros((rows, max(k, 0)))
    for p, (a, b) in enumerate(zip(starts, ends)):
        entry = dict(zip(flat.token_ids[a:b], flat.logprobs[a:b]))
        own[p] = entry[int(target[p])]
        if k > 0:
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            top_ids[p] = torch.tensor([t for t, _ in best])
            top_lp[p] = torch.tensor([v for _, v in best])
    return own, top_ids, top_lp
