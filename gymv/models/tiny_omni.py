"""The tiny Nemotron 3 Omni: a hybrid Mamba-2 / attention / mixture-of-experts decoder (`NemotronHForCausalLM`)
behind a RADIO vision tower, pixel shuffle and an MLP projector (`NemotronH_Omni_Reasoning_V3`).

The layer pattern uses the family's own letters: `M` Mamba-2, `*` attention, `E` mixture of experts (routed
experts with top-k routing plus one shared expert), `-` dense MLP. The checkpoint is what transformers'
`save_pretrained` writes for the class (config keys read alike by transformers 5.19 and 5.24), plus the
family's processor files: the image processor config (flattened patches, `image_grid_hw`), a processor
config naming `NemotronH_Omni_Reasoning_V3Processor`, and a chat template whose `enable_thinking` variable
turns reasoning off (`generation.chat_template_kwargs: {enable_thinking: false}`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gymv.errors import GymvError
from gymv.models.chat_template import chat_template
from gymv.models.nemotron_omni import (IMAGE_END, IMAGE_START, IMAGE_TOKEN, PROCESSOR_CLASS, VIDEO_TOKEN,
                                       VISION_TOKENS, OmniImageProcessor)
from gymv.models.tiny_build import _seeded_model, _set_generation_defaults, _write, knobs_for
# tokenizers loads where a tokenizer is trained

ARCH = "tiny-nemotron-omni"
DEFAULT_PATTERN = "ME*E"  # Mamba, MoE, attention, MoE: the reference model's layer kinds, once each
LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
SHARED_EXPERTS = 1
RADIO_PREFIX_TOKENS = (2, 2)  # class tokens (two: the summary reads the first two), register tokens


def check_pattern(pattern: str) -> list[str]:
    """The layer types of a pattern string; it must hold at least one Mamba, one attention and one MoE layer."""
    bad = sorted(set(pattern) - set(LAYER_KINDS))
    if bad or not {"M", "*", "E"} <= set(pattern):
        raise GymvError(f"layer pattern {pattern!r} is not a hybrid pattern", where=f"model init {ARCH}",
                        fix="use the letters M (Mamba-2), * (attention), E (MoE), - (MLP) with at least one each "
                            "of M, * and E, e.g. --layer-pattern 'ME*E'")
    return [LAYER_KINDS[c] for c in pattern]


def resolve_pattern(k, layers_given: bool):
    """The knobs with `layer_pattern` filled in and `layers` equal to its length: an explicit pattern sets
    the layer count, else the default pattern repeats to `layers` layers."""
    from dataclasses import replace

    if k.layer_pattern and layers_given and k.layers != len(k.layer_pattern):
        raise GymvError(f"--layers {k.layers} disagrees with the {len(k.layer_pattern)}-letter layer pattern",
                        where=f"model init {ARCH}", fix="leave --layers out: the pattern sets the layer count")
    pattern = k.layer_pattern or (DEFAULT_PATTERN * k.layers)[:k.layers]
    check_pattern(pattern)
    if k.experts_per_token > k.experts:
        raise GymvError(f"experts_per_token {k.experts_per_token} exceeds experts {k.experts}",
                        where=f"model init {ARCH}", fix="pass --top-k at most --experts")
    return replace(k, layer_pattern=pattern, layers=len(pattern))


def text_config(k, vocab: int, tok) -> dict:
    """The NemotronH decoder's config: the knobs' widths, Mamba heads of the attention head width."""
    head_dim = k.hidden // k.heads
    return dict(
        vocab_size=vocab, hidden_size=k.hidden, layers_block_type=check_pattern(k.layer_pattern),
        num_attention_heads=k.heads, num_key_value_heads=k.kv_heads, head_dim=head_dim,
        intermediate_size=k.intermediate, max_position_embeddings=4096,
        mamba_num_heads=k.heads, mamba_head_dim=head_dim, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=64, n_routed_experts=k.experts, num_experts_per_tok=k.experts_per_token,
        n_shared_experts=SHARED_EXPERTS, moe_intermediate_size=k.intermediate // 2,
        moe_shared_expert_intermediate_size=k.intermediate // 2, num_nextn_predict_layers=k.mtp_layers,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), tie_word_embeddings=False,
    )


def image_processor(k) -> OmniImageProcessor:
    """Images of up to `image_size` px a side keep their grid; larger ones shrink into (image_size/patch)**2
    patches; every image gets at least 4x4 patches (4 tokens after the 2x2 pixel shuffle)."""
    side = k.image_size // k.patch_size
    return OmniImageProcessor(patch_size=k.patch_size, downsample_ratio=0.5, min_num_patches=16,
                              max_num_patches=side * side, max_model_len=4096)


def _audio_features() -> dict | None:
    """The audio feature extractor's config the family's processor loads with, or None where transformers
    builds it only with librosa (5.19: the vLLM venv); gymv loads the images without the processor then."""
    from transformers import ParakeetFeatureExtractor

    try:
        return ParakeetFeatureExtractor().to_dict()
    except ImportError:
        return None


def init_tiny_nemotron_omni(out_dir: str | os.PathLike, *, force: bool = False, reuse: bool = False,
                            **knobs) -> Path:
    """Write the tiny Nemotron 3 Omni (module docstring); `mtp_layers` sets `num_nextn_predict_layers` (the
    MTP switch: transformers builds no MTP head, only the vision norm such checkpoints carry)."""
    k = knobs_for(ARCH, **knobs)
    k.validate(ARCH)
    k = resolve_pattern(k, knobs.get("layers") is not None)
    if k.image_size % (2 * k.patch_size):
        raise GymvError(f"image size {k.image_size} is not a multiple of 2 * patch size {k.patch_size}",
                        where=f"model init {ARCH}", fix="use e.g. --image-size 96 --patch-size 8")

    def build(tmp: Path) -> None:
        from transformers import NemotronH_Omni_Reasoning_V3 as Model
        from transformers import NemotronH_Omni_Reasoning_V3_Config as Config
        from gymv.models.tokenizer import hf_tokenizer, train_bpe

        tok = hf_tokenizer(train_bpe(k.seed, k.vocab_size, VISION_TOKENS), image_token=IMAGE_TOKEN,
                           extra={"image_start_token": IMAGE_START, "image_end_token": IMAGE_END,
                                  "video_token": VIDEO_TOKEN})
        cls_tokens, registers = RADIO_PREFIX_TOKENS
        vision = dict(model_type="radio", hidden_size=k.vision_hidden, num_hidden_layers=k.vision_layers,
                      num_attention_heads=k.vision_heads, mlp_ratio=2.0, patch_size=k.patch_size,
                      image_size=k.image_size, max_img_size=2 * k.image_size, num_cls_tokens=cls_tokens,
                      num_registers=registers, video_temporal_patch_size=2)
        config = Config(text_config=dict(model_type="nemotron_h", **text_config(k, len(tok), tok)),
                        vision_config=vision, vision_hidden_size=k.vision_hidden, projector_hidden_size=2 * k.hidden,
                        downsample_ratio=0.5, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                        tie_word_embeddings=False)
        model = _seeded_model(Model, config, k.seed)
        _set_generation_defaults(model, tok)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(chat_template(IMAGE_TOKEN, reasoning_switch=True), encoding="utf-8")
        images = image_processor(k)
        (tmp / "preprocessor_config.json").write_text(json.dumps(images.to_dict(), indent=2) + "\n")
        video = {"video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", "patch_size": k.patch_size,
                 "downsample_ratio": 0.5, "video_target_num_patches": images.max_num_patches,
                 "temporal_patch_size": 2, "norm_mean": images.image_mean, "norm_std": images.image_std}
        processor = {"processor_class": PROCESSOR_CLASS, "video_temporal_patch_dim": 2,
                     "image_processor": images.to_dict(), "video_processor": video}
        audio = _audio_features()
        if audio is not None:
            processor["feature_extractor"] = audio
        (tmp / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")

    return _write(Path(out_dir), ARCH, k, build, force, reuse)
