"""Random-initialised tiny VLMs written as standard Hugging Face checkpoints.

They exist so that every code path (rollout, generation, training, refit) runs on a laptop CPU in seconds
with real transformers classes; quality is irrelevant. A build is a pure function of (architecture, knobs,
seed, BUILDER_VERSION): the same inputs give the same tokenizer and the same weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gymv.errors import GymvError
from gymv.models.chat_template import chat_template
from gymv.models.tiny_build import (ANYRES_ARCHES, ARCHES, BUILDER_VERSION, DEFAULTS,  # noqa: F401 (re-exported)
                                    GRID_ARCHES, HYBRID_ARCHES, MARKER_FILE, TEXT_ONLY_ARCHES, TinyKnobs,
                                    _seeded_model, _set_generation_defaults, _write, knobs_for)
from gymv.models.tiny_omni import init_tiny_nemotron_omni
# tokenizers loads where a tokenizer is trained (`gymv model list` reads the architectures only)

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


def init_tiny_anyres(arch: str, out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False,
                     **knobs) -> Path:
    """Write an any-resolution LLaVA: `tiny-llava-next` (CLIP tower, LlavaNextProcessor) or
    `tiny-llava-onevision` (SigLIP tower, LlavaOnevisionProcessor). An image is tiled at the best of the
    grid resolutions 1x2, 2x1 and 2x2 tiles of `image_size` px plus one base tile, so its token count
    depends on its size and aspect ratio (64 base + up to 272 more at the defaults).

    OneVision's composite processor also holds a video processor (torchvision only), so its
    processor_config.json is written by hand in the layout save_pretrained produces, as for Qwen2-VL.
    """
    if arch not in ANYRES_ARCHES:
        raise GymvError(f"{arch!r} is not an any-resolution tiny architecture", fix=f"use one of: {', '.join(ANYRES_ARCHES)}")
    k = knobs_for(arch, **knobs)
    k.validate(arch)
    t = k.image_size
    pinpoints = [[t, 2 * t], [2 * t, t], [2 * t, 2 * t]]
    onevision = arch == "tiny-llava-onevision"

    def build(tmp: Path) -> None:
        import transformers
        from transformers import LlamaConfig

        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        specials = ["<image>", "<video>"] if onevision else ["<image>"]
        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, specials), image_token="<image>",
                           extra={"video_token": "<video>"} if onevision else None)
        tower = dict(hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden,
                     num_hidden_layers=k.vision_layers, num_attention_heads=k.vision_heads, image_size=t,
                     patch_size=k.patch_size)
        text = LlamaConfig(**_text_kwargs(k, len(tok), tok))
        ids = dict(image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
                   vision_feature_layer=-1, text_config=text)
        if onevision:
            from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
                LlavaOnevisionImageProcessorPil as ImageProcessor)

            config = transformers.LlavaOnevisionConfig(
                vision_config=transformers.SiglipVisionConfig(**tower), vision_feature_select_strategy="full",
                video_token_index=tok.convert_tokens_to_ids("<video>"), **ids)
            model_cls = transformers.LlavaOnevisionForConditionalGeneration
            image_processor = ImageProcessor(size={"height": t, "width": t}, image_grid_pinpoints=pinpoints)
        else:
            from transformers.models.llava_next.image_processing_pil_llava_next import (
                LlavaNextImageProcessorPil as ImageProcessor)

            config = transformers.LlavaNextConfig(
                vision_config=transformers.CLIPVisionConfig(projection_dim=k.vision_hidden, **tower),
                vision_feature_select_strategy="default", **ids)
            model_cls = transformers.LlavaNextForConditionalGeneration
            image_processor = ImageProcessor(size={"shortest_edge": t}, crop_size={"height": t, "width": t},
                                             image_grid_pinpoints=pinpoints)
        model = _seeded_model(model_cls, config, k.seed)
        _set_generation_defaults(model, tok)
        template = chat_template("<image>")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        image_processor.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        image_cfg = json.loads((tmp / "preprocessor_config.json").read_text())
        side = t // k.patch_size
        cfg = ({"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": side * side,
                "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9",
                "image_processor": image_cfg} if onevision else
               {"processor_class": "LlavaNextProcessor", "patch_size": k.patch_size,
                "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                "image_processor": image_cfg})
        (tmp / "processor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    return _write(Path(out_dir), arch, k, build, force, reuse)


GEMMA3_VISION_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_POOL = 2  # average-pool 2x2 patches into one image token


def init_tiny_gemma3(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Write a Gemma 3 VLM (SigLIP tower, 2x2 average pooling, Gemma3Processor with pan-and-scan off).

    The chat text holds `<start_of_image>`; the processor expands it to `\\n\\n<start_of_image>`, a fixed block
    of `<image_soft_token>` (16 at the defaults: 8x8 patches pooled 2x2) and `<end_of_image>\\n\\n`. The image
    tokens attend to each other bidirectionally (token_type_ids), the rest causally.
    """
    k = knobs_for("tiny-gemma3", **knobs)
    k.validate("tiny-gemma3")
    side = k.image_size // k.patch_size
    if side % GEMMA3_POOL:
        raise GymvError(f"image_size/patch_size = {side} must be even (2x2 pooling)", where="model init tiny-gemma3",
                        fix="use e.g. --image-size 56 --patch-size 7")

    def build(tmp: Path) -> None:
        import torch
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, SiglipVisionConfig
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        boi, eoi, soft = GEMMA3_VISION_TOKENS
        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, GEMMA3_VISION_TOKENS), image_token=soft,
                           extra={"boi_token": boi, "eoi_token": eoi})
        n_tokens = (side // GEMMA3_POOL) ** 2
        head_dim = k.hidden // k.heads
        text = dict(_text_kwargs(k, len(tok), tok), head_dim=head_dim, query_pre_attn_scalar=head_dim,
                    sliding_window=512)
        vision = SiglipVisionConfig(hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden,
                                    num_hidden_layers=k.vision_layers, num_attention_heads=k.vision_heads,
                                    image_size=k.image_size, patch_size=k.patch_size, vision_use_head=False)
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=n_tokens,
                              boi_token_index=tok.convert_tokens_to_ids(boi),
                              eoi_token_index=tok.convert_tokens_to_ids(eoi),
                              image_token_index=tok.convert_tokens_to_ids(soft), tie_word_embeddings=False)
        model = _seeded_model(Gemma3ForConditionalGeneration, config, k.seed)
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        if not proj.abs().sum():  # left at zeros by init: images would not reach the text model
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(k.seed + 1)
                proj.normal_(0.0, 0.02)
        _set_generation_defaults(model, tok)
        image_processor = Gemma3ImageProcessorPil(size={"height": k.image_size, "width": k.image_size},
                                                  do_pan_and_scan=False)
        processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=n_tokens,
                                    chat_template=chat_template(boi))
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _write(Path(out_dir), "tiny-gemma3", k, build, force, reuse)


SMOLVLM_MAX_TILES = 4  # tiles per side the tokenizer has <row_i_col_j> tokens for


def smolvlm_vision_tokens() -> list[str]:
    return (["<image>", "<fake_token_around_image>", "<global-img>"]
            + [f"<row_{r}_col_{c}>" for r in range(1, SMOLVLM_MAX_TILES + 1) for c in range(1, SMOLVLM_MAX_TILES + 1)])


def init_tiny_smolvlm(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Write a SmolVLM (Idefics3 family: SigLIP-style tower, pixel-shuffle connector, Llama text model) whose
    image processor splits an image into tiles of `image_size` px (up to 2x2 at the defaults) plus a global
    view; each tile is `<fake_token_around_image><row_i_col_j>` and 16 `<image>` tokens.

    The composite SmolVLMProcessor needs num2words and a torchvision video processor, so, as for Qwen2-VL,
    processor_config.json is written by hand and gymv loads the parts.
    """
    k = knobs_for("tiny-smolvlm", **knobs)
    k.validate("tiny-smolvlm")
    side = k.image_size // k.patch_size
    if side % 2:
        raise GymvError(f"image_size/patch_size = {side} must be even (pixel shuffle by 2)", where="model init tiny-smolvlm",
                        fix="use e.g. --image-size 56 --patch-size 7")

    def build(tmp: Path) -> None:
        from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration
        from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, smolvlm_vision_tokens()), image_token="<image>",
                           extra={"fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>"})
        vision = SmolVLMVisionConfig(hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden,
                                     num_hidden_layers=k.vision_layers, num_attention_heads=k.vision_heads,
                                     image_size=k.image_size, patch_size=k.patch_size)
        text = LlamaConfig(**_text_kwargs(k, len(tok), tok))
        config = SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=2,
                               image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
        model = _seeded_model(SmolVLMForConditionalGeneration, config, k.seed)
        _set_generation_defaults(model, tok)
        image_processor = SmolVLMImageProcessorPil(do_image_splitting=True, size={"longest_edge": 2 * k.image_size},
                                                   max_image_size={"longest_edge": k.image_size})
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        image_processor.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(chat_template("<image>"), encoding="utf-8")
        image_cfg = json.loads((tmp / "preprocessor_config.json").read_text())
        cfg = {"processor_class": "SmolVLMProcessor", "image_seq_len": (side // 2) ** 2, "image_processor": image_cfg}
        (tmp / "processor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    return _write(Path(out_dir), "tiny-smolvlm", k, build, force, reuse)


QWEN2VL_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MERGE_SIZE = 2


def init_tiny_qwen2vl(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False,
                      arch: str = "tiny-qwen2vl", **knobs) -> Path:
    """Write a Qwen2-VL-style VLM (grid processor: `image_grid_thw`, M-RoPE, 2x2 patch merging).

    `arch="tiny-qwen2_5vl"` writes the Qwen2.5-VL classes instead: the same processor style, with a vision
    tower of windowed attention (RMSNorm, SwiGLU; the last layer attends fully) and `Qwen2_5_VLProcessor`.
    `arch="tiny-qwen3vl"` writes Qwen3-VL: a learned position table in the tower, interleaved M-RoPE, and
    "deepstack" features of an early vision layer added to the first decoder layers' image positions.

    The model, image processor, tokenizer and chat template load with the Auto* classes. The composite
    `Qwen2VLProcessor` also needs a video processor, which transformers implements only with torchvision;
    without torchvision `AutoProcessor.from_pretrained(DIR)` cannot load it (docs/models.md), and gymv's
    loader assembles the same parts itself. The processor config is written by hand in the layout
    `Qwen2VLProcessor.save_pretrained` produces, so that AutoProcessor loads it where torchvision exists.
    """
    if arch not in GRID_ARCHES:
        raise GymvError(f"{arch!r} is not a grid-processor tiny architecture", fix=f"use one of: {', '.join(GRID_ARCHES)}")
    k = knobs_for(arch, **knobs)
    k.validate(arch)
    factor = k.patch_size * MERGE_SIZE
    if k.image_size % factor:
        raise GymvError(f"image size {k.image_size} is not a multiple of patch_size*merge_size = {factor}",
                        where=f"model init {arch}", fix=f"use a multiple of {factor}, e.g. {8 * factor}")

    def build(tmp: Path) -> None:
        import transformers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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
        prefix = GRID_ARCHES[arch]
        if arch == "tiny-qwen2vl":
            vision = dict(depth=k.vision_layers, embed_dim=k.vision_hidden, hidden_size=k.hidden,
                          num_heads=k.vision_heads, mlp_ratio=2, patch_size=k.patch_size,
                          spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
        elif arch == "tiny-qwen3vl":  # learned 2-D position table; deepstack features from the first layer
            side = k.image_size // k.patch_size
            vision = dict(depth=k.vision_layers, hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden,
                          num_heads=k.vision_heads, out_hidden_size=k.hidden, patch_size=k.patch_size,
                          spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, num_position_embeddings=side * side,
                          deepstack_visual_indexes=[0])
            text["head_dim"] = k.hidden // k.heads
            text["rope_parameters"]["mrope_interleaved"] = True
        else:  # windows of 4x4 merged patches, so an image at the 112 px budget spans several windows
            vision = dict(depth=k.vision_layers, hidden_size=k.vision_hidden, intermediate_size=2 * k.vision_hidden,
                          num_heads=k.vision_heads, out_hidden_size=k.hidden, patch_size=k.patch_size,
                          spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, window_size=4 * factor,
                          fullatt_block_indexes=[k.vision_layers - 1])
        config = getattr(transformers, f"{prefix}Config")(
            text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        model = _seeded_model(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, k.seed)
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
        _write_qwen2vl_processor_config(tmp, image_processor, k, f"{prefix}Processor")

    return _write(Path(out_dir), arch, k, build, force, reuse)


def _write_qwen2vl_processor_config(tmp: Path, image_processor, k: TinyKnobs, processor_class: str) -> None:
    image_cfg = json.loads((tmp / "preprocessor_config.json").read_text())
    video_cfg = {
        "video_processor_type": processor_class.replace("Processor", "VideoProcessor").replace("Qwen2_5_VL", "Qwen2VL"),
        "patch_size": k.patch_size, "temporal_patch_size": 2, "merge_size": MERGE_SIZE,
        "size": dict(image_processor.size), "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std), "rescale_factor": image_processor.rescale_factor,
        "resample": int(image_processor.resample), "do_sample_frames": False,
    }
    cfg = {"processor_class": processor_class, "image_processor": image_cfg, "video_processor": video_cfg}
    (tmp / "processor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def init_tiny_text(arch: str, out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False,
                   **knobs) -> Path:
    """Write a text-only causal LM (`tiny-qwen3`: Qwen3ForCausalLM, `tiny-llama`: LlamaForCausalLM) with the
    same tokenizer and chat template as the VLMs minus every vision token: no image processor, no vision
    config, so it loads as a text-only policy. The vision knobs are ignored."""
    if arch not in TEXT_ONLY_ARCHES:
        raise GymvError(f"{arch!r} is not a text-only tiny architecture", fix=f"use one of: {', '.join(TEXT_ONLY_ARCHES)}")
    k = knobs_for(arch, **knobs)
    k.validate(arch)

    def build(tmp: Path) -> None:
        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, []), image_token=None)
        kwargs = _text_kwargs(k, len(tok), tok)
        if arch == "tiny-qwen3":
            from transformers import Qwen3Config as Config
            from transformers import Qwen3ForCausalLM as Model

            kwargs["head_dim"] = k.hidden // k.heads
        else:
            from transformers import LlamaConfig as Config
            from transformers import LlamaForCausalLM as Model
        model = _seeded_model(Model, Config(**kwargs), k.seed)
        _set_generation_defaults(model, tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(chat_template(None), encoding="utf-8")

    return _write(Path(out_dir), arch, k, build, force, reuse)


def init_tiny(arch: str, out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False, **knobs) -> Path:
    """Dispatch on the architecture name used by `gymv model init` and `embedded:<arch>` paths."""
    if arch == "tiny-llava":
        return init_tiny_llava(out_dir, force=force, reuse=reuse, **knobs)
    if arch in GRID_ARCHES:
        return init_tiny_qwen2vl(out_dir, force=force, reuse=reuse, arch=arch, **knobs)
    if arch == "tiny-smolvlm":
        return init_tiny_smolvlm(out_dir, force=force, reuse=reuse, **knobs)
    if arch == "tiny-gemma3":
        return init_tiny_gemma3(out_dir, force=force, reuse=reuse, **knobs)
    if arch in ANYRES_ARCHES:
        return init_tiny_anyres(arch, out_dir, force=force, reuse=reuse, **knobs)
    if arch in TEXT_ONLY_ARCHES:
        return init_tiny_text(arch, out_dir, force=force, reuse=reuse, **knobs)
    if arch in HYBRID_ARCHES:
        return init_tiny_nemotron_omni(out_dir, force=force, reuse=reuse, **knobs)
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
