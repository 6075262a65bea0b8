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

import math
from collections.abc import Sequence
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
