"""Nemotron 3 Omni's image preprocessing: flattened patches and a per-image patch grid (`image_grid_hw`).

transformers ships this family's image processor only in its torchvision flavour, which is not installed
with gymv; this module does the same computation with torch alone, so a checkpoint of the family loads
anywhere. An image is resized (bicubic, antialiased, in float32 so the overshoot is kept) to a patch grid
close to its own size, both sides a multiple of the pixel-shuffle factor, with between `min_num_patches`
and the patch budget patches; normalised; and cut into row-major patches of `3 * patch_size**2` values,
channel-major inside a patch. After the model's pixel shuffle, one image takes `h * w / merge**2` tokens.

The budget is the same for every image of one processor call and comes from `max_model_len`, clamped to
`[min_num_patches, max_num_patches]`; gymv preprocesses each image on its own (a turn's image must not
change size when a later turn adds images), so a config whose budget would depend on how many images
share a call is refused (:func:`check_budget`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gymv.errors import GymvError

PROCESSOR_CLASS = "NemotronH_Omni_Reasoning_V3Processor"
IMAGE_PROCESSOR_TYPE = "NemotronH_Omni_Reasoning_V3ImageProcessor"
IMAGE_TOKEN, IMAGE_START, IMAGE_END, VIDEO_TOKEN = "<image>", "<img>", "</img>", "<video>"
VISION_TOKENS = [IMAGE_TOKEN, IMAGE_START, IMAGE_END, VIDEO_TOKEN]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's code for bicubic resampling, as processor configs store it


def patch_grid(height: int, width: int, patch_size: int, merge: int, min_patches: int, budget: int) -> tuple[int, int]:
    """The (rows, cols) of patches an image of `height` x `width` px is resized to.

    Start from the image's own grid (each side one patch more unless it divides exactly), shrink it into the
    budget, grow it to `min_patches` when the budget allows more, then round each side to a multiple of
    `merge`: up while the grid stays within the budget, else down (never below `merge`)."""
    rows = round(height / patch_size + 0.5)
    cols = round(width / patch_size + 0.5)
    shrink = min(math.sqrt(budget / (rows * cols)), 1.0)
    rows, cols = math.floor(shrink * rows), math.floor(shrink * cols)
    if budget > min_patches and rows * cols < min_patches:
        grow = math.sqrt(min_patches / (rows * cols))
        rows, cols = math.ceil(grow * rows), math.ceil(grow * cols)
    if rows % merge:
        rows = rows + merge - rows % merge if (rows + merge - rows % merge) * cols <= budget else max(merge, rows - rows % merge)
    if cols % merge:
        cols = cols + merge - cols % merge if rows * (cols + merge - cols % merge) <= budget else max(merge, cols - cols % merge)
    return rows, cols


def patch_budget(n_images: int, *, merge: int, min_patches: int, max_patches: int, max_model_len: int) -> int:
    """Patches each image of a call of `n_images` may take (the context length bounds them, in
    pre-shuffle patches, unless `max_patches` is lower; never below `min_patches`)."""
    budget = max((max_model_len - 4) * merge ** 2, min_patches * n_images)
    if max_patches:
        budget = min(budget, max_patches)
    return max(budget, min_patches)


def _rgb_array(image):
    """The image as an RGB uint8 array; transparency is composited onto white, as the family's processor does."""
    import numpy as np
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


class OmniImageProcessor:
    """The family's image processor (see the module docstring); built from its preprocessor config."""

    model_input_names = ["pixel_values", "image_grid_hw"]

    def __init__(self, *, patch_size: int = 16, downsample_ratio: float = 0.5, min_num_patches: int = 1024,
                 max_num_patches: int = 13312, max_model_len: int = 16384, image_mean: Sequence[float] = CLIP_MEAN,
                 image_std: Sequence[float] = CLIP_STD, rescale_factor: float = 1 / 255, do_rescale: bool = True,
                 do_normalize: bool = True, resample: int = BICUBIC, **_: Any):
        self.patch_size = int(patch_size)
        self.downsample_ratio = float(downsample_ratio)
        self.merge_size = round(1 / self.downsample_ratio)
        self.min_num_patches = int(min_num_patches)
        self.max_num_patches = int(max_num_patches)
        self.max_model_len = int(max_model_len)
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor, self.do_rescale, self.do_normalize = float(rescale_factor), do_rescale, do_normalize
        if int(resample) != BICUBIC:
            raise GymvError(f"resample {resample} is not supported for {IMAGE_PROCESSOR_TYPE}",
                            where="preprocessor_config.json", fix=f'set "resample": {BICUBIC} (bicubic)')

    @classmethod
    def from_dict(cls, cfg: dict) -> OmniImageProcessor:
        cfg = dict(cfg)
        cfg.setdefault("image_mean", cfg.pop("norm_mean", CLIP_MEAN))  # released checkpoints' names
        cfg.setdefault("image_std", cfg.pop("norm_std", CLIP_STD))
        return cls(**cfg)

    def budget(self, n_images: int = 1) -> int:
        return patch_budget(n_images, merge=self.merge_size, min_patches=self.min_num_patches,
                            max_patches=self.max_num_patches, max_model_len=self.max_model_len)

    def check_budget(self, where: str) -> None:
        """Refuse a config whose per-image budget changes with the number of images in a call."""
        if self.budget(1) != self.budget(1 << 12):
            raise GymvError(
                f"the image patch budget depends on how many images share a call (max_num_patches "
                f"{self.max_num_patches}, min_num_patches {self.min_num_patches}, max_model_len {self.max_model_len}), "
                "so an image's token count would change when a later turn adds images", where=where,
                fix="set max_num_patches in preprocessor_config.json to a value of at least min_num_patches and at "
                    "most (max_model_len - 4) * (1/downsample_ratio)**2")

    def grid(self, image) -> tuple[int, int]:
        """The (rows, cols) patch grid of one image."""
        w, h = image.size
        return patch_grid(h, w, self.patch_size, self.merge_size, self.min_num_patches, self.budget(1))

    def tokens(self, image) -> int:
        rows, cols = self.grid(image)
        return rows * cols // self.merge_size ** 2

    def _one(self, image):
        import torch
        import torch.nn.functional as F

        rows, cols = self.grid(image)
        x = torch.from_numpy(_rgb_array(image).copy()).permute(2, 0, 1)[None].to(torch.float32)
        size = (rows * self.patch_size, cols * self.patch_size)
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
        if self.do_normalize:
            scale = 1.0 / self.rescale_factor if self.do_rescale else 1.0
            mean = torch.tensor(self.image_mean) * scale
            std = torch.tensor(self.image_std) * scale
            x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
        elif self.do_rescale:
            x = x * self.rescale_factor
        p = self.patch_size
        x = x.reshape(1, 3, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(rows * cols, 3 * p * p)
        return x, (rows, cols)

    def __call__(self, images: Sequence, return_tensors: str | None = "pt", **_: Any) -> dict:
        """`pixel_values` [total patches, 3*patch**2] and `image_grid_hw` [images, 2], images in order."""
        import torch

        parts = [self._one(im) for im in images]
        return {"pixel_values": torch.cat([x for x, _ in parts]),
                "image_grid_hw": torch.tensor([g for _, g in parts], dtype=torch.long).reshape(-1, 2)}

    def to_dict(self) -> dict:
        """The preprocessor_config.json the family's transformers processor reads."""
        return {"image_processor_type": IMAGE_PROCESSOR_TYPE, "processor_class": PROCESSOR_CLASS,
                "patch_size": self.patch_size, "downsample_ratio": self.downsample_ratio,
                "min_num_patches": self.min_num_patches, "max_num_patches": self.max_num_patches,
                "max_model_len": self.max_model_len, "image_mean": self.image_mean, "image_std": self.image_std,
                "do_rescale": self.do_rescale, "rescale_factor": self.rescale_factor,
                "do_normalize": self.do_normalize, "do_convert_rgb": True, "resample": BICUBIC}


# ---------------------------------------------------------------------------------- config.json checks

LAYER_KINDS = ("linear_attention", "full_attention", "moe", "mlp")
PATTERN_LETTERS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # names transformers still reads
_KIND_OF_TENSOR = (("A_log", "linear_attention"), ("q_proj", "full_attention"), ("gate", "moe"),
                   ("experts", "moe"), ("up_proj", "mlp"))
_LAYER_TENSOR = re.compile(r"^(?:language_model\.)?(?:backbone|model)\.layers\.(\d+)\.mixer\.(\w+)")


def check_config(ckpt: Path, config: dict) -> None:
    """A Nemotron 3 Omni config.json (`nemotron_h_omni`): its decoder section (`text_config`, or the released
    checkpoints' `llm_config`) as :func:`check_text_config` checks it, its RADIO tower and the projector between.
    Each failure is one line naming the key."""
    from gymv.models.config_check import Keys

    top = Keys(ckpt, config)
    text_key = "text_config" if "text_config" in config or "llm_config" not in config else "llm_config"
    text = top.section_of(text_key)
    vocab = _check_text(ckpt, text, f"{text_key}.")
    vision = Keys(ckpt, top.section_of("vision_config"), "vision_config.")
    vision.choice("model_type", ("radio",), 'set `vision_config.model_type` to "radio" (the family\'s tower)')
    width = vision.int("hidden_size")
    heads = vision.int("num_attention_heads")
    if width % heads:
        raise vision.fail("hidden_size", f"({width}) is not a multiple of num_attention_heads ({heads})",
                          "set vision_config.num_attention_heads to a divisor of vision_config.hidden_size")
    vision.int("num_hidden_layers")
    vision.int("patch_size")
    vision.int("num_cls_tokens", minimum=0, required=False)
    vision.int("num_registers", minimum=0, required=False)
    ratio = top.number("downsample_ratio")
    if ratio is not None and (ratio > 1 or abs(1 / ratio - round(1 / ratio)) > 1e-6):
        raise top.fail("downsample_ratio", f"is {ratio:g}, not 1/n for a whole n",
                       "set `downsample_ratio` to 0.5 (a 2x2 pixel shuffle) or another 1/n")
    top.int("projector_hidden_size", required=False)
    tower = top.int("vision_hidden_size", required=False)
    if tower is not None and tower != width:
        raise top.fail("vision_hidden_size", f"is {tower}, the tower's vision_config.hidden_size is {width}",
                       f"set `vision_hidden_size` to {width}")
    frames = top.int("video_temporal_patch_size", required=False)
    tower_frames = vision.int("video_temporal_patch_size", required=False)
    if frames is not None and tower_frames is not None and frames != tower_frames:
        raise top.fail("video_temporal_patch_size", f"is {frames}, vision_config.video_temporal_patch_size is "
                       f"{tower_frames}", "set both to the same number of frames")
    for key in ("image_token_id", "video_token_id", "audio_token_id"):
        token = top.int(key, minimum=0, required=key == "image_token_id")
        if token is not None and token >= vocab:
            raise top.fail(key, f"is {token}, outside the vocabulary of {vocab} tokens",
                           f"set `{key}` to the tokenizer's id of its token")
    _check_stored_layers(ckpt, text, f"{text_key}.")


def check_text_config(ckpt: Path, config: dict) -> None:
    """A text-only Nemotron-H config.json (`nemotron_h`): the decoder checks of :func:`check_config`."""
    _check_text(ckpt, config, "")
    _check_stored_layers(ckpt, config, "")


def layer_kinds(ckpt: Path, text: dict, prefix: str) -> list[str]:
    """The decoder's layer kinds from `layers_block_type` (or `layer_types`, or the letters of
    `hybrid_override_pattern`), each one of LAYER_KINDS; `num_hidden_layers`, where given, must agree."""
    from gymv.models.config_check import Keys

    keys = Keys(ckpt, text, prefix)
    kinds_fix = (f"list one kind per layer, each one of {', '.join(LAYER_KINDS)} (or set hybrid_override_pattern "
                 "to letters M, *, E, -)")
    name = next((k for k in ("layers_block_type", "layer_types") if text.get(k) is not None), None)
    if name is not None:
        value = text[name]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise keys.fail(name, f"is {json.dumps(value)[:60]}, not a list of layer kinds", kinds_fix)
        bad = sorted({v for v in value if LEGACY_KINDS.get(v, v) not in LAYER_KINDS})
        if bad:
            raise keys.fail(name, f"names unknown layer kinds {', '.join(map(repr, bad))}", kinds_fix)
        kinds = [LEGACY_KINDS.get(v, v) for v in value]
    elif text.get("hybrid_override_pattern") is not None:
        name, value = "hybrid_override_pattern", text["hybrid_override_pattern"]
        if not isinstance(value, str) or not value or set(value) - set(PATTERN_LETTERS):
            raise keys.fail(name, f"is {json.dumps(value)[:60]}, not a string of the letters M, *, E, -", kinds_fix)
        kinds = [PATTERN_LETTERS[c] for c in value]
    else:
        raise keys.fail("layers_block_type", "is missing (nor is there a hybrid_override_pattern)", kinds_fix)
    declared = keys.int("num_hidden_layers", required=False)
    if declared is not None and declared != len(kinds):
        raise keys.fail(name, f"lists {len(kinds)} layers, num_hidden_layers is {declared}",
                        f"make `{prefix}{name}` one kind per layer ({declared}), or fix num_hidden_layers")
    return kinds


def _check_text(ckpt: Path, text: dict, prefix: str) -> int:
    """The decoder section's sizes, layer kinds, heads and routing; returns the vocabulary size."""
    from gymv.models.config_check import Keys

    keys = Keys(ckpt, text, prefix)
    kinds = layer_kinds(ckpt, text, prefix)
    vocab = keys.int("vocab_size")
    keys.int("hidden_size")
    keys.int("max_position_embeddings", required=False)
    keys.number("layer_norm_epsilon")
    if "full_attention" in kinds:
        heads = keys.int("num_attention_heads")
        kv = keys.int("num_key_value_heads", required=False, default=heads)
        if heads % kv:
            raise keys.fail("num_attention_heads", f"({heads}) is not a multiple of num_key_value_heads ({kv})",
                            f"set `{prefix}num_key_value_heads` to a divisor of {heads}")
        keys.int("head_dim", required=False)
    if "linear_attention" in kinds:
        heads = keys.int("mamba_num_heads")
        keys.int("mamba_head_dim")
        keys.int("ssm_state_size")
        groups = keys.int("n_groups")
        if heads % groups:
            raise keys.fail("n_groups", f"({groups}) does not divide mamba_num_heads ({heads})",
                            f"set `{prefix}n_groups` to a divisor of {heads}")
        for key in ("conv_kernel", "chunk_size", "expand"):
            keys.int(key, required=False)
    if "mlp" in kinds:
        keys.int("intermediate_size")
    if "moe" in kinds:
        experts = keys.int("n_routed_experts")
        keys.int("moe_intermediate_size")
        shared = keys.int("n_shared_experts", minimum=0, required=False, default=0)
        if shared:
            keys.int("moe_shared_expert_intermediate_size")
        groups = keys.int("n_group", required=False, default=1)
        if experts % groups or experts // groups < 2:
            raise keys.fail("n_group", f"({groups}) must split n_routed_experts ({experts}) into groups of at "
                            "least 2 experts", f"set `{prefix}n_group` to 1, or a divisor of {experts} "
                            f"at most {experts // 2}")
        chosen = keys.int("topk_group", required=False, default=1)
        if chosen > groups:
            raise keys.fail("topk_group", f"({chosen}) exceeds n_group ({groups})",
                            f"set `{prefix}topk_group` between 1 and {groups}")
        top_k = keys.int("num_experts_per_tok", minimum=0)
        most = chosen * (experts // groups)
        if not 1 <= top_k <= most:
            within = "n_routed_experts" if most == experts else "the experts of the topk_group chosen groups"
            raise keys.fail("num_experts_per_tok", f"is {top_k}: each token is routed to between 1 and {within} "
                            f"({most}) experts", f"set `{prefix}num_experts_per_tok` between 1 and {most}")
        keys.number("routed_scaling_factor")
    mtp = keys.int("num_nextn_predict_layers", minimum=0, required=False, default=0)
    if mtp and text.get("mtp_layers_block_type") is not None:
        value = text["mtp_layers_block_type"]
        if not isinstance(value, list) or any(LEGACY_KINDS.get(v, v) not in LAYER_KINDS for v in value):
            raise keys.fail("mtp_layers_block_type", f"is {json.dumps(value)[:60]}, not a list of layer kinds",
                            f"list MTP layer kinds, each one of {', '.join(LAYER_KINDS)}")
    return vocab


def _check_stored_layers(ckpt: Path, text: dict, prefix: str) -> None:
    """The layer kinds against the decoder layers the safetensors files hold (read from their headers): a
    pattern that is short of the weights, or names another kind than a stored layer is, loads with that
    layer's tensors dropped and trains on without them."""
    from gymv.models.config_check import Keys, weight_shapes

    shapes = weight_shapes(ckpt)
    if not shapes:
        return
    stored: dict[int, str] = {}
    experts: dict[int, int] = {}
    for tensor, shape in shapes.items():
        m = _LAYER_TENSOR.match(tensor)
        if not m:
            continue
        layer, part = int(m[1]), m[2]
        kind = next((k for p, k in _KIND_OF_TENSOR if part == p), None)
        if kind is not None:
            stored[layer] = kind
        if part == "gate" and tensor.endswith("gate.weight") and shape:
            experts[layer] = shape[0]
    if not stored:
        return
    kinds = layer_kinds(ckpt, text, prefix)
    keys = Keys(ckpt, text, prefix)
    name = next((k for k in ("layers_block_type", "layer_types", "hybrid_override_pattern") if text.get(k) is not None))
    count = max(stored) + 1
    order = ", ".join(stored.get(i, "?") for i in range(count))
    if len(kinds) != count:
        raise keys.fail(name, f"lists {len(kinds)} layers, the weights hold {count}",
                        f"list the stored layers' kinds in order: {order}")
    for i, (declared, found) in enumerate(zip(kinds, (stored.get(i) for i in range(count)))):
        if found is not None and declared != found:
            raise keys.fail(name, f"says layer {i} is {declared}, its stored tensors are a {found} layer's",
                            f"list the stored layers' kinds in order: {order}")
    routed = {n for n in experts.values()}
    declared_experts = text.get("n_routed_experts")
    if len(routed) == 1 and isinstance(declared_experts, int) and declared_experts not in routed:
        (n,) = routed
        raise keys.fail("n_routed_experts", f"is {declared_experts}, the weights' routers choose among {n} experts",
                        f"set `{prefix}n_routed_experts` to {n}")
