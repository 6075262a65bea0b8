"""Multimodal adapters: one per processor style, so the rest of gymv never guesses how images meet tokens.

The agent loop appends token ids turn by turn and never re-tokenizes earlier text, so it needs to know the
exact ids one image occupies; generation and training need the model's image inputs, image features,
position ids, and the vision special tokens that must never be sampled. The styles:

- ``placeholder`` (LLaVA): one image token in the text becomes N copies of it; N is fixed by the crop size.
- ``grid`` (Qwen2-VL, Qwen2.5-VL; ``grid_deepstack`` for Qwen3-VL): ``<|vision_start|><|image_pad|><|vision_end|>``
  in the text; the pad becomes ``t*h*w / merge_size**2`` copies, which depends on the image size; inputs carry
  ``image_grid_thw`` and the text model uses 3-D (M-RoPE) positions.
- ``anyres`` (LLaVA-NeXT, OneVision), ``image_block`` (Gemma 3), ``split`` (SmolVLM, Idefics3), ``patch_grid``
  (Nemotron 3 Omni): see their classes; ``text``: a causal LM with no vision path at all.

Every forward pass in gymv first calls :meth:`MultimodalAdapter.check` on each sequence, so a placeholder
count that does not match the images is a one-line error naming the row and turn, never a wrong tensor.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gymv.backends.host_copy import to_device
from gymv.errors import GymvError
from gymv.models.nemotron_omni import IMAGE_END, IMAGE_START, VIDEO_TOKEN
# torch loads on first use: the agent loop's image handling (gymv.rollout.images) imports the adapters' tables

SUPPORTED_PROCESSORS = {
    "LlavaProcessor": "placeholder", "Qwen2VLProcessor": "grid", "Qwen2_5_VLProcessor": "grid",
    "Qwen3VLProcessor": "grid_deepstack", "LlavaNextProcessor": "anyres", "LlavaOnevisionProcessor": "anyres",
    "Gemma3Processor": "image_block", "Idefics3Processor": "split", "SmolVLMProcessor": "split",
    "NemotronH_Omni_Reasoning_V3Processor": "patch_grid",
}


def supported_text() -> str:
    return ", ".join(f"{name} ({style})" for name, style in SUPPORTED_PROCESSORS.items())


def image_hash(image) -> str:
    """Content hash of an image's pixels (mode and size included): equal pixels, equal key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def hash_pictures(pictures: Iterable, hashes: dict[int, str] | None = None) -> dict[int, str]:
    """Content hashes by id(picture), each picture object hashed once: a step holds G references to each of its
    pictures, and a large one takes milliseconds. `hashes`: those already known, filled in place."""
    hashes = {} if hashes is None else hashes
    for im in pictures:
        if id(im) not in hashes:
            hashes[id(im)] = image_hash(im)
    return hashes


@dataclass
class ImageInputs:
    """Preprocessed images in sequence order, as the vision tower takes them."""

    pixel_values: Any
    image_grid_thw: Any | None
    tokens_per_image: list[int]
    image_sizes: Any | None = None  # any-resolution tiling: each image's (height, width)
    extra: dict = field(default_factory=dict)  # per-image tensors the vision tower also takes (first dim: images)

    def select(self, index: int) -> ImageInputs:
        """The inputs of one image (grid pixel rows are split by each image's patch count)."""
        if self.image_grid_thw is None:
            sizes = self.image_sizes[index:index + 1] if self.image_sizes is not None else None
            return ImageInputs(self.pixel_values[index:index + 1], None, [self.tokens_per_image[index]], sizes,
                               {k: v[index:index + 1] for k, v in self.extra.items()})
        counts = self.image_grid_thw.prod(-1).tolist()
        start = sum(counts[:index])
        return ImageInputs(self.pixel_values[start:start + counts[index]], self.image_grid_thw[index:index + 1],
                           [self.tokens_per_image[index]])


PREPROCESS_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))  # leaves half the cores to the rest


def preprocess_threaded(adapter: MultimodalAdapter, images: Sequence, threads: int | None = None) -> ImageInputs:
    """`adapter.preprocess(images)`, the images split across threads (PIL's resize, most of the time for large
    pictures, releases the GIL). The pieces are joined image by image, so the result equals one call's; where
    they cannot be joined (per-batch padding gives pieces different shapes) it is one call."""
    threads = PREPROCESS_THREADS if threads is None else threads
    n = min(threads, len(images))
    if n <= 1:
        return adapter.preprocess(images)
    import torch

    chunks = [list(images[i::n]) for i in range(n)]  # strided: equal work where sizes vary along the list
    with ThreadPoolExecutor(max_workers=n) as pool:
        parts = list(pool.map(adapter.preprocess, chunks))
    joined = [part.select(j) for part in parts for j in range(len(part.tokens_per_image))]
    out = join_inputs([joined[sum(len(c) for c in chunks[:i % n]) + i // n] for i in range(len(images))])
    return out if out is not None else adapter.preprocess(images)


def join_inputs(singles: Sequence[ImageInputs], pin: bool = False) -> ImageInputs | None:
    """One-image inputs joined in order into what one `preprocess` call over their images returns; None
    where they cannot be joined (per-batch padding gives images different shapes). `pin`: the pixels are
    joined into pinned memory (a fresh pageable buffer costs page faults, then a second copy to pin it)."""
    import torch

    try:
        pixels = [o.pixel_values for o in singles]
        out = None
        if pin and torch.cuda.is_available():
            out = torch.empty((sum(p.shape[0] for p in pixels), *pixels[0].shape[1:]), dtype=pixels[0].dtype,
                              pin_memory=True)
        pv = torch.cat(pixels, out=out)
        grid = torch.cat([o.image_grid_thw for o in singles]) if singles[0].image_grid_thw is not None else None
        sizes = (torch.cat([torch.as_tensor(o.image_sizes) for o in singles])
                 if singles[0].image_sizes is not None else None)
        extra = {k: torch.cat([o.extra[k] for o in singles]) for k in singles[0].extra}
    except (RuntimeError, TypeError, KeyError, AttributeError):
        return None
    return ImageInputs(pv, grid, [t for o in singles for t in o.tokens_per_image], sizes, extra)


def _runs(ids, token_id: int) -> list[int]:
    """Lengths of the runs of `token_id` in `ids`, in order (vectorised: a training micro-batch checks
    every row of every sample before each forward pass)."""
    import numpy as np

    hit = np.asarray(ids) == token_id
    if not hit.any():
        return []
    edges = np.diff(hit.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


def _row_runs(hit) -> list[list[int]]:
    """`_runs` of every row of a 2-D boolean array at once."""
    import numpy as np

    edges = np.diff(hit.astype(np.int8), axis=1, prepend=np.int8(0), append=np.int8(0))
    rows, starts = np.nonzero(edges == 1)
    ends = np.nonzero(edges == -1)[1]  # row-major: each run's end in the same order as its start
    lengths = (ends - starts).tolist()
    cuts = np.searchsorted(rows, np.arange(hit.shape[0] + 1)).tolist()
    return [lengths[cuts[b]:cuts[b + 1]] for b in range(hit.shape[0])]


def _per_image(out, counts: list[int]) -> list:
    """Split a get_image_features result into one [tokens, hidden] tensor per image (5.x return shapes vary)."""
    feats = getattr(out, "pooler_output", out)
    if hasattr(feats, "dim"):
        if feats.dim() == 3 and feats.shape[0] != len(counts):  # one row per tile (SmolVLM on transformers 5.17)
            feats = feats.reshape(-1, feats.shape[-1])
        feats = list(feats) if feats.dim() == 3 else list(feats.split(counts))
    feats = list(feats)
    got = [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in feats]
    if got != list(counts):
        raise GymvError(f"the vision tower returned features for {got} tokens per image, expected {list(counts)}",
                        fix="the checkpoint's processor and model disagree on image token counts")
    return feats


def _as_array(ids):
    """Token ids as a numpy array, without a Python list in between."""
    import numpy as np

    if hasattr(ids, "detach"):
        return ids.detach().cpu().numpy()
    return np.asarray(ids)


class MultimodalAdapter:
    """What gymv needs to know about one processor style; built by :func:`make_adapter`."""

    style: ClassVar[str] = ""
    adjacent_images_merge: ClassVar[bool] = True

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.config = config
        self.processor_class = processor_class
        self.hf_processor = hf_processor
        self.image_token = self._image_token()
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        config_id = getattr(config, "image_token_id", None)
        if config_id is not None and int(config_id) != self.image_token_id:
            raise GymvError(
                f"tokenizer maps image token {self.image_token!r} to id {self.image_token_id} but the model config "
                f"says image_token_id={config_id}", where=processor_class,
                fix="the checkpoint's tokenizer and config disagree; rebuild or fix config.json")
        self.vision_token_ids: tuple[int, ...] = self._vision_token_ids()

    # -- what one image occupies ---------------------------------------------------------------------
    def _image_token(self) -> str:
        return getattr(self.tokenizer, "image_token", None) or "<image>"

    def tokens_per_image(self, image) -> int:
        raise NotImplementedError

    def image_token_ids(self, image) -> list[int]:
        """The ids that replace the single image token of the rendered chat text for this image."""
        return [self.image_token_id] * self.tokens_per_image(image)

    def encode_text(self, text: str, images: Sequence = (), *, where: str | None = None) -> list[int]:
        """Tokenize chat-template text and expand its image tokens, one per image in order."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        n = sum(1 for t in ids if t == self.image_token_id)
        if n != len(images):
            raise GymvError(f"text has {n} image placeholder(s) but {len(images)} image(s) were given",
                            where=where, fix="pass exactly one image per image part of the messages")
        out: list[int] = []
        it = iter(images)
        for t in ids:
            out.extend(self.image_token_ids(next(it)) if t == self.image_token_id else (t,))
        return out

    def count_placeholders(self, ids) -> int:
        return int((_as_array(ids) == self.image_token_id).sum())

    def check(self, ids, images: Sequence, *, where: str | None = None) -> None:
        """Raise unless the placeholder spans of `ids` are exactly the spans `images` need, in order."""
        self.check_runs(_runs(_as_array(ids), self.image_token_id), images, where=where)

    def check_runs(self, runs: list[int], images: Sequence, *, where: str | None = None) -> None:
        """`check`, given the lengths of the sequence's placeholder runs."""
        need = [self.tokens_per_image(im) for im in images]
        ok, i = True, 0
        for run in runs:
            got = 0
            while got < run and i < len(need):
                got += need[i]
                i += 1
                if not self.adjacent_images_merge:
                    break
            ok = ok and got == run
        ok = ok and i == len(need)
        if not ok:
            raise GymvError(
                f"image placeholder tokens do not match the images: the sequence has {sum(runs)} placeholder "
                f"token(s) in span(s) {runs}, its {len(images)} image(s) need {need}",
                where=where,
                fix="append image tokens with adapter.image_token_ids(image) for every image the turn adds, "
                    "and never truncate or re-tokenize inside an image span")

    def check_batch(self, rows, images: Sequence[Sequence], where: Sequence[str | None] | None = None,
                    attention_mask=None) -> None:
        name = lambda b: (where[b] if where else None) or f"batch row {b}"  # noqa: E731
        ids = _as_array(rows) if hasattr(rows, "shape") else None
        if ids is None or ids.ndim != 2:
            for b, row in enumerate(rows):
                ids = _as_array(row)
                if attention_mask is not None:
                    ids = ids[_as_array(attention_mask[b]) != 0]
                self.check(ids, images[b], where=name(b))
            return
        hit = ids == self.image_token_id
        if attention_mask is not None:
            hit &= _as_array(attention_mask) != 0
        for b, runs in enumerate(_row_runs(hit)):
            self.check_runs(runs, images[b], where=name(b))

    # -- model inputs -------------------------------------------------------------------------------
    def preprocess(self, images: Sequence) -> ImageInputs:
        raise NotImplementedError

    def image_features(self, model, inputs: ImageInputs) -> list:
        """One feature tensor per image ([tokens, hidden]); gradients flow when called outside no_grad."""
        raise NotImplementedError

    def forward_kwargs(self, input_ids) -> dict:
        """Extra model inputs of a pass over `input_ids` that holds image tokens (none for most families)."""
        return {}

    def feature_inputs(self, model, input_ids, features: list) -> dict:
        """The model inputs that carry `features` (one per image, in order) for a pass over `input_ids`:
        the token embeddings with each image's features written over its placeholders."""
        from gymv.backends.hf_forward import embed_with_images

        return {"inputs_embeds": embed_with_images(model, input_ids, self.image_token_id, features)}

    def position_ids(self, model, input_ids, attention_mask, image_grid_thw=None):
        """Positions for a padded batch (left or right): pads are skipped, so padding never shifts them."""
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.clamp(min=0)

    def next_positions(self, positions, attention_mask):
        """Per row, the position the next appended token takes."""
        return attention_mask.long().sum(-1)

    def step_positions(self, next_pos):
        """Positions for one new token per row, shaped as the model takes them."""
        return next_pos.view(-1, 1)

    def _vision_token_ids(self) -> tuple[int, ...]:
        ids = {self.image_token_id}
        for key in ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id",
                    "vision_end_token_id", "boi_token_index", "eoi_token_index", "image_start_token_id",
                    "image_end_token_id"):
            v = getattr(self.config, key, None)
            if isinstance(v, int) and v >= 0:
                ids.add(v)
        named = getattr(self.tokenizer, "extra_special_tokens", None) or {}
        if isinstance(named, dict):
            for name, tok in named.items():
                if any(w in name for w in ("image", "vision", "video")) and isinstance(tok, str):
                    tid = self.tokenizer.convert_tokens_to_ids(tok)
                    if isinstance(tid, int) and tid >= 0:
                        ids.add(tid)
        return tuple(sorted(ids))

    def describe(self) -> dict:
        return {"style": self.style, "processor": self.processor_class, "image_token": self.image_token,
                "image_token_id": self.image_token_id, "vision_token_ids": list(self.vision_token_ids)}


class PlaceholderAdapter(MultimodalAdapter):
    """LLaVA: a fixed number of image tokens per image (the image is resized and center-cropped)."""

    style = "placeholder"
    adjacent_images_merge = True

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)
        vc = config.vision_config
        self.patch_size = int(getattr(hf_processor, "patch_size", None) or vc.patch_size)
        strategy = getattr(hf_processor, "vision_feature_select_strategy", None)
        self.strategy = strategy or config.vision_feature_select_strategy
        extra = getattr(hf_processor, "num_additional_image_tokens", None)
        self.additional = int(extra if extra is not None else 1)
        crop = getattr(image_processor, "crop_size", None) or {"height": vc.image_size, "width": vc.image_size}
        crop = dict(crop) if not isinstance(crop, dict) else crop
        n = (crop["height"] // self.patch_size) * (crop["width"] // self.patch_size) + self.additional
        self.num_image_tokens = n - 1 if self.strategy == "default" else n

    def tokens_per_image(self, image) -> int:
        return self.num_image_tokens

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(out["pixel_values"], None, [self.num_image_tokens] * len(images))

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype))
        return _per_image(out, inputs.tokens_per_image)


class GridAdapter(MultimodalAdapter):
    """Qwen2-VL: image tokens = t*h*w / merge**2 for the resized image, plus 3-D rotary positions."""

    style = "grid"
    adjacent_images_merge = False

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)
        self.merge = int(image_processor.merge_size)

    def _image_token(self) -> str:
        return getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"

    def tokens_per_image(self, image) -> int:
        w, h = image.size
        patches = self.image_processor.get_number_of_image_patches(h, w, {})
        return int(patches) // (self.merge ** 2)

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"]
        return ImageInputs(out["pixel_values"], grid, [int(n) // self.merge ** 2 for n in grid.prod(-1).tolist()])

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype),
                                       image_grid_thw=to_device(inputs.image_grid_thw, model.device))
        return _per_image(out, inputs.tokens_per_image)

    def position_ids(self, model, input_ids, attention_mask, image_grid_thw=None):
        inner = getattr(model, "model", model)
        types = (input_ids == self.image_token_id).int()
        grid = image_grid_thw.to(input_ids.device) if image_grid_thw is not None and len(image_grid_thw) else None
        kwargs = {"image_grid_thw": grid, "attention_mask": attention_mask}
        if "mm_token_type_ids" in inspect.signature(inner.get_rope_index).parameters:
            kwargs["mm_token_type_ids"] = types
        pos, _ = inner.get_rope_index(input_ids, **kwargs)
        return pos

    def next_positions(self, positions, attention_mask):
        return positions.masked_fill(attention_mask.unsqueeze(0) == 0, -1).amax(dim=(0, 2)) + 1

    def step_positions(self, next_pos):
        return next_pos.view(1, -1, 1).expand(3, -1, 1)


@dataclass
class DeepstackFeatures:
    """One image's features for Qwen3-VL: the merged tokens, and per deepstack layer the features added to the
    decoder's hidden states at the image's positions."""

    main: Any
    deepstack: list

    @property
    def shape(self):
        return self.main.shape

    def reshape(self, *shape):
        return self.main.reshape(*shape)


class DeepstackGridAdapter(GridAdapter):
    """Qwen3-VL: the grid style, plus deepstack features (vision layers feeding the first decoder layers).

    Those cannot ride in `inputs_embeds`, so a pass over image tokens hands the model its own
    `mm_encoder_outputs` (the merged features and the deepstack features, one entry per image, in order)
    with the token ids; the model then writes both where its own forward would.
    """

    style = "grid_deepstack"

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype),
                                       image_grid_thw=to_device(inputs.image_grid_thw, model.device))
        main = _per_image(out, inputs.tokens_per_image)
        layers = [list(layer) if not hasattr(layer, "split") else list(layer.split(inputs.tokens_per_image))
                  for layer in out.deepstack_features]
        return [DeepstackFeatures(m, [layer[i] for layer in layers]) for i, m in enumerate(main)]

    def feature_inputs(self, model, input_ids, features: list) -> dict:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        n_layers = len(features[0].deepstack)
        image = BaseModelOutputWithDeepstackFeatures(
            pooler_output=[f.main for f in features],
            deepstack_features=[[f.deepstack[k] for f in features] for k in range(n_layers)])
        return {"input_ids": input_ids, "mm_encoder_outputs": {"image": image}}


class AnyResAdapter(MultimodalAdapter):
    """LLaVA-NeXT and LLaVA-OneVision: the image is tiled at the best-fitting grid resolution plus one base
    tile, so its token count (tiles, unpadded to the aspect ratio, one newline per row) depends on its size.

    The count comes from the processor class's own formula, run on a bare instance that holds only what the
    formula reads, so it works where the composite processor cannot load (OneVision's needs torchvision for
    video). Every image is tiled as a single image: OneVision's processor tiles a lone image but gives each
    image of a multi-image prompt one base tile, which would make an image's tokens depend on the images
    other turns add later; gymv appends turns without re-tokenizing, so it tiles each image on its own, in
    generation and training alike (docs/models.md).
    """

    style = "anyres"
    adjacent_images_merge = True

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)
        import transformers

        vc = config.vision_config
        self.strategy = config.vision_feature_select_strategy
        counter = object.__new__(getattr(transformers, processor_class))
        side = vc.image_size // vc.patch_size
        counter.__dict__.update(image_processor=image_processor, patch_size=vc.patch_size,
                                num_additional_image_tokens=0 if "siglip" in vc.model_type else 1,
                                vision_feature_select_strategy=self.strategy, num_image_tokens=side * side,
                                vision_aspect_ratio=getattr(config, "vision_aspect_ratio", "anyres_max_9"))
        self._counter = counter
        crop = getattr(image_processor, "crop_size", None) or getattr(image_processor, "size", None) or {}
        crop = dict(crop)
        self.tile = (crop.get("height") or crop.get("shortest_edge") or vc.image_size,
                     crop.get("width") or crop.get("shortest_edge") or vc.image_size)

    def tokens_per_image(self, image) -> int:
        w, h = image.size
        n = int(self._counter._get_number_of_features(h, w, *self.tile))
        return n - 1 if self.strategy == "default" else n

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(out["pixel_values"], None, [self.tokens_per_image(im) for im in images], out["image_sizes"])

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype),
                                       image_sizes=to_device(inputs.image_sizes, model.device),
                                       vision_feature_layer=self.config.vision_feature_layer,
                                       vision_feature_select_strategy=self.strategy)
        return _per_image(out, inputs.tokens_per_image)


class ImageBlockAdapter(MultimodalAdapter):
    """Gemma 3: the chat text holds `<start_of_image>`, which becomes `\\n\\n<start_of_image>`, a fixed number
    of `<image_soft_token>` and `<end_of_image>\\n\\n`; the image tokens attend to each other both ways.

    The block is expanded in token space (the newline ids are the tokenizer's own for "\\n\\n"), so the turns
    before it are never re-tokenized. Pan-and-scan (extra crops per image) is refused: a checkpoint that turns
    it on in its image processor fails at load time with the fix.
    """

    style = "image_block"
    adjacent_images_merge = False

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)
        if getattr(image_processor, "do_pan_and_scan", False):
            raise GymvError("the image processor has do_pan_and_scan on, which gymv does not support",
                            where=processor_class, fix='set "do_pan_and_scan": false in preprocessor_config.json')
        self.boi_id = int(config.boi_token_index)
        self.eoi_id = int(config.eoi_token_index)
        self.num_image_tokens = int(config.mm_tokens_per_image)
        self.newline_ids = list(tokenizer.encode("\n\n", add_special_tokens=False))

    def _image_token(self) -> str:
        return getattr(self.tokenizer, "image_token", None) or "<image_soft_token>"

    def tokens_per_image(self, image) -> int:
        return self.num_image_tokens

    def image_token_ids(self, image) -> list[int]:
        return [*self.newline_ids, self.boi_id, *[self.image_token_id] * self.num_image_tokens, self.eoi_id,
                *self.newline_ids]

    def encode_text(self, text: str, images: Sequence = (), *, where: str | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        n = sum(1 for t in ids if t == self.boi_id)
        if n != len(images) or self.image_token_id in ids:
            raise GymvError(f"text has {n} <start_of_image> placeholder(s) but {len(images)} image(s) were given",
                            where=where, fix="pass exactly one image per image part of the messages")
        out: list[int] = []
        it = iter(images)
        for t in ids:
            out.extend(self.image_token_ids(next(it)) if t == self.boi_id else (t,))
        return out

    def forward_kwargs(self, input_ids) -> dict:
        is_image = input_ids == self.image_token_id
        return {"token_type_ids": is_image.long()} if bool(is_image.any()) else {}

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(images=list(images), return_tensors="pt", do_pan_and_scan=False)
        return ImageInputs(out["pixel_values"], None, [self.num_image_tokens] * len(images))

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype))
        return _per_image(out, inputs.tokens_per_image)


class SplitAdapter(MultimodalAdapter):
    """Idefics3 and SmolVLM: an image is split into rows x cols tiles plus a global view; each tile is a
    `<fake_token_around_image><row_i_col_j>` header and `image_seq_len` image tokens, so an image holds
    (rows*cols + 1) runs of image tokens (one run when the image needs no split).

    The expansion is SmolVLM's processor module's own prompt-string function (Idefics3's processor writes the
    same layout), tokenized on its own: every piece is bounded by special tokens, so it tokenizes as it would
    inside the whole text.
    """

    style = "split"
    adjacent_images_merge = False
    _TILE = re.compile(r"<row_\d+_col_\d+>")

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)
        vc = config.vision_config
        self.seq_len = int((vc.image_size // vc.patch_size) ** 2 // config.scale_factor ** 2)
        self.fake = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
        self.global_token = getattr(tokenizer, "global_image_token", None) or "<global-img>"
        # Idefics3Processor writes the same layout in a method of its own; SmolVLM's module has it as a function
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        self._prompt = get_image_prompt_string
        self.vision_token_ids = tuple(sorted(set(self.vision_token_ids) | {
            int(i) for t, i in tokenizer.get_vocab().items() if self._TILE.fullmatch(t)}
            | {int(tokenizer.convert_tokens_to_ids(t)) for t in (self.fake, self.global_token)}))

    def _grid(self, image) -> tuple[int, int]:
        w, h = image.size
        _, rows, cols = self.image_processor.get_number_of_image_patches(h, w, {})
        return int(rows), int(cols)

    def runs(self, image) -> list[int]:
        rows, cols = self._grid(image)
        return [self.seq_len] * (rows * cols + 1)

    def tokens_per_image(self, image) -> int:
        return sum(self.runs(image))

    def image_token_ids(self, image) -> list[int]:
        rows, cols = self._grid(image)
        text = self._prompt(rows, cols, self.seq_len, fake_token_around_image=self.fake, image_token=self.image_token,
                            global_image_token=self.global_token)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_runs(self, runs: list[int], images: Sequence, *, where: str | None = None) -> None:
        need = [n for im in images for n in self.runs(im)]
        if runs != need:
            raise GymvError(
                f"image placeholder tokens do not match the images: the sequence has {sum(runs)} placeholder "
                f"token(s) in {len(runs)} tile span(s), its {len(images)} image(s) need {sum(need)} in {len(need)}",
                where=where,
                fix="append image tokens with adapter.image_token_ids(image) for every image the turn adds, "
                    "and never truncate or re-tokenize inside an image span")

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(images=[[im] for im in images], return_tensors="pt")
        return ImageInputs(out["pixel_values"], None, [self.tokens_per_image(im) for im in images],
                           extra={"pixel_attention_mask": out["pixel_attention_mask"]})

    def image_features(self, model, inputs: ImageInputs) -> list:
        dtype = next(model.parameters()).dtype
        mask = to_device(inputs.extra["pixel_attention_mask"], model.device)
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype),
                                       pixel_attention_mask=mask)
        return _per_image(out, inputs.tokens_per_image)


class PatchGridAdapter(MultimodalAdapter):
    """Nemotron 3 Omni: `<image>` in the chat text becomes `<img>`, `rows*cols/merge**2` image tokens and
    `</img>`, where the patch grid depends on the image's size (dynamic resolution, pixel shuffle 2x2 after the
    RADIO tower); the model takes flattened patches of every image with `image_grid_hw` [images, 2].

    The image processor is gymv's torch rendition of the family's own (gymv.models.nemotron_omni), which
    transformers ships only for torchvision. Each image is processed on its own, so an image's tokens never
    depend on the images other turns add; a processor config whose patch budget would is refused at load.
    """

    style = "patch_grid"
    adjacent_images_merge = False

    def __init__(self, tokenizer, image_processor, config, processor_class: str, hf_processor=None):
        super().__init__(tokenizer, image_processor, config, processor_class, hf_processor)

        image_processor.check_budget(processor_class)
        named = lambda attr, default: tokenizer.convert_tokens_to_ids(getattr(tokenizer, attr, None) or default)  # noqa: E731
        self.start_id, self.end_id = int(named("image_start_token", IMAGE_START)), int(named("image_end_token", IMAGE_END))
        video = named("video_token", VIDEO_TOKEN)
        extra = {self.start_id, self.end_id} | ({int(video)} if isinstance(video, int) and video >= 0 else set())
        self.vision_token_ids = tuple(sorted({*self.vision_token_ids, *extra}))

    def tokens_per_image(self, image) -> int:
        return self.image_processor.tokens(image)

    def image_token_ids(self, image) -> list[int]:
        return [self.start_id, *[self.image_token_id] * self.tokens_per_image(image), self.end_id]

    def preprocess(self, images: Sequence) -> ImageInputs:
        out = self.image_processor(list(images))
        grid = out["image_grid_hw"]  # rides in the grid slot: select() splits pixel rows by its products
        merge = self.image_processor.merge_size
        return ImageInputs(out["pixel_values"], grid, [int(n) // merge ** 2 for n in grid.prod(-1).tolist()])

    def image_features(self, model, inputs: ImageInputs) -> list:
        from gymv.backends import vision_attention

        dtype = next(model.parameters()).dtype
        extra = {}
        if len(inputs.tokens_per_image) > 1 and vision_attention.installed(model):
            # the images' longest sequence from the host grid: the tower's attention then reads no bounds back
            vision_attention.prepare(model.device)
            extra["max_seqlen"] = vision_attention.max_seqlen(model, inputs.image_grid_thw)
        out = model.get_image_features(pixel_values=to_device(inputs.pixel_values, model.device).to(dtype),
                                       image_grid_hw=to_device(inputs.image_grid_thw, model.device), **extra)
        return _per_image(out, inputs.tokens_per_image)


class TextAdapter(MultimodalAdapter):
    """A text-only causal LM: no image token at all (id -1 matches no token), nothing masked out of sampling,
    and any image is a one-line error naming the row, before a forward pass."""

    style = "text"

    def __init__(self, tokenizer, image_processor=None, config=None, processor_class: str = "", hf_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = None
        self.config = config
        self.processor_class = processor_class or type(tokenizer).__name__
        self.hf_processor = None
        self.image_token = None
        self.image_token_id = -1
        self.vision_token_ids: tuple[int, ...] = ()

    def _no_images(self, images: Sequence, where: str | None) -> None:
        if len(images):
            raise GymvError(f"this model is text-only, but {len(images)} image(s) were given", where=where,
                            fix="train a vision-language model on rows with images, or use a text-only environment")

    def tokens_per_image(self, image) -> int:
        self._no_images([image], None)
        return 0

    def encode_text(self, text: str, images: Sequence = (), *, where: str | None = None) -> list[int]:
        self._no_images(images, where)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def count_placeholders(self, ids) -> int:
        return 0

    def check_runs(self, runs: list[int], images: Sequence, *, where: str | None = None) -> None:
        self._no_images(images, where)

    def preprocess(self, images: Sequence) -> ImageInputs:
        self._no_images(images, None)
        return ImageInputs(None, None, [])

    def image_features(self, model, inputs: ImageInputs) -> list:
        return []

    def describe(self) -> dict:
        return {"style": self.style, "processor": self.processor_class, "image_token": None,
                "image_token_id": None, "vision_token_ids": []}


_STYLES = {"placeholder": PlaceholderAdapter, "grid": GridAdapter, "grid_deepstack": DeepstackGridAdapter,
           "anyres": AnyResAdapter,
           "image_block": ImageBlockAdapter, "split": SplitAdapter, "patch_grid": PatchGridAdapter}


def make_adapter(processor_class: str, tokenizer, image_processor, config, hf_processor=None) -> MultimodalAdapter:
    """Pick the adapter for a processor class; anything else fails here, at load time."""
    style = SUPPORTED_PROCESSORS.get(processor_class)
    if style is None:
        raise GymvError(f"unsupported processor {processor_class!r}",
                        fix=f"gymv supports: {supported_text()}")
    if image_processor is None:
        raise GymvError(f"{processor_class} has no image processor", fix="save the image processor with the model")
    return _STYLES[style](tokenizer, image_processor, config, processor_class, hf_processor)
