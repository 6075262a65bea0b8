"""What every tiny checkpoint builder shares: the size knobs and their defaults per architecture, the seeded
construction, and the atomic write into place (tiny.py and tiny_omni.py both build on it)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gymv.errors import GymvError
from gymv.io import follow_umask
from gymv.models.quiet import quiet_transformers

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
    # hybrid decoders only (tiny-nemotron-omni): layer letters, routed experts, top-k, MTP layers
    layer_pattern: str = ""
    experts: int = 4
    experts_per_token: int = 2
    mtp_layers: int = 0

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
        hybrid = dict(layer_pattern="", experts=4, experts_per_token=2, mtp_layers=0)
        changed = sorted(n for n, v in hybrid.items() if getattr(self, n) != v)
        if changed and arch not in HYBRID_ARCHES:
            raise bad(f"{', '.join(changed)} only apply to the hybrid architectures ({', '.join(HYBRID_ARCHES)})",
                      "leave them out for this architecture")
        if self.experts < 1 or self.experts_per_token < 1 or self.mtp_layers < 0:
            raise bad("experts and experts_per_token must be at least 1, mtp_layers at least 0",
                      "pass e.g. --experts 4 --top-k 2 --mtp-layers 0")


ARCHES = ("tiny-llava", "tiny-llava-next", "tiny-llava-onevision", "tiny-qwen2vl", "tiny-qwen2_5vl", "tiny-qwen3vl",
          "tiny-gemma3", "tiny-smolvlm", "tiny-nemotron-omni", "tiny-qwen3", "tiny-llama")
HYBRID_ARCHES = ("tiny-nemotron-omni",)  # Mamba-2 / attention / MoE decoders
ANYRES_ARCHES = ("tiny-llava-next", "tiny-llava-onevision")
GRID_ARCHES = {"tiny-qwen2vl": "Qwen2VL", "tiny-qwen2_5vl": "Qwen2_5_VL", "tiny-qwen3vl": "Qwen3VL"}  # arch -> transformers class prefix
TEXT_ONLY_ARCHES = ("tiny-qwen3", "tiny-llama")
DEFAULTS = {"tiny-llava": TinyKnobs(), "tiny-qwen2vl": TinyKnobs(image_size=112),
            "tiny-qwen2_5vl": TinyKnobs(image_size=112), "tiny-qwen3vl": TinyKnobs(image_size=112),
            "tiny-llava-next": TinyKnobs(), "tiny-llava-onevision": TinyKnobs(), "tiny-gemma3": TinyKnobs(),
            "tiny-smolvlm": TinyKnobs(), "tiny-nemotron-omni": TinyKnobs(layers=4, image_size=96, patch_size=8, vision_layers=1),
            "tiny-qwen3": TinyKnobs(), "tiny-llama": TinyKnobs()}


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


def _set_generation_defaults(model, tok) -> None:
    gc = model.generation_config
    gc.eos_token_id = tok.eos_token_id
    gc.pad_token_id = tok.pad_token_id
    gc.bos_token_id = None
