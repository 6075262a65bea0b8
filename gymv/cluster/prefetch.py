"""One piece of host work built in a background thread while the worker does something else.

An SFT step spends its host time laying out the batch's gold episodes (rendering each turn's picture,
tokenizing), then trains; on a GPU the two need not wait for each other. The training worker starts the next
step's batch here as soon as it has its own, and takes it by key at the next step: a key that does not match
(the driver asked for other rows) builds afresh, and a build that raised raises at the step that needed it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Prefetch:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._key: Hashable | None = None
        self._future: Future | None = None

    def start(self, key: Hashable, build: Callable[[], Any]) -> None:
        """Build `build()` in the background for `key`, dropping any build not taken yet."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gymv-prefetch")
        self.drop()
        self._key, self._future = key, self._pool.submit(build)

    def take(self, key: Hashable) -> tuple[bool, Any]:
        """(True, the built value) when a build for `key` was started (waiting for it to finish; its error
        raises here), else (False, None); either way nothing stays prefetched."""
        if self._future is None or key != self._key:
            self.drop()
            return False, None
        future, self._key, self._future = self._future, None, None  # not cancelled: it may still be queued
        return True, future.result()

    def drop(self) -> None:
        """Forget the pending build (a running one finishes in its thread and is discarded)."""
        if self._future is not None:
            self._future.cancel()
        self._key, self._future = None, None

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
