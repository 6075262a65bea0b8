"""A checkpoint's tensors under the names of the Hugging Face model built from it, each read when asked for.

transformers renames a checkpoint's tensors as it loads them, and converts some (Nemotron-H's experts are
stored one by one and stacked into one tensor per layer; RADIO's fused qkv is split in three). Here the same
renamings and converters (transformers' own, for the model built) are applied to names alone, so a reader
asks for a model tensor, or a slice of one, and only the stored tensors (or slices) it comes from are read:
a slice of stacked experts reads those experts alone; a tensor another converter makes is read whole and
converted as from_pretrained converts it. A Megatron rank reads its shard of the decoder this way
(`hf_to_megatron` takes this mapping as it takes a state dict) and the rest of the model whole
(`fill_except`), with the HF model's skeleton on the meta device (gymv.backends.policy, `skeleton=True`).
`read`, `chunk`, `rows` and `cols` slice a state dict and such a mapping alike, the mapping reading the
slice alone.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from gymv.backends.checkpoint_files import CheckpointFiles


def shape_of(weights: Mapping[str, Tensor], name: str) -> tuple[int, ...]:
    """The shape of `weights[name]`, without reading it where `weights` reads lazily."""
    lazy = getattr(weights, "shape", None)
    return tuple(lazy(name)) if callable(lazy) else tuple(weights[name].shape)


def read(weights: Mapping[str, Tensor], name: str, index: tuple[slice, ...] = ()) -> Tensor:
    """`weights[name][index]` (a slice per leading dimension); a lazy mapping reads that slice alone."""
    lazy = getattr(weights, "read", None)
    if callable(lazy):
        return lazy(name, index)
    return weights[name][index] if index else weights[name]


def chunk(hf: Mapping[str, Tensor], name: str, rank: int, count: int, dim: int = 0,
          lead: tuple[slice, ...] = ()) -> Tensor:
    """`hf[name][lead].chunk(count, dim)[rank]` (`lead`: slices of the dimensions before `dim`), read as that
    slice alone where `hf` reads lazily."""
    size = shape_of(hf, name)
    dim = dim % len(size)
    step = -(-size[dim] // count)
    index = (*lead, *[slice(None)] * (dim - len(lead)), slice(rank * step, min((rank + 1) * step, size[dim])))
    return read(hf, name, index)


def rows(hf: Mapping[str, Tensor], name: str, rank: int, tp: int) -> Tensor:
    """TP rank `rank`'s rows of `hf[name]` (column parallel: output features, vocabulary)."""
    return chunk(hf, name, rank, tp, 0)


def cols(hf: Mapping[str, Tensor], name: str, rank: int, tp: int) -> Tensor:
    """TP rank `rank`'s columns of `hf[name]` (row parallel: input features, the last dimension)."""
    return chunk(hf, name, rank, tp, -1)


def _own(t: Tensor) -> Tensor:
    """A tensor with a storage of its own (a converter's chunks are views of the tensor it split)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class ModelWeights(Mapping[str, Tensor]):
    """`files` under the state-dict names of `model` (a skeleton on the meta device will do), in each tensor's
    model dtype. GymvError naming the checkpoint where its tensors do not fill the model exactly, as
    gymv.backends.policy.load_weights refuses such a checkpoint when it loads it whole."""

    def __init__(self, files: CheckpointFiles, model: Any):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.files, self.model = files, model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        self._meta = {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}
        self._plain: dict[str, str] = {}  # model name -> stored name
        self._groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}  # first target -> converter, sources
        self._group_of: dict[str, str] = {}  # each converted model name -> its group's first target
        self._tied = {k: v for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items() if k in meta}
        unexpected = set()
        for key in sorted(files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if name not in meta and key in meta:
                name, pattern = rename_source_key(key, [], [], base_model_prefix=model.base_model_prefix,
                                                  meta_state_dict=meta)
            if name not in meta:
                unexpected.add(name)
            elif pattern is None:
                self._plain[name] = key
            else:
                converter = by_pattern[pattern]
                self._groups.setdefault(name, (converter, []))[1].append((key, pattern))
                for target in converter.target_patterns:
                    self._group_of[name.replace(converter.target_patterns[0], target, 1)] = name
        self._check(set(meta) - set(self._plain) - set(self._group_of) - set(self._tied), unexpected)
        self._made: dict[str, Tensor] = {}  # a converter's tensors not asked for yet

    def _check(self, missing: set[str], unexpected: set[str]) -> None:
        from gymv.backends.policy import check_loading_info

        info = SimpleNamespace(missing_keys=missing, unexpected_keys=unexpected)
        adjust = getattr(self.model, "_adjust_missing_and_unexpected_keys", None)
        if callable(adjust):  # the exceptions transformers makes when it loads (e.g. Nemotron-H's mtp.* layers)
            adjust(info)
        mismatched = [(name, self.files.shape(key), self._meta[name][0]) for name, key in self._plain.items()
                      if self.files.shape(key) != self._meta[name][0]]
        for first, (converter, sources) in self._groups.items():
            if self._stacks(converter):
                stored = (len(sources), *self.files.shape(sources[0][0]))
                if stored != self._meta[first][0]:
                    mismatched.append((first, stored, self._meta[first][0]))
        check_loading_info({"missing_keys": info.missing_keys, "unexpected_keys": info.unexpected_keys,
                            "mismatched_keys": mismatched}, str(self.files.path))

    @staticmethod
    def _stacks(converter) -> bool:
        """A converter that only stacks one stored tensor per expert along a new first dimension."""
        from transformers.core_model_loading import MergeModulelist

        ops = converter.operations
        return (len(converter.source_patterns) == 1 and len(converter.target_patterns) == 1 and len(ops) == 1
                and type(ops[0]) is MergeModulelist and ops[0].dim == 0)

    def __getitem__(self, name: str) -> Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._plain, *self._group_of, *self._tied])

    def __len__(self) -> int:
        return len(self._plain) + len(self._group_of) + len(self._tied)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[self._tied.get(name, name)][0]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """Model tensor `name`, or its slice `index` (one slice per leading dimension), in the model's dtype."""
        name = self._tied.get(name, name)
        dtype = self._meta[name][1]
        if name in self._plain:
            return self.files.read(self._plain[name], index).to(dtype)
        first = self._group_of[name]
        converter, sources = self._groups[first]
        if self._stacks(converter):
            keys = [key for key, _ in sources]
            keys = keys[index[0]] if index else keys
            return torch.stack([self.files.read(key, index[1:]) for key in keys]).to(dtype)
        if name not in self._made:
            self._made.update(self._convert(first))
        whole = self._made.pop(name)
        return _own(whole[index] if index else whole).to(dtype)

    def _convert(self, first: str) -> dict[str, Tensor]:
        """Every tensor a converter makes from its group of stored tensors, as from_pretrained makes them (those
        not asked for yet are kept until they are: a group is read once)."""
        converter, sources = self._groups[first]
        converter = copy.deepcopy(converter)
        for key, pattern in sources:
            converter.add_tensor(first, key, pattern, functools.partial(self.files.read, key))
        made = converter.convert(first, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in made.items()}


def fill_except(model: torch.nn.Module, weights: ModelWeights, skip: tuple[str, ...]) -> None:
    """Give every weight and buffer of a meta-device `model` whose name does not start with one of `skip` (the
    decoder and head, which a Megatron rank reads as its shard) its value on the host: stored tensors read
    whole from `weights`, buffers the checkpoint does not hold computed as from_pretrained computes them
    (the owning model's `_init_weights`)."""
    from transformers import PreTrainedModel

    state = set(model.state_dict())

    def owner(module_name: str):
        parts = module_name.split(".") if module_name else []
        for n in range(len(parts), -1, -1):
            candidate = model.get_submodule(".".join(parts[:n]))
            if isinstance(candidate, PreTrainedModel):
                return candidate
        return None

    kept = [(name, module) for name, module in model.named_modules() if not f"{name}.".startswith(skip)]
    with torch.no_grad():
        for name, module in kept:
            computed = [b for b, t in module._buffers.items() if t is not None and t.is_meta
                        and f"{name}.{b}".lstrip(".") not in state]
            for b in computed:
                module._buffers[b] = torch.empty_like(module._buffers[b], device="cpu")
            if computed and owner(name) is not None:
                owner(name)._init_weights(module)
        for name, module in kept:
            for table in (module._parameters, module._buffers):
                for leaf, t in table.items():
                    full = f"{name}.{leaf}".lstrip(".")
                    if t is None or full not in state or full.startswith(skip):
                        continue
                    value = weights[full]
                    table[leaf] = (torch.nn.Parameter(value, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else value)
