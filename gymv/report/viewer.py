"""Rollout records -> the plain data the HTML viewer renders, with every image saved once as a file.

A record's prompt (`responses_create_params.input`) and `response.output` become one list of entries in
order, each marked with the turn it belongs to: turn 0 is the prompt; a model item (reasoning, assistant
message, function call) after anything the environment added starts the next turn. Token ids and
logprobs are left out (they are for training, not reading). Images are decoded from their data URLs,
identified by their bytes' magic number (never by the claimed media type, and never SVG), and written
as images/<sha256 prefix>.<ext>, so the G rollouts of a prompt share one file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv.data.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageError, split_data_url
from gymv.envs.responses import decode_parts
from gymv.io import atomic_write_bytes

_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpg"), (b"GIF87a", "gif"), (b"GIF89a", "gif"), (b"BM", "bmp"))
_MODEL_TYPES = ("reasoning", "function_call")
_TEXT_LIMIT = 20000  # characters of one text shown; the rest is cut with a note


def _kind(raw: bytes) -> str | None:
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _MAGIC:
        if raw.startswith(magic):
            return ext
    return None


def _pixels(raw: bytes) -> tuple[int, int] | None:
    """Width and height from the image header alone (nothing is decompressed), or None if unreadable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw)) as img:
            return img.size
    except Image.DecompressionBombError as e:  # PIL refuses the header itself: far over any limit
        nums = [int(n) for n in re.findall(r"\((\d+) pixels\)", str(e))]
        return (nums[0], 1) if nums else (DEFAULT_MAX_PIXELS + 1, 1)
    except Exception:
        return None


@dataclass
class ImageStore:
    """Writes each distinct image once under `root/images/`; returns its path relative to `root`."""

    root: Path
    written: dict[str, str] = field(default_factory=dict)  # sha256 -> relative path
    refused: int = 0

    def save(self, url: Any) -> dict:
        try:
            _, payload = split_data_url(url)
            if len(payload) > (DEFAULT_MAX_BYTES * 4) // 3 + 4:
                raise ImageError("too large", fix="the image is left out of the viewer")
            raw = base64.b64decode(payload, validate=True)
        except (ImageError, binascii.Error, ValueError) as e:
            self.refused += 1
            reason = e.message if isinstance(e, ImageError) else str(e)
            return {"kind": "image", "missing": f"image not shown: {reason}"}
        ext = _kind(raw)
        if ext is None:
            self.refused += 1
            return {"kind": "image", "missing": "image not shown: not a PNG, JPEG, GIF, WebP or BMP file"}
        size = _pixels(raw)
        if size is None or size[0] * size[1] > DEFAULT_MAX_PIXELS:  # a browser would decode it in full
            self.refused += 1
            shown = f"{size[0] * size[1]} pixels, over the {DEFAULT_MAX_PIXELS} pixel limit" if size else "unreadable"
            return {"kind": "image", "missing": f"image not shown: {shown}"}
        digest = hashlib.sha256(raw).hexdigest()
        rel = self.written.get(digest)
        if rel is None:
            rel = f"images/{digest[:20]}.{ext}"
            path = self.root / rel
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, raw)
            self.written[digest] = rel
        return {"kind": "image", "src": rel}


def _text(value: Any) -> str:
    s = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(s) > _TEXT_LIMIT:
        s = s[:_TEXT_LIMIT] + f"\n… ({len(s) - _TEXT_LIMIT} more characters not shown)"
    return s


def _parts(content: Any, images: ImageStore) -> list[dict]:
    """Message content (a string or a list of input/output parts) as text and image parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"kind": "text", "text": _text(content)}]
    if not isinstance(content, list):
        return [{"kind": "text", "text": _text(content)}]
    out = []
    for p in content:
        if not isinstance(p, Mapping):
            out.append({"kind": "text", "text": _text(p)})
        elif p.get("type") in ("input_image", "output_image", "image_url") or "image_url" in p:
            url = p.get("image_url")
            if isinstance(url, Mapping):  # chat-completions style {"url": ...}
                url = url.get("url")
            out.append(images.save(url))
        elif "text" in p:
            out.append({"kind": "text", "text": _text(p["text"])})
        elif p.get("type") == "refusal":
            out.append({"kind": "text", "text": _text(p.get("refusal", ""))})
        else:
            out.append({"kind": "text", "text": _text(p)})
    return out


def _arguments(raw: Any) -> str:
    """Tool-call arguments as JSON: one line when short, indented when long; unparseable text as it is."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            return _text(raw)
    else:
        value = raw
    line = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return _text(line if len(line) <= 100 else json.dumps(value, ensure_ascii=False, indent=1))


def _entry(item: Any, images: ImageStore) -> dict:
    if not isinstance(item, Mapping):
        return {"kind": "message", "role": "unknown", "parts": [{"kind": "text", "text": _text(item)}]}
    t = item.get("type", "message")
    if t == "message" or (t not in ("reasoning", "function_call", "function_call_output") and "role" in item):
        return {"kind": "message", "role": str(item.get("role", "assistant")), "parts": _parts(item.get("content"), images)}
    if t == "reasoning":
        texts = [s.get("text", "") for s in item.get("summary", []) if isinstance(s, Mapping)]
        texts += [c.get("text", "") for c in item.get("content", []) or [] if isinstance(c, Mapping)]
        return {"kind": "reasoning", "parts": [{"kind": "text", "text": _text("\n".join(texts))}]}
    if t == "function_call":
        return {"kind": "tool_call", "name": str(item.get("name", "?")), "call_id": str(item.get("call_id", "")),
                "arguments": _arguments(item.get("arguments", ""))}
    if t == "function_call_output":
        return {"kind": "tool_result", "call_id": str(item.get("call_id", "")),
                "parts": _parts(decode_parts(item.get("output")), images)}
    return {"kind": "other", "type": str(t), "parts": [{"kind": "text", "text": _text(dict(item))}]}


def _is_model(item: Any) -> bool:
    if not isinstance(item, Mapping):
        return False
    t = item.get("type", "message")
    return t in _MODEL_TYPES or (t == "message" and item.get("role", "assistant") == "assistant")


# (what the row or verifier says is right, what the verifier read from the model's output), per environment
_ANSWER_FIELDS = (("expected_count", "predicted_count"), ("expected_answer", "predicted_answer"), ("expected", "answer"))


def _short(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 200 else text[:197] + "..."


def answers(record: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(expected, parsed) answer of a rollout, from the fields its verifier writes; (None, None) when it has none.

    A parsed answer of None with an expected one means the verifier found no answer in the output ("none")."""
    for want, got in _ANSWER_FIELDS:
        if want in record and got in record:
            return _short(record[want]), _short(record[got]) or "none"
    if "clicked_x" in record and isinstance(record.get("circles"), list):  # circle-click: a point in the target
        target = next((c for c in record["circles"] if isinstance(c, Mapping) and c.get("color") == record.get("target_color")), None)
        expected = (f"inside the {record.get('target_color')} circle at ({target.get('x')}, {target.get('y')}), "
                    f"radius {target.get('radius')}") if target else None
        x, y = record.get("clicked_x"), record.get("clicked_y")
        return expected, "none" if x is None else f"click ({x}, {y})"
    if "named" in record and isinstance(record.get("polygons"), list):  # polygon-naming
        truth = [" ".join(str(p.get(k, "")) for k in ("color", "shape")) for p in record["polygons"] if isinstance(p, Mapping)]
        return _short(truth), _short(record["named"])
    return None, None


def rollout_view(split: str, step: int, record: Mapping[str, Any], images: ImageStore) -> dict:
    """One rollout as the viewer shows it: ids, reward, status and its entries, each with its turn."""
    params = record.get("responses_create_params") or {}
    inputs = params.get("input", [])
    if isinstance(inputs, str):
        inputs = [{"role": "user", "content": inputs}]
    entries = [dict(_entry(item, images), turn=0) for item in inputs if isinstance(inputs, list)]
    response = record.get("response") or {}
    turn, previous_model = 0, False
    names: dict[str, str] = {}  # call_id -> tool name, so a result says which tool answered
    for item in response.get("output", []) or []:
        model = _is_model(item)
        if model and not previous_model:
            turn += 1
        previous_model = model
        e = dict(_entry(item, images), turn=turn)
        if e["kind"] == "tool_call" and e["call_id"]:
            names[e["call_id"]] = e["name"]
        elif e["kind"] == "tool_result":
            e["name"] = names.get(e["call_id"])
        entries.append(e)
    gymv = record.get("_gymv") if isinstance(record.get("_gymv"), Mapping) else {}
    agent = gymv.get("agent_name")
    if not agent and isinstance(record.get("agent_ref"), Mapping):
        agent = record["agent_ref"].get("name")
    tools = [str(t.get("name")) for t in params.get("tools", []) or [] if isinstance(t, Mapping) and t.get("name")]
    reward = record.get("reward")
    expected, parsed = answers(record)
    advantage = gymv.get("advantage")
    return {
        "split": split, "step": int(step),
        "task": record.get("_ng_task_index"), "rollout": record.get("_ng_rollout_index"),
        "reward": float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None,
        "agent": agent, "turns": turn, "tools": tools,
        "finish": gymv.get("finish_reason"), "error": gymv.get("error") or None,
        "failure": record.get("failure_reason") or None,  # why the reward is not full: the model's fault
        "truncated": bool(record.get("truncated")),
        "expected": expected, "parsed": parsed,
        "advantage": float(advantage) if isinstance(advantage, (int, float)) and not isinstance(advantage, bool) else None,
        "entries": entries,
    }


def rollout_views(rollouts: Iterable[tuple[str, int, Mapping]], root: str | os.PathLike) -> tuple[list[dict], ImageStore]:
    """Every rollout's view, newest step first (within a step: training before validation, then file order)."""
    images = ImageStore(Path(root))
    views = [rollout_view(split, step, rec, images) for split, step, rec in rollouts]
    order = {"train": 0, "val": 1}
    views = [v for _, v in sorted(enumerate(views), key=lambda iv: (-iv[1]["step"], order.get(iv[1]["split"], 2), iv[0]))]
    return views, images


def groups(views: list[dict]) -> list[dict]:
    """The rollouts of one prompt at one step (a GRPO group: the same task, sampled G times) as one card: the
    prompt once, then each sample. Rollouts without a task index stand alone. Keeps the views' order."""
    out: list[dict] = []
    index: dict[tuple, int] = {}
    for i, v in enumerate(views):
        key = (v["split"], v["step"], v["task"]) if v["task"] is not None else ("single", i)
        if key not in index:
            index[key] = len(out)
            out.append({"split": v["split"], "step": v["step"], "task": v["task"], "agent": v["agent"],
                        "prompt": [e for e in v["entries"] if e["turn"] == 0], "samples": []})
        out[index[key]]["samples"].append(i)
    for g in out:
        rewards = [views[i]["reward"] for i in g["samples"] if views[i]["reward"] is not None]
        g["reward_mean"] = sum(rewards) / len(rewards) if rewards else None
        g["zero_std"] = len(g["samples"]) > 1 and len(set(rewards)) == 1 and len(rewards) == len(g["samples"])
    return out
