"""Decode each distinct image of a rollout batch once and give every user of it the same object.

The G generations of one prompt carry the same data URL (and deterministic tools return the same image to
each of them). Decoding it once and reusing the PIL object and its content hash keeps decode time and
memory flat in G, and the generation backend's encoder cache, keyed by that hash, then encodes it once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gymv.backends.multimodal import image_hash
from gymv.data import images as image_io
from gymv.envs.protocol import Image


class ImageCache:
    """Data URL -> (decoded RGB image, content hash), decoded with the run's safety limits."""

    def __init__(self, *, max_pixels: int | None = None, max_bytes: int | None = None):
        self.max_pixels = max_pixels or image_io.DEFAULT_MAX_PIXELS
        self.max_bytes = max_bytes or image_io.DEFAULT_MAX_BYTES
        self._by_url: dict[str, tuple[Any, str]] = {}
        self._prefetched: set[str] = set()  # decoded ahead, not asked for yet: the first `get` is no hit
        self.decodes = 0
        self.hits = 0
        self.decode_s = 0.0  # decoding and hashing, for the rollout's time breakdown

    def get(self, image: Image, *, where: str | None = None) -> tuple[Any, str]:
        found = self._by_url.get(image.url)
        if found is not None:
            if image.url in self._prefetched:
                self._prefetched.discard(image.url)
            else:
                self.hits += 1
            return found
        t0 = time.perf_counter()
        pil = image_io.decode_data_url(image.url, max_pixels=self.max_pixels, max_bytes=self.max_bytes, where=where)
        self.decodes += 1
        found = self._by_url[image.url] = (pil, image_hash(pil))
        self.decode_s += time.perf_counter() - t0
        return found

    def prefetch(self, images: Iterable[Image]) -> None:
        """Decode the distinct images not seen yet on several threads (Pillow's decoders and the hash release
        the GIL), so a batch of large pictures costs about one picture per core. An image that fails is left
        undecoded: `get` decodes it again and raises naming the row that asked for it."""
        todo = list(dict.fromkeys(im.url for im in images if im.url not in self._by_url))
        threads = min(len(todo), os.cpu_count() or 1, 16)
        if threads < 2:
            return
        t0 = time.perf_counter()

        def decode(url: str) -> tuple[str, tuple[Any, str] | None]:
            try:
                pil = image_io.decode_data_url(url, max_pixels=self.max_pixels, max_bytes=self.max_bytes)
            except Exception:  # noqa: BLE001 - reported by `get`, with the row's name
                return url, None
            return url, (pil, image_hash(pil))

        with ThreadPoolExecutor(max_workers=threads) as pool:
            for url, found in pool.map(decode, todo):
                if found is not None:
                    self._by_url[url] = found
                    self._prefetched.add(url)
                    self.decodes += 1
        self.decode_s += time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self._by_url)
