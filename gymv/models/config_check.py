"""A checkpoint's config.json checked before anything loads it: readable JSON, and what its model family
requires (`CONFIG_CHECKS`, keyed by `model_type`).

transformers accepts many configs that do not describe the weights beside them (a layer pattern one layer
short loads, drops that layer's tensors and trains on); and where it refuses one, its error is a traceback of
its own. `gymv model info`, `gymv lint` (a recipe's local model folder) and `gymv train`'s pre-flight call
`check_checkpoint`, so such a checkpoint is one line naming the config.json key and the fix, before Ray starts.
What no config check can see (a tensor the model does not use, one it lacks) is refused where the weights load
(gymv.backends.policy).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.registry import import_object

# model_type -> "module:function" of a check(ckpt folder, config dict) that raises GymvError
CONFIG_CHECKS: dict[str, str] = {
    "nemotron_h_omni": "gymv.models.nemotron_omni:check_config",
    "nemotron_h": "gymv.models.nemotron_omni:check_text_config",
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own bound on a header


def config_file(ckpt: str | os.PathLike) -> Path:
    return Path(ckpt) / "config.json"


def read_config(ckpt: str | os.PathLike) -> dict:
    """The checkpoint's config.json as a dict; unreadable, not JSON, or not an object is one line."""
    f = config_file(ckpt)
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise GymvError(f"cannot read config.json: {e.strerror or e}", where=str(f),
                        fix="point at a Hugging Face checkpoint folder") from None
    except UnicodeDecodeError:
        raise GymvError("config.json is not UTF-8 text", where=str(f),
                        fix="restore the checkpoint's config.json (it is written by save_pretrained)") from None
    except json.JSONDecodeError as e:
        raise GymvError(f"config.json is not valid JSON ({e.msg})", where=f"{f} line {e.lineno}",
                        fix="restore the checkpoint's config.json (truncated or edited by hand?)") from None
    if not isinstance(data, dict):
        raise GymvError(f"config.json holds a {type(data).__name__}, not an object of keys", where=str(f),
                        fix="restore the checkpoint's config.json")
    return data


def check_checkpoint(ckpt: str | os.PathLike) -> None:
    """Refuse a checkpoint whose config.json cannot be read, breaks what its family requires, or is refused
    by transformers' own config class (a wrong type, a value out of range: one line, not its traceback)."""
    config = read_config(ckpt)
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    if model_type in CONFIG_CHECKS:
        import_object(CONFIG_CHECKS[model_type])(Path(ckpt), config)
    _check_with_transformers(Path(ckpt), config, model_type)


def _check_with_transformers(ckpt: Path, config: dict, model_type: str | None) -> None:
    """Build the model type's transformers config (its class only: no model, no code of the checkpoint's)."""
    from transformers import CONFIG_MAPPING, AutoConfig
    from huggingface_hub.errors import StrictDataclassError

    if model_type is None:
        raise GymvError("config.json has no `model_type`", where=str(config_file(ckpt)),
                        fix="restore the checkpoint's config.json (save_pretrained writes model_type)")
    if model_type not in CONFIG_MAPPING:
        return  # a type only the checkpoint's own code knows (auto_map): the loader decides
    try:
        AutoConfig.from_pretrained(ckpt)
    except StrictDataclassError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise GymvError(f"transformers refuses config.json: {' '.join(lines)[:300]}", where=str(config_file(ckpt)),
                        fix="restore the key it names to the value the weights were saved with") from None
    except (ValueError, TypeError, KeyError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GymvError(f"transformers refuses config.json: {text[:300]}", where=str(config_file(ckpt)),
                        fix="restore the checkpoint's config.json") from None


def weight_shapes(ckpt: str | os.PathLike) -> dict[str, list[int]] | None:
    """Each stored tensor's name and shape, from the safetensors headers alone (no tensor is read); None when
    the checkpoint has no safetensors files or a header cannot be read (the loader reports those itself)."""
    folder = Path(ckpt)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, list[int]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > _MAX_HEADER:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error):
            return None
        if not isinstance(header, dict):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                out[name] = entry["shape"]
    return out


# ---- small readers for the family checks ----------------------------------------------------------------

class Keys:
    """Typed reads of one section of a config.json, each failure one line naming `prefix + key`."""

    def __init__(self, ckpt: Path, section: dict, prefix: str = ""):
        self.where = str(config_file(ckpt))
        self.section, self.prefix = section, prefix

    def fail(self, key: str, message: str, fix: str) -> GymvError:
        return GymvError(f"`{self.prefix}{key}` {message}", where=self.where, fix=fix)

    def has(self, key: str) -> bool:
        return self.section.get(key) is not None

    def int(self, key: str, *, minimum: int = 1, required: bool = True, default: int | None = None) -> int | None:
        """An integer (never a bool, a float or a string) of at least `minimum`."""
        value = self.section.get(key)
        if value is None:
            if required:
                raise self.fail(key, "is missing",
                                f"set `{self.prefix}{key}` to the value the weights were trained with")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"is {json.dumps(value)}, not an integer", f"set `{self.prefix}{key}` to an integer")
        if value < minimum:
            raise self.fail(key, f"is {value}, it must be at least {minimum}",
                            f"set `{self.prefix}{key}` to an integer of at least {minimum}")
        return value

    def number(self, key: str, *, positive: bool = True) -> float | None:
        """A real number (not a bool, not a string), positive where asked; None when absent."""
        value = self.section.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.fail(key, f"is {json.dumps(value)}, not a number", f"set `{self.prefix}{key}` to a number")
        if positive and value <= 0:
            raise self.fail(key, f"is {value}, it must be positive", f"set `{self.prefix}{key}` to a positive number")
        return float(value)

    def section_of(self, key: str, *, required: bool = True) -> dict | None:
        value = self.section.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, dict):
            what = "is missing" if value is None else f"is a {type(value).__name__}, not an object of keys"
            raise self.fail(key, what, f"restore the checkpoint's `{self.prefix}{key}` section")
        return value

    def choice(self, key: str, allowed: Any, fix: str, *, required: bool = True) -> Any:
        value = self.section.get(key)
        if value is None and not required:
            return None
        if value not in allowed:
            raise self.fail(key, "is missing" if value is None else f"is {json.dumps(value)}", fix)
        return value
