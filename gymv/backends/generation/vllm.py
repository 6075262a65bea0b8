"""Generation with vLLM's engine (`generation.backend: vllm`): token ids + images in, ids + logprobs out.

The contract is the HF backend's (gymv.backends.generation.hf), so that a run can switch backends and keep
its numbers: the logprob of a token is that of `gymv.backends.sampling` (vision tokens at -inf, divided by
the temperature, before top-p; greedy reports temperature-1 logprobs), which vLLM gives with
`logprobs_mode="processed_logprobs"` and the vision ids left out of `allowed_token_ids`. With top_p < 1
vLLM's logprobs are the renormalised nucleus's, so an engine built with `full_logits` returns every raw
logit and the logprobs are computed here (docs/vllm.md). Vision tokens are never sampled for the same
reason; stop ids and strings stay in the output.

Two things vLLM does differently are handled here:
- vLLM expands image placeholders itself, and silently expands already expanded ones again. gymv's prompts
  carry expanded spans, so each span is collapsed to one placeholder before it is sent, and the prompt ids
  vLLM reports back are checked against gymv's (a mismatch is an error naming the request).
- vLLM's CPU build repacks linear weights after loading, so a refit goes through the worker's
  `reload_weights` (gymv.backends.generation.vllm_worker), then the prefix cache (KV blocks computed with
  the old weights) is always reset, and so is the encoder cache: vLLM's reload drops the cached image
  features itself, so with this backend no feature of older weights is ever reused, whatever the policy.

The engine runs in-process by default (one process: what the CPU tests and the CPU bench run). vLLM is an
optional dependency: it is imported when the backend is built, and its absence is a GymvError that names
the install command.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gymv.backends.generation.base import (
    GenerationBackend,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    Weights,
    named,
)
from gymv.backends.generation.vllm_models import VllmModel, engine_key_owner, refusal, vllm_model
from gymv.backends.multimodal import TextAdapter, make_adapter
from gymv.backends.registry import GENERATION_BACKENDS
from gymv.backends.policy import load_policy, load_processors
from gymv.errors import GymvError
from gymv.models.load import resolve_model_path
from gymv.models.quiet import quiet_transformers
from gymv.sections import VllmSection
# torch loads on first use: a driver that only looks this backend up by name does not pay for it

WORKER_EXTENSION = "gymv.backends.generation.vllm_worker.GymvWeightSync"


def import_vllm():
    """vLLM, configured for an in-process engine unless the environment already says otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the vLLM default (4) is sized for servers
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with the trainer
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise GymvError(f"generation.backend vllm needs the vllm package, which does not import here ({e})",
                        where="generation.backend", fix=GENERATION_BACKENDS.capabilities("vllm").needs.fix) from None
    return vllm


class VllmGenerationBackend(GenerationBackend):
    """One vLLM engine (an `LLM`), driven with token ids. Build it with `create`."""

    def __init__(self, llm, tokenizer, adapter, *, param_shapes: dict[str, tuple[int, ...]], vocab_size: int,
                 eos_token_ids: Sequence[int], seed: int = 0, chat_template: str | None = None,
                 model_path: str | None = None, dtype: str = "float32", family=None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.chat_template = chat_template
        self.model_path = model_path
        self.dtype = dtype
        self.param_shapes = param_shapes
        self.ties: dict[str, str] = {}  # set by create: a tied weight's name -> the name it shares a tensor with

        # gymv.backends.generation.vllm_models: the family's weight names and engine settings
        self.family = family if family is not None else VllmModel(None, Path(model_path or "."))
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.vocab_size = vocab_size
        forbidden = set(adapter.vision_token_ids) if adapter is not None else set()
        self.allowed_token_ids = [i for i in range(vocab_size) if i not in forbidden] if forbidden else None
        self._rng = random.Random(seed)
        # "auto": tensors in the call for an in-process engine, a shared-memory file otherwise; "file" forces the file
        self.weight_transfer = "auto"
        self._weights_hash: str | None = None
        # vLLM does not say which cached image features predate a refit, so there is no stale-hit count here
        self._stats = {"weight_updates": 0, "encoder_cache_resets": 0, "prefix_cache_resets": 0}
        self.last_timing: dict = {}
        self.full_logits = False  # set by create: logprobs computed here from every logit (top_p < 1)
        self.logprobs_mode = "processed_logprobs"  # set by create: what vLLM returns as logprobs

    @classmethod
    def create(cls, model_path: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
               vllm: VllmSection | None = None, full_logits: bool = False,
               max_model_len: int | None = None, max_images_per_prompt: int = 16,
               trust_remote_code: bool = False, logprobs_mode: str | None = None,
               max_logprobs: int | None = None, enable_expert_parallel: bool = False,
               engine_section: str = "generation.vllm") -> VllmGenerationBackend:
        """`vllm` is the engine's section as the recipe gives it (`generation.vllm`; a vllm teacher builds one
        from its own section), None: its defaults. Its `engine_kwargs` (NeMo RL's `vllm_kwargs`) go to
        `vllm.LLM` as they are; an argument gymv sets itself here, or one vLLM's engine does not have, is an
        error naming it at `<engine_section>.engine_kwargs`. `full_logits`: every logit of every sampled
        position comes back and gymv computes the logprobs (what top_p < 1 needs: vLLM's processed logprobs
        are the renormalised nucleus's, its raw ones lack the temperature and the vision-token mask).
        `logprobs_mode`/`max_logprobs` are vLLM's, for callers that read vLLM's outputs themselves (the vllm
        teacher)."""
        section = vllm if vllm is not None else VllmSection()
        path = resolve_model_path(model_path, seed=seed)
        refused = refusal(path, "cpu" if device == "cpu" else "cuda", dtype)
        if refused:
            raise GymvError(refused[0], where="generation.backend", fix=refused[1])
        vllm_lib = import_vllm()
        tokenizer, adapter, template, config, shapes, ties = load_processing(path, trust_remote_code=trust_remote_code)
        family = vllm_model(config, path)
        # a checkpoint vLLM's loader cannot read as saved (LLaVA's CLIP tower under transformers 5's names)
        # starts from dummy weights and gets its own through the refit path
        own_load = family.own_load(checkpoint_names(path))
        kwargs: dict[str, Any] = dict(trust_remote_code=trust_remote_code,
            model=str(path), tokenizer=str(path), dtype=dtype, seed=seed, enable_prefix_caching=True,
            logprobs_mode=logprobs_mode or ("raw_logits" if full_logits else "processed_logprobs"),
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=section.tensor_parallel_size,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if own_load:
            kwargs["load_format"] = "dummy"
        if enable_expert_parallel:  # MoE experts split over the engine's tensor-parallel GPUs
            kwargs["enable_expert_parallel"] = True
        if full_logits or max_logprobs is not None:
            kwargs["max_logprobs"] = -1 if max_logprobs is None else max_logprobs
        if adapter is not None and adapter.style != "text":
            kwargs["limit_mm_per_prompt"] = {"image": max_images_per_prompt}
        if device == "cpu":
            # Whole prefills only: vLLM 0.32 rewinds a seeded request's generator after a partial (chunked)
            # prefill step, which CPU generators cannot do ("CPU Generator does not use offset").
            text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
            longest = max_model_len or int(getattr(text_cfg, "max_position_embeddings", 0) or 8192)
            kwargs.update(enforce_eager=True, distributed_executor_backend="uni", enable_chunked_prefill=False,
                          max_num_batched_tokens=max(longest, 8192))
        else:
            kwargs.update(enforce_eager=section.enforce_eager, gpu_memory_utilization=section.gpu_memory_utilization)
        kwargs.update(family.engine_kwargs(device=device, dtype=dtype,
                                           chunked_prefill=kwargs.get("enable_chunked_prefill", True)))
        kwargs.update(checked_engine_kwargs(section.engine_kwargs, kwargs, engine_section))

        with quiet_transformers():
            llm = vllm_lib.LLM(**kwargs)
        import logging

        # in-process, vLLM's CPU worker turns torch.set_num_threads into a no-op that warns on every call
        # (set after the engine exists: building it reconfigures vLLM's loggers)
        logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        eos = {tokenizer.eos_token_id}
        gen_cfg = path / "generation_config.json"
        if gen_cfg.exists():
            import json

            v = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos |= set(v if isinstance(v, list) else [v])
        text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        backend = cls(llm, tokenizer, adapter, param_shapes=shapes, vocab_size=int(text_cfg.vocab_size),
                      eos_token_ids=[i for i in eos if i is not None], seed=seed, chat_template=template,
                      model_path=str(path), dtype=dtype, family=family)
        backend.full_logits = full_logits
        backend.ties = ties
        backend.logprobs_mode = kwargs["logprobs_mode"]
        if own_load:
            backend._load(family.checkpoint_to_engine(read_checkpoint(path)))
            llm.reset_prefix_cache()
        return backend

    # -- prompts -------------------------------------------------------------------------------------
    def _collapse(self, ids: list[int], images: Sequence[Any]) -> list[int]:
        """`ids` with each image's expansion (the adapter's `image_token_ids`: its placeholder run, with the
        markers around it where the family has them) reduced to the one token vLLM expands."""
        if not images:
            return list(ids)
        spans = [self.adapter.image_token_ids(im) for im in images]
        out: list[int] = []
        i = k = 0
        while i < len(ids):
            span = spans[k] if k < len(spans) else None
            if span and ids[i] == span[0] and ids[i:i + len(span)] == span:
                out.append(self.adapter.image_token_id)
                i += len(span)
                k += 1
            else:
                out.append(ids[i])
                i += 1
        return out

    def _prompt(self, r: GenerationRequest) -> dict:
        prompt: dict[str, Any] = {"prompt_token_ids": self._collapse(list(r.prompt_token_ids), r.images)}
        if r.images:
            prompt["multi_modal_data"] = {"image": [im.convert("RGB") if im.mode != "RGB" else im for im in r.images]}
        return prompt

    def _sampling(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VllmParams

        return VllmParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
            seed=seed, logprobs=-1 if self.full_logits else 0, flat_logprobs=self.full_logits,
            stop_token_ids=list(params.stop_token_ids),
            stop=[s for s in params.stop_strings if s] or None, include_stop_str_in_output=True,
            ignore_eos=params.ignore_eos, allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=False, spaces_between_special_tokens=False, detokenize=bool(params.stop_strings),
        )

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        params.validate()
        if params.top_p < 1.0 and not self.full_logits and params.temperature > 0:
            raise GymvError(f"top_p {params.top_p} on a vLLM engine built without full_logits: its logprobs would be "
                            "the renormalised nucleus's, not the trainer's", where="generation.top_p",
                            fix="build the engine with VllmGenerationBackend.create(..., full_logits=True) "
                                "(gymv train does when generation.top_p < 1), or set top_p to 1.0")
        for i, r in enumerate(requests):
            where = r.where or f"request {i}"
            if not r.prompt_token_ids:
                raise GymvError("empty prompt", where=where, fix="render at least one message before generating")
            if self.adapter is not None:
                self.adapter.check(r.prompt_token_ids, r.images, where=where)
            elif r.images:
                raise GymvError("this model takes no images", where=where, fix="send text-only requests")
        if not requests:
            return []
        t0 = time.perf_counter()
        # one seed per request: the G samples of a group share a prompt and must still differ
        base = params.seed if params.seed is not None else self._rng.randrange(2 ** 31)
        sampling = [self._sampling(params, (base + i) % 2 ** 31) for i in range(len(requests))]
        results = self.llm.generate([self._prompt(r) for r in requests], sampling, use_tqdm=False)
        outs = []
        for i, (r, res) in enumerate(zip(requests, results)):
            check_expansion(res.prompt_token_ids, r.prompt_token_ids, where=r.where or f"request {i}",
                            fix="the checkpoint's processor settings and vLLM's disagree; use generation.backend: hf")
            outs.append(self._output(res.outputs[0], params))
        n_new = sum(len(o.token_ids) for o in outs)
        total = time.perf_counter() - t0
        self.last_timing = {"total_s": total, "new_tokens": n_new, "batch": len(requests)}
        return outs

    def _output(self, c, params: SamplingParams) -> GenerationOutput:
        ids = list(c.token_ids)
        if self.full_logits:
            logprobs = self._policy_logprobs(ids, c.logprobs, params.temperature)
        else:
            logprobs = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [])]
        if len(logprobs) != len(ids):
            raise GymvError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens", where="generation",
                            fix="report this: vLLM's logprob output changed")
        finish = "length" if c.finish_reason == "length" else "stop"
        stop = c.stop_reason
        if finish == "stop" and stop is None and ids:
            stop = ids[-1]  # the end-of-turn token
        return GenerationOutput(token_ids=ids, logprobs=logprobs,
                                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                finish_reason=finish, stop_reason=stop)

    def _policy_logprobs(self, ids: list[int], flat, temperature: float) -> list[float]:
        """gymv's logprobs of the sampled `ids` (gymv.backends.sampling) from vLLM's raw logits of each step."""
        import torch

        from gymv.backends.sampling import forbidden_mask, policy_logits

        if flat is None or len(flat) != len(ids):
            return []  # the caller's length check names it
        logits = flat_to_dense(flat, range(len(ids)), self.vocab_size)
        vision = self.adapter.vision_token_ids if self.adapter is not None else ()
        forbidden = forbidden_mask(logits.shape[-1], vision, logits.device)
        lsm = torch.log_softmax(policy_logits(logits, temperature, forbidden), dim=-1)
        return lsm.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()

    # -- weights -------------------------------------------------------------------------------------
    def update_weights(self, weights: Weights) -> None:
        incoming = named(weights)
        for name, value in incoming.items():  # every check before the first copy: all or nothing
            if name not in self.param_shapes:
                raise GymvError(f"refit sent a weight the model does not have: {name}", where="refit",
                                fix="training and generation must load the same architecture (model.path)")
            if tuple(value.shape) != self.param_shapes[name]:
                raise GymvError(f"refit sent {name} with shape {tuple(value.shape)}; the model's has shape "
                                f"{self.param_shapes[name]}", where="refit",
                                fix="training and generation must load the same architecture (model.path)")
        missing = sorted(n for n in self.param_shapes if n not in incoming and self.ties.get(n) not in incoming)
        if missing:
            raise GymvError(f"refit sent {len(incoming)} of the model's {len(self.param_shapes)} weights (missing "
                            f"{', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''}): vLLM's in-place "
                            "reload rebuilds every layer the refit touches from the weights sent, and fills what a "
                            "layer was not sent with uninitialised memory; nothing was loaded", where="refit",
                            fix="send every weight (a trainer's named_weights do); to change some, send the rest as they are")
        self._load(self.family.to_engine(incoming))
        self.llm.reset_prefix_cache()
        self._stats["prefix_cache_resets"] += 1
        # vLLM's reload drops the model runner's image features whatever gymv's policy says, so the
        # scheduler's record of them must go too, or the next request with a known image finds nothing
        self.llm.llm_engine.reset_encoder_cache()
        self._stats["weight_updates"] += 1
        from gymv.backends.weights import weights_hash

        sent = {**incoming, **{t: incoming[c] for t, c in self.ties.items() if t not in incoming}}
        self._weights_hash = weights_hash(sent, _torch_dtype(self.dtype))

    def _load(self, weights: dict) -> None:
        """Weights under the names vLLM's loader takes. In-process: the tensors themselves; across processes:
        one safetensors file in shared memory."""
        direct = self.family.direct_params(weights)
        if self.weight_transfer == "auto" and _in_process():
            self.llm.collective_rpc("gymv_load_weights", kwargs={"weights": list(weights.items()), "direct": direct})
            return
        from safetensors.torch import save_file

        folder = "/dev/shm" if Path("/dev/shm").is_dir() else None
        fd, path = tempfile.mkstemp(prefix="gymv-refit-", suffix=".safetensors", dir=folder)
        os.close(fd)
        try:
            save_file({k: v.detach().to("cpu", copy=False).contiguous() for k, v in weights.items()}, path)
            self.llm.collective_rpc("gymv_load_weights_file", kwargs={"path": path, "direct": direct})
        finally:
            os.unlink(path)

    def probe_logprobs(self, token_ids: Sequence[int], images: Sequence[Any] = ()) -> list[float]:
        """vLLM's prompt logprobs of the sequence: raw log-softmax in its logprob modes, computed here from every
        logit in its logit modes (`full_logits` engines)."""
        import torch
        from vllm import SamplingParams as VllmParams

        ids = list(token_ids)
        req = GenerationRequest(ids, list(images), where="refit probe")
        if self.adapter is not None:
            self.adapter.check(ids, req.images, where=req.where)
        logits = self.logprobs_mode.endswith("_logits")
        params = VllmParams(max_tokens=1, temperature=0.0, detokenize=False, flat_logprobs=True,
                            prompt_logprobs=-1 if logits else 0)
        res = self.llm.generate([self._prompt(req)], params, use_tqdm=False)[0]
        if list(res.prompt_token_ids) != ids or res.prompt_logprobs is None or len(res.prompt_logprobs) != len(ids):
            raise GymvError("vLLM scored the refit probe as another sequence than gymv sent", where="refit.check",
                            fix="set refit.check.mode: off for this engine, and report it")
        flat = res.prompt_logprobs
        if logits:
            dense = flat_to_dense(flat, range(1, len(ids)), self.vocab_size)
            lsm = torch.log_softmax(dense, dim=-1)
            return lsm.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
        out = []
        for p in range(1, len(ids)):
            a, b = flat.start_indices[p], flat.end_indices[p]
            out.append(float(dict(zip(flat.token_ids[a:b], flat.logprobs[a:b]))[ids[p]]))
        return out

    def reset_encoder_cache(self) -> None:
        engine = self.llm.llm_engine
        engine.reset_encoder_cache()
        self._stats["encoder_cache_resets"] += 1

    def weights_hash(self) -> str:
        """Hash of the weights last sent (as the trainer hashes them, in the generation dtype); before the first
        refit, of the checkpoint the engine was built from. What the engine holds is proved by the refit
        check (`probe_logprobs`), not by this."""
        if self._weights_hash is None:
            from gymv.backends.weights import weights_hash

            policy = load_policy(self.model_path, dtype=_torch_dtype(self.dtype))
            self._weights_hash = weights_hash(policy.model.state_dict())
        return self._weights_hash

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            del llm
            import gc

            gc.collect()


def check_expansion(vllm_ids: Sequence[int], gymv_ids: Sequence[int], *, where: str, fix: str) -> None:
    """Refuse a prompt whose image placeholders vLLM expanded differently from gymv: its logprobs would
    belong to other positions than the ones gymv trains on."""
    if list(vllm_ids) != list(gymv_ids):
        raise GymvError("vLLM expanded the image placeholders of this prompt differently from gymv "
                        f"({len(vllm_ids)} prompt ids, gymv has {len(gymv_ids)})", where=where, fix=fix)


def flat_to_dense(flat, positions, vocab: int):
    """[len(positions), vocab] float32 values from a vLLM FlatLogprobs whose `positions` hold every token
    (`logprobs=-1` or `prompt_logprobs=-1`); a token absent from a position stays -inf."""
    import torch

    starts = [flat.start_indices[p] for p in positions]
    ends = [flat.end_indices[p] for p in positions]
    rows = len(starts)
    out = torch.full((rows, vocab), float("-inf"))
    if not rows:
        return out
    span = slice(starts[0], ends[-1])
    ids = torch.tensor(flat.token_ids[span], dtype=torch.long)
    values = torch.tensor(flat.logprobs[span], dtype=torch.float32)
    lengths = torch.tensor(ends) - torch.tensor(starts)
    out[torch.repeat_interleave(torch.arange(rows), lengths), ids] = values
    return out


def _in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def checked_engine_kwargs(extra: dict[str, Any], gymv_set: dict[str, Any], section: str) -> dict[str, Any]:
    """`extra` (a recipe's engine_kwargs), once none of its keys is one gymv set (`gymv_set`) and each is an
    argument of vLLM's engine (`vllm.engine.arg_utils.EngineArgs`)."""
    if not extra:
        return {}
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in extra:
        where = f"{section}.engine_kwargs.{key}"
        if key in gymv_set:
            gymv_key, what = engine_key_owner(key, section)
            raise GymvError(f"gymv sets vLLM's {key} itself here ({what}" + (f", from {gymv_key})" if gymv_key else ")"),
                            where=where, fix=f"set {gymv_key} instead" if gymv_key else f"remove {key}: gymv decides it")
        if key not in known:
            raise GymvError(f"vLLM's engine has no argument {key!r}", where=where,
                            fix="use an argument of vllm.engine.arg_utils.EngineArgs (`vllm serve --help` lists "
                                "them with dashes), or remove it")
    return dict(extra)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name) if name != "auto" else None


def checkpoint_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names += list(st.keys())
    return names


def read_checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_processing(path: Path, *, trust_remote_code: bool = False):
    """(tokenizer, adapter (a TextAdapter for a text-only model), chat template, config, {weight name: shape},
    {tied name: the name it shares a tensor with}) without loading weights: vLLM loads the weights; gymv needs what renders prompts and what refits are
    checked against."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    with quiet_transformers():
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        vision = hasattr(config, "vision_config")
        if vision:
            processor_class, hf_processor, tokenizer, image_processor, _ = load_processors(path, trust_remote_code)
            adapter = make_adapter(processor_class, tokenizer, image_processor, config, hf_processor)
            template = getattr(hf_processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        else:  # the rollout renders a text model's turns through the text adapter, as with the hf backend
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            adapter, template = TextAdapter(tokenizer, config=config), getattr(tokenizer, "chat_template", None)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        with torch.device("meta"):
            skeleton = auto.from_config(config)
    state = skeleton.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    first: dict[int, str] = {}
    ties = {k: first.setdefault(id(v), k) for k, v in state.items()}  # a tied name -> the first of its tensor
    return tokenizer, adapter, template, config, shapes, {k: v for k, v in ties.items() if k != v}
