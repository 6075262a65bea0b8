"""Load a policy checkpoint with its tokenizer, image processor and processor adapter.

The path is resolved by `gymv.models.load.resolve_model_path` (a folder, a cached hub id or an embedded tiny
model); the adapter that tells the backends how images become tokens comes from `gymv.backends.multimodal`.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv.backends import moe_experts
from gymv.backends.multimodal import SUPPORTED_PROCESSORS, TextAdapter, make_adapter, supported_text
from gymv.errors import GymvError
from gymv.models.config_check import check_checkpoint
from gymv.models.load import resolve_model_path
from gymv.models.nemotron_omni import OmniImageProcessor
from gymv.models.quiet import quiet_transformers


@dataclass
class Policy:
    """A loaded policy. `processor` is the transformers processor when it loads here, else None (see docs)."""

    model: Any
    tokenizer: Any
    image_processor: Any
    adapter: Any
    processor: Any
    path: Path
    chat_template: str | None
    info: dict = field(default_factory=dict)


def _processor_class(path: Path) -> str:
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = path / name
        if f.exists():
            cls = json.loads(f.read_text()).get("processor_class")
            if cls:
                return cls
    return ""


def _omni_image_processor(ckpt: Path):
    f = ckpt / "preprocessor_config.json"
    if not f.exists():
        raise GymvError("the checkpoint has no preprocessor_config.json", where=str(ckpt),
                        fix="save the image processor config with the model")
    return OmniImageProcessor.from_dict(json.loads(f.read_text()))


# processor class -> the loader of gymv's own image processor for families whose transformers image
# processor needs torchvision (used wherever the checkpoint loads, so pixels are the same everywhere)
OWN_IMAGE_PROCESSORS = {"NemotronH_Omni_Reasoning_V3Processor": _omni_image_processor}


def load_policy(path: str | os.PathLike, device: str = "cpu", dtype: Any = None, *,
                cache_dir: str | os.PathLike | None = None, seed: int = 0,
                attn_implementation: str | None = None, trust_remote_code: bool = False,
                skeleton: bool = False) -> Policy:
    """Load model + tokenizer + image processor, and choose the multimodal adapter from the processor.

    A checkpoint whose config has no `vision_config` is a text-only causal LM: it loads with
    AutoModelForCausalLM and the text adapter (no image processor is looked for). Otherwise the composite
    processor is loaded with AutoProcessor where possible; where it cannot be (Qwen2-VL's
    processor needs torchvision for its video half), the same parts are loaded one by one, which is all
    gymv needs. An unsupported processor class fails here with the list of supported ones.

    `trust_remote_code` (the recipe's `model.trust_remote_code`, off by default) lets every from_pretrained
    run modelling code shipped inside the checkpoint; a checkpoint that needs it fails here in one line.

    `skeleton`: the model is built on the meta device and no weight is read, for a caller that reads its own
    share of them (a Megatron rank: gymv.backends.model_weights).
    """
    import torch

    ckpt = resolve_model_path(path, cache_dir=cache_dir, seed=seed)
    dtype = dtype if dtype is not None else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    check_remote_code(ckpt, trust_remote_code)
    check_checkpoint(ckpt)
    with quiet_transformers():
        return _load(ckpt, device, dtype, attn_implementation, trust_remote_code, skeleton)


def check_remote_code(ckpt: Path, trust_remote_code: bool) -> None:
    """A checkpoint whose model type transformers does not know runs only with its own code (`auto_map`)."""
    if trust_remote_code:
        return
    from transformers import CONFIG_MAPPING

    try:
        config = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader reports an unreadable config itself
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        raise GymvError(f"the checkpoint's model type {config.get('model_type')!r} exists only in code shipped inside "
                        "it (auto_map), which gymv runs only when told to", where=str(ckpt),
                        fix="set model.trust_remote_code: true if you trust that code")


def is_text_only(path: str | os.PathLike) -> bool:
    """A checkpoint without a vision tower: its config.json has no `vision_config`."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise GymvError(f"cannot read config.json: {e}", where=str(path),
                        fix="point at a Hugging Face checkpoint folder") from None
    return "vision_config" not in config


def _model_kwargs(dtype, attn_implementation: str | None, trust: bool) -> dict:
    """from_pretrained keywords shared by the text-only and the vision-language loaders."""
    kwargs = {"dtype": dtype, "trust_remote_code": trust}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def load_weights(auto_class, ckpt: str | os.PathLike, what: str, fix: str, **kwargs):
    """`auto_class.from_pretrained(ckpt)`, refusing a checkpoint whose tensors do not fill the model exactly.

    transformers loads a config that disagrees with its weights: a stored tensor the model has no place for is
    dropped, a parameter the checkpoint lacks is left at its random init, one of another shape is re-initialised,
    and training goes on. Each is an error here naming the first few tensors and their count (weights tied to
    another, such as an lm_head tied to the embeddings, are not reported missing by transformers). A config
    transformers refuses (a wrong type, an invalid value) is one line too, not its traceback."""
    from huggingface_hub.errors import StrictDataclassError

    where = str(ckpt)
    try:
        with _no_load_report():  # its findings are the error below, in one line
            model, info = auto_class.from_pretrained(ckpt, output_loading_info=True, ignore_mismatched_sizes=True,
                                                     **kwargs)
    except StrictDataclassError as e:
        reason = " ".join(str(e).split())
        raise GymvError(f"transformers refuses config.json: {reason[:300]}", where=str(Path(ckpt) / "config.json"),
                        fix="restore the key it names to the value the weights were saved with") from None
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: state-dict errors, failed weight conversions
        raise GymvError(f"cannot load {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", where=where,
                        fix=fix) from None
    check_loading_info(info, where)
    return model


def meta_model(auto_class, ckpt: str | os.PathLike, what: str, fix: str, **kwargs):
    """The model of the checkpoint's config.json on the meta device: its modules, names, shapes and dtypes, and no
    memory for its weights. A config transformers refuses is one line, as in `load_weights`."""
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ckpt, trust_remote_code=kwargs.get("trust_remote_code", False))
        with torch.device("meta"):
            return auto_class.from_config(config, **kwargs)
    except StrictDataclassError as e:
        reason = " ".join(str(e).split())
        raise GymvError(f"transformers refuses config.json: {reason[:300]}", where=str(Path(ckpt) / "config.json"),
                        fix="restore the key it names to the value the weights were saved with") from None
    except (ValueError, OSError) as e:
        raise GymvError(f"cannot build {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                        where=str(ckpt), fix=fix) from None


@contextmanager
def _no_load_report():
    """transformers' loading report (a table of unexpected, missing and mis-shaped tensors) kept off stderr."""
    import logging

    log = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    log.addFilter(drop)  # a filter, not a level: transformers runs other checks when this logger's level is raised
    try:
        yield
    finally:
        log.removeFilter(drop)


class _DropLoadReport:
    def filter(self, record) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def check_loading_info(info: dict, where: str) -> None:
    """Raise on transformers' loading info holding unused, missing or mis-shaped tensors (see load_weights)."""
    problems = [
        ("stored tensors the model has no place for (the config describes fewer or other layers than the weights)",
         sorted(info.get("unexpected_keys") or ())),
        ("model tensors the checkpoint lacks (they would train from random values)",
         sorted(info.get("missing_keys") or ())),
        ("tensors whose stored shape differs from the config's",
         sorted(f"{name} {tuple(stored)} vs {tuple(model)}" for name, stored, model in info.get("mismatched_keys") or ())),
    ]
    for text, names in problems:
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise GymvError(f"the checkpoint does not match its config.json: {len(names)} {text}: {shown}",
                            where=where, fix="fix config.json (layer pattern, sizes, expert counts) to describe the "
                                             "saved weights, or point at the checkpoint this config belongs to")
    if info.get("error_msgs"):
        raise GymvError(f"the checkpoint's weights failed to load: {str(info['error_msgs'][0]).splitlines()[0]}",
                        where=where, fix="re-save the checkpoint")


def _eval_model(auto_class, ckpt: Path, device, kwargs: dict, what: str, fix: str, skeleton: bool = False):
    """`auto_class.from_pretrained` on `device` in eval mode; a checkpoint it cannot load is one line naming it.
    `skeleton`: the model of the checkpoint's config on the meta device instead, its weights unread."""
    if skeleton:
        return meta_model(auto_class, ckpt, what, fix, **kwargs).eval()
    model = load_weights(auto_class, ckpt, what, fix, **kwargs)
    _own_storage(model)
    model.to(device)
    model.eval()
    moe_experts.install(model)  # Nemotron-H's routed experts: grouped, no host sync (gymv.backends.moe_experts)
    return model


def _own_storage(model) -> None:
    """Give each weight its own storage where loading left it a view into a larger one (transformers splits a
    checkpoint's fused tensors, such as RADIO's qkv, into views of the one it read): safetensors refuses to
    save such a view, and a trainer's checkpoints are written with it."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t.data = t.detach().clone()


def _load_text(ckpt: Path, device, dtype, attn_implementation, trust: bool, skeleton: bool = False) -> Policy:
    """A text-only causal LM: tokenizer and AutoModelForCausalLM, no processor looked for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=trust)
    model = _eval_model(AutoModelForCausalLM, ckpt, device, _model_kwargs(dtype, attn_implementation, trust),
                        "a causal language model", "a text-only checkpoint must load with AutoModelForCausalLM",
                        skeleton)
    adapter = TextAdapter(tokenizer, config=model.config)
    info = {"processor_class": None, "style": adapter.style, "model_class": type(model).__name__}
    return Policy(model=model, tokenizer=tokenizer, image_processor=None, adapter=adapter, processor=None, path=ckpt,
                  chat_template=getattr(tokenizer, "chat_template", None), info=info)


def load_processors(ckpt: Path, trust: bool = False):
    """(processor class name, transformers processor or None, tokenizer, image processor, why the processor
    did not load or None) of a vision-language checkpoint: what the policy and the vLLM backend render with."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    processor_class = _processor_class(ckpt)
    hf_processor, why = None, None
    # where gymv brings the image processor, transformers' needs torchvision and says so in a ValueError
    missing = (ImportError, ValueError) if processor_class in OWN_IMAGE_PROCESSORS else ImportError
    try:
        hf_processor = AutoProcessor.from_pretrained(ckpt, trust_remote_code=trust)
        processor_class = type(hf_processor).__name__
        tokenizer = hf_processor.tokenizer
        image_processor = getattr(hf_processor, "image_processor", None)
    except missing as e:  # a sub-processor (e.g. video) needs a package that is not installed
        why = " ".join(str(e).split()).split(". ")[0]
        tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=trust)
        image_processor = (None if processor_class in OWN_IMAGE_PROCESSORS
                           else AutoImageProcessor.from_pretrained(ckpt, trust_remote_code=trust))
    if processor_class in OWN_IMAGE_PROCESSORS:
        image_processor = OWN_IMAGE_PROCESSORS[processor_class](ckpt)
    if processor_class not in SUPPORTED_PROCESSORS:
        raise GymvError(f"unsupported processor {processor_class or '(none found)'!r}", where=str(ckpt),
                        fix=f"gymv supports: {supported_text()}")
    return processor_class, hf_processor, tokenizer, image_processor, why


def _load(ckpt: Path, device, dtype, attn_implementation, trust: bool = False, skeleton: bool = False) -> Policy:
    from transformers import AutoModelForImageTextToText

    if is_text_only(ckpt):
        return _load_text(ckpt, device, dtype, attn_implementation, trust, skeleton)
    processor_class, hf_processor, tokenizer, image_processor, why = load_processors(ckpt, trust)
    model = _eval_model(AutoModelForImageTextToText, ckpt, device, _model_kwargs(dtype, attn_implementation, trust),
                        "an image-text-to-text model",
                        "gymv trains vision-language models loadable with AutoModelForImageTextToText", skeleton)
    adapter = make_adapter(processor_class, tokenizer, image_processor, model.config, hf_processor)
    template = getattr(hf_processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    info = {"processor_class": processor_class, "style": adapter.style, "model_class": type(model).__name__}
    if why:
        info["processor_fallback"] = why
    return Policy(model=model, tokenizer=tokenizer, image_processor=image_processor, adapter=adapter,
                  processor=hf_processor, path=ckpt, chat_template=template, info=info)
