"""One vision-tower call per training step: each distinct image of a step's samples goes through the tower
once, not once in every micro-batch that holds it.

A tower of a few images a call is bound by the host's launches, not the card: on an H200 the Nano Omni's
RADIO tower took 264 ms for 2 images and 372 ms for 4 (forward and backward, bench/README.md), so a step of
two micro-batches of 2 images each paid 529 ms where one call pays 372; and a group whose samples straddle
micro-batches had its image encoded in each.

Gradients: the features F are computed once, with their graph, before the first micro-batch. Micro-batches
before the last read slices of a detached copy L (a leaf), whose gradient adds up over them; the last one
reads slices of F through `_AddGradient`, whose backward hands F the last micro-batch's gradient plus L's.
So the tower's backward runs once, inside the last micro-batch's backward pass, where FSDP2 reduces the
gradients of every unit (the root's weights the tower uses, such as a final vision norm, included). A step
whose last micro-batch holds no image, or whose pixels pass `MAX_PIXEL_VALUES`, runs the tower per micro-batch.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch

# the most pixel values a step encodes at once (16 images of 512 x 512): the tower's checkpointed block inputs
# live until the last micro-batch's backward (RADIO-H's 32 blocks: 164 KB a 16 x 16 patch, 2.7 GB at this many)
MAX_PIXEL_VALUES = 16 * 3 * 512 * 512

_current: ContextVar[StepImages | None] = ContextVar("gymv_step_images", default=None)


class _AddGradient(torch.autograd.Function):
    """The features as they are; backward adds the gradient the earlier micro-batches left on the leaf."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return features.view_as(features)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        earlier = ctx.leaf.grad
        return (grad if earlier is None else grad + earlier.to(grad.dtype)), None


class StepImages:
    """The features of a step's distinct images (by content hash) in `model`'s tower, for
    `gymv.backends.logprobs` to read during that model's passes (another model, a teacher, encodes its own)."""

    def __init__(self, model, keys: Sequence[str], features: Sequence[torch.Tensor], grid: torch.Tensor | None):
        self.model = model
        self.shapes = [f.shape for f in features]
        self.slots: dict[str, int] = {k: n for n, k in enumerate(keys)}
        rows = [f.reshape(-1, f.shape[-1]) for f in features]
        ends = list(itertools.accumulate(r.shape[0] for r in rows))
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.grid = grid
        self.features = torch.cat(rows)
        self.leaf = self.features.detach().requires_grad_(self.features.requires_grad)
        self._source = self.leaf

    def last_micro_batch(self, last: bool) -> None:
        """Before each micro-batch: whether it is the step's last backward pass (module docstring)."""
        self._source = _AddGradient.apply(self.features, self.leaf) if last else self.leaf

    def lookup(self, model, keys: Sequence[str]) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """(features of `keys` in order, their grid rows), or None: another model, or an image not encoded."""
        if model is not self.model or any(k not in self.slots for k in keys):
            return None
        slots = [self.slots[k] for k in keys]
        feats = [self._source[slice(*self.bounds[n])].view(self.shapes[n]) for n in slots]
        grid = None if self.grid is None else self.grid[torch.tensor(slots, device=self.grid.device)]
        return feats, grid

    @contextlib.contextmanager
    def active(self) -> Iterator[StepImages]:
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


def lookup(model, keys: Sequence[str]) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
    """The active step's features of `keys` in `model`'s tower, or None (no step active, another model, or an
    image it did not encode)."""
    step = _current.get()
    return None if step is None else step.lookup(model, keys)
