"""A Hugging Face checkpoint's safetensors files (one `model.safetensors`, or the shards its
`model.safetensors.index.json` names) read one tensor, or one slice of one tensor, at a time.

A Megatron rank holds a slice of most weights and one block of the experts; reading the checkpoint this way
(through gymv.backends.model_weights, which puts the model's names on it) costs it its shard in host memory,
not the model. Every read is logged by checkpoint name and size, so a rank can say how much it read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

from torch import Tensor

from gymv.errors import GymvError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _header(file: Path) -> dict[str, dict]:
    """The tensors a safetensors file holds (name -> dtype, shape, data_offsets), from its JSON header alone."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def safetensors_layout(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor of the checkpoint folder `path`; GymvError naming the folder when it holds no
    safetensors (e.g. only pytorch_model.bin), which cannot be read a slice at a time."""
    path = Path(path)
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise GymvError(f"cannot read {INDEX}: {e}", where=str(index),
                            fix="re-save the checkpoint (save_pretrained writes the index with its shards)") from None
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE).exists():
        return dict.fromkeys(_header(path / SINGLE), path / SINGLE)
    found = sorted(p.name for p in (*path.glob("*.bin"), *path.glob("*.safetensors"))) or ["no weight files"]
    raise GymvError(f"the checkpoint has neither {SINGLE} nor {INDEX} (it holds {', '.join(found[:3])}): a Megatron "
                    "rank reads its shard of the model from safetensors", where=str(path),
                    fix="re-save it as safetensors (transformers' save_pretrained writes them, with the index when "
                        "it shards them) and point the recipe at that folder")


class CheckpointFiles(Mapping[str, Tensor]):
    """The checkpoint's tensors under their stored names, each read from disk when asked for (`read` takes a
    slice per leading dimension and reads that slice alone). `read_bytes`: the bytes read so far, by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._where = safetensors_layout(self.path)
        self._headers: dict[Path, dict[str, dict]] = {}
        self._open: dict[Path, object] = {}
        self.read_bytes: dict[str, int] = {}

    def __getitem__(self, name: str) -> Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def _entry(self, name: str) -> dict:
        file = self._where[name]
        if file not in self._headers:
            self._headers[file] = _header(file)
        return self._headers[file][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def nbytes(self, name: str) -> int:
        start, end = self._entry(name)["data_offsets"]
        return end - start

    def shards(self) -> list[Path]:
        """The files the checkpoint's tensors are stored in."""
        return sorted(set(self._where.values()))

    def total_bytes(self) -> int:
        """The bytes of every tensor of the checkpoint: what a rank reading the whole model reads."""
        return sum(self.nbytes(name) for name in self._where)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """The stored tensor `name`, or its slice `index` (one slice per leading dimension), read alone."""
        from safetensors import safe_open

        file = self._where[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        part = self._open[file].get_slice(name)
        tensor = part[index] if index else part[...]
        self.read_bytes[name] = self.read_bytes.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        """Let go of the open files (the log stays)."""
        self._open.clear()
