"""Preprocessed pixels by image content, so that the passes of a training step over the same rollouts (old
logprobs, the reference's, the policy's own forward) run the image processor once per picture, not once per
pass. The processor runs on the host before the device can start a forward pass: for a GRPO micro-batch of
16 pictures it was the largest piece of host time in a profiled step.

Entries are keyed by `image_hash` (pixels, mode and size), so equal pictures share one entry and a changed
picture is a new one. The cache is bounded in bytes and drops the least recently used entries. A family whose
inputs cannot be joined picture by picture (per-batch padding) is preprocessed whole, uncached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from gymv.backends.multimodal import (PREPROCESS_THREADS, ImageInputs, MultimodalAdapter, join_inputs,
                                      preprocess_threaded)

DEFAULT_MAX_BYTES = 512 << 20


def _nbytes(inputs: ImageInputs) -> int:
    tensors = [inputs.pixel_values, inputs.image_grid_thw, inputs.image_sizes, *inputs.extra.values()]
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


def _each(adapter: MultimodalAdapter, images: list) -> list[ImageInputs]:
    """Each picture preprocessed on its own (on several threads): an entry never carries padding that a
    batch of other pictures gave it, so joining entries equals one call wherever their shapes agree."""
    one = lambda im: adapter.preprocess([im])  # noqa: E731
    n = min(PREPROCESS_THREADS, len(images))
    if n <= 1:
        return [one(im) for im in images]
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, images))


class PixelCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self.joinable = True  # False once this family's inputs failed to join: then nothing is cached
        self._entries: OrderedDict[str, tuple[ImageInputs, int]] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._bytes = 0
        self._lock = threading.RLock()  # a future already done runs its callback at once, under the lock
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def prefetch(self, adapter: MultimodalAdapter, images: Sequence, keys: Sequence[str]) -> None:
        """Start preprocessing the pictures not yet cached on background threads, so that a step's host work
        before its first forward pass (planning, collating, packing) and its earlier micro-batches' device
        work hide it. `inputs` waits for a picture still in flight."""
        if not self.joinable:
            return
        with self._lock:
            todo = {k: im for k, im in zip(keys, images) if k not in self._entries and k not in self._pending}
            if not todo:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=PREPROCESS_THREADS, thread_name_prefix="gymv-pixels")
            for k, im in todo.items():
                future = self._pending[k] = self._pool.submit(adapter.preprocess, [im])
                future.add_done_callback(lambda f, k=k: self._settle(k, f))

    def _settle(self, key: str, future: Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if future.exception() is None:  # a failing picture raises where `inputs` needs it
                self._store(key, future.result())

    def _store(self, key: str, entry: ImageInputs) -> None:
        if key in self._entries:
            return
        size = _nbytes(entry)
        self._entries[key] = (entry, size)
        self._bytes += size
        while self._bytes > self.max_bytes and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def inputs(self, adapter: MultimodalAdapter, images: Sequence, keys: Sequence[str],
               pin: bool = False) -> ImageInputs:
        """What `adapter.preprocess(images)` returns; `keys[i]` is `image_hash(images[i])`. `pin`: the joined
        pixels in pinned memory, ready for a copy to a GPU that does not wait."""
        if not self.joinable or not images:
            return preprocess_threaded(adapter, images)
        found: dict[str, ImageInputs] = {}
        waiting: dict[str, Future] = {}
        with self._lock:
            for k in keys:
                if k in self._entries:
                    self._entries.move_to_end(k)
                    found[k] = self._entries[k][0]
                elif k in self._pending:
                    waiting[k] = self._pending[k]
        todo: dict[str, object] = {}
        for k, im in zip(keys, images):
            if k not in found and k not in waiting:
                todo.setdefault(k, im)
        self.hits += len(keys) - sum(1 for k in keys if k in todo)
        self.misses += len(todo)
        if todo:
            found.update(zip(todo, _each(adapter, list(todo.values()))))
        found.update((k, f.result()) for k, f in waiting.items())
        joined = join_inputs([found[k] for k in keys], pin=pin)
        if joined is None:
            self.joinable = False
            return preprocess_threaded(adapter, images)
        with self._lock:
            for k in todo:
                self._store(k, found[k])
        return joined


def pixel_cache(adapter: MultimodalAdapter) -> PixelCache:
    """The adapter's own cache (one per loaded policy: its processor fixes what the pixels are)."""
    cache = getattr(adapter, "_pixel_cache", None)
    if cache is None:
        cache = adapter._pixel_cache = PixelCache()
    return cache
