"""Random-initialised tiny VLMs written as standard Hugging Face checkpoints.

They exist so that every code path (rollout, generation, training, refit) runs on a laptop CPU in seconds
with real transformers classes; quality is irrelevant. A build is a pure function of (architecture, knobs,
seed, BUILDER_VERSION): the same inputs give the same tokenizer and the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gymv.errors import GymvError
from gymv.io import follow_umask

BUILDER_VERSION = 1
MARKER_FILE = "gymv_model.json"


@dataclass(frozen=True)
class TinyKnobs:
    """Size knobs; `image_size` is the square input side (LLaVA) or the largest image side budget (grid)."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    image_size: int = 56
    patch_size: int = 7
    vocab_size: int = 1024
    seed: int = 0

    def validate(self, arch: str) -> None:
        def bad(msg: str, fix: str) -> GymvError:
            return GymvError(msg, where=f"model init {arch}", fix=fix)

        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise bad(f"hidden {self.hidden} must divide by heads {self.heads}, and heads by kv_heads {self.kv_heads}",
                      "pick --hidden as a multiple of 4 (the default heads)")
        if self.vision_hidden % self.vision_heads:
            raise bad(f"vision_hidden {self.vision_hidden} must divide by vision_heads {self.vision_heads}",
                      "use a multiple of 4")
        if self.layers < 1 or self.vision_layers < 1:
            raise bad("layers and vision_layers must be at least 1", "pass --layers 1 or more")
        if self.image_size % self.patch_size:
            raise bad(f"image size {self.image_size} is not a multiple of patch size {self.patch_size}",
                      "choose sizes such as --image-size 56 --patch-size 7")
        if self.vocab_size < 400:
            raise bad(f"vocab size {self.vocab_size} is below 400 (bytes + specials + tool markup)",
                      "pass --vocab-size 512 or more")


ARCHES = ("tiny-llava", "tiny-qwen2vl")
DEFAULTS = {"tiny-llava": TinyKnobs(), "tiny-qwen2vl": TinyKnobs(image_size=112)}


def knobs_for(arch: str, **overrides) -> TinyKnobs:
    if arch not in DEFAULTS:
        raise GymvError(f"unknown tiny architecture {arch!r}", fix=f"use one of: {', '.join(ARCHES)}")
    unknown = set(overrides) - set(TinyKnobs.__dataclass_fields__)
    if unknown:
        raise GymvError(f"unknown knob(s) {sorted(unknown)} for {arch}",
                        fix=f"known knobs: {', '.join(TinyKnobs.__dataclass_fields__)}")
    return replace(DEFAULTS[arch], **{k: v for k, v in overrides.items() if v is not None})


def _seeded_model(cls, config, seed: int):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config)


def _write(out_dir: Path, arch: str, knobs: TinyKnobs, build, force: bool, reuse: bool = False) -> Path:
    """Build into a temporary sibling folder, then rename it into place (never a half-written checkpoint).

    With `reuse`, a complete build that appears meanwhile (another worker, same inputs) wins and ours is dropped.
    """
    out_dir = Path(out_dir)
    if reuse and (out_dir / MARKER_FILE).exists():
        return out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise GymvError("output folder exists and is not empty", where=str(out_dir),
                        fix="choose a new folder or pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        from gymv.models.quiet import quiet_transformers

        with quiet_transformers():
            build(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(
            {"arch": arch, "builder_version": BUILDER_VERSION, "knobs": asdict(knobs)}, indent=2) + "\n")
        follow_umask(tmp)
        if reuse and (out_dir / MARKER_FILE).exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (reuse and (out_dir / MARKER_FILE).exists()):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _text_kwargs(k: TinyKnobs, vocab: int, tok) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=k.hidden, intermediate_size=k.intermediate, num_hidden_layers=k.layers,
        num_attention_heads=k.heads, num_key_value_heads=k.kv_heads, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False,
    )


def init_tiny_llava(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Write a LLaVA-style VLM (CLIP vision tower, Llama text model, one `<image>` expanded to N tokens)."""
    k = knobs_for("tiny-llava", **knobs)
    k.validate("tiny-llava")

    def build(tmp: Path) -> None:
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        from gymv.models.chat_template import chat_template
        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, ["<image>"]), image_token="<image>")
        side = k.image_size // k.patch_size
        vision = CLIPVisionConfig(
            hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden, num_hidden_layers=k.vision_layers,
            num_attention_heads=k.vision_heads, image_size=k.image_size, patch_size=k.patch_size,
            projection_dim=k.vision_hidden,
        )
        text = LlamaConfig(**_text_kwargs(k, len(tok), tok))
        config = LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
            image_seq_length=side * side, vision_feature_layer=-1, vision_feature_select_strategy="default",
        )
        model = _seeded_model(LlavaForConditionalGeneration, config, k.seed)
        _set_generation_defaults(model, tok)
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": k.image_size}, crop_size={"height": k.image_size, "width": k.image_size},
        )
        processor = LlavaProcessor(
            image_processor=image_processor, tokenizer=tok, patch_size=k.patch_size,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=chat_template("<image>"),
        )
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _write(Path(out_dir), "tiny-llava", k, build, force, reuse)


QWEN2VL_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MERGE_SIZE = 2


def init_tiny_qwen2vl(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Write a Qwen2-VL-style VLM (grid processor: `image_grid_thw`, M-RoPE, 2x2 patch merging).

    The model, image processor, tokenizer and chat template load with the Auto* classes. The composite
    `Qwen2VLProcessor` also needs a video processor, which transformers implements only with torchvision;
    without torchvision `AutoProcessor.from_pretrained(DIR)` cannot load it (docs/models.md), and gymv's
    loader assembles the same parts itself. The processor config is written by hand in the layout
    `Qwen2VLProcessor.save_pretrained` produces, so that AutoProcessor loads it where torchvision exists.
    """
    k = knobs_for("tiny-qwen2vl", **knobs)
    k.validate("tiny-qwen2vl")
    factor = k.patch_size * MERGE_SIZE
    if k.image_size % factor:
        raise GymvError(f"image size {k.image_size} is not a multiple of patch_size*merge_size = {factor}",
                        where="model init tiny-qwen2vl", fix=f"use a multiple of {factor}, e.g. {8 * factor}")

    def build(tmp: Path) -> None:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from gymv.models.chat_template import chat_template
        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        tok = hf_tokenizer(
            train_bpe(k.seed, k.vocab_size, QWEN2VL_VISION_TOKENS), image_token="<|image_pad|>",
            extra={"video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
                   "vision_end_token": "<|vision_end|>"},
        )
        ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN2VL_VISION_TOKENS}
        half = k.hidden // k.heads // 2
        t_sec = half // 4
        h_sec = (half - t_sec) // 2
        text = dict(_text_kwargs(k, len(tok), tok),
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [t_sec, h_sec, half - t_sec - h_sec]})
        vision = dict(depth=k.vision_layers, embed_dim=k.vision_hidden, hidden_size=k.hidden,
                      num_heads=k.vision_heads, mlp_ratio=2, patch_size=k.patch_size,
                      spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
        config = Qwen2VLConfig(
            text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        model = _seeded_model(Qwen2VLForConditionalGeneration, config, k.seed)
        _set_generation_defaults(model, tok)
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=k.patch_size, merge_size=MERGE_SIZE, temporal_patch_size=2,
            min_pixels=(2 * factor) ** 2, max_pixels=k.image_size ** 2,
        )
        template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        image_processor.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        _write_qwen2vl_processor_config(tmp, image_processor, k)

    return _write(Path(out_dir), "tiny-qwen2vl", k, build, force, reuse)


def _write_qwen2vl_processor_config(tmp: Path, image_processor, k: TinyKnobs) -> None:
    image_cfg = json.loads((tmp / "preprocessor_config.json").read_text())
    video_cfg = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": k.patch_size, "temporal_patch_size": 2, "merge_size": MERGE_SIZE,
        "size": dict(image_processor.size), "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std), "rescale_factor": image_processor.rescale_factor,
        "resample": int(image_processor.resample), "do_sample_frames": False,
    }
    cfg = {"processor_class": "Qwen2VLProcessor", "image_processor": image_cfg, "video_processor": video_cfg}
    (tmp / "processor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _set_generation_defaults(model, tok) -> None:
    gc = model.generation_config
    gc.eos_token_id = tok.eos_token_id
    gc.pad_token_id = tok.pad_token_id
    gc.bos_token_id = None


def init_tiny(arch: str, out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Dispatch on the architecture name used by `gymv model init` and `embedded:<arch>` paths."""
    if arch == "tiny-llava":
        return init_tiny_llava(out_dir, force=force, reuse=reuse, **knobs)
    if arch == "tiny-qwen2vl":
        return init_tiny_qwen2vl(out_dir, force=force, reuse=reuse, **knobs)
    raise GymvError(f"unknown tiny architecture {arch!r}", fix=f"use one of: {', '.join(ARCHES)}")


def count_parameters(path: str | os.PathLike) -> int:
    """Parameters stored in a checkpoint's safetensors files (no model instantiation)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                total += _prod(st.get_slice(name).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
