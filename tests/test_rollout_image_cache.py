"""The rollout's image cache: a batch's distinct pictures are decoded once each, ahead of rendering and on
several threads, and a picture that does not decode still fails naming the row that asked for it."""

import threading

import numpy as np
import pytest

from gymv.data import images as image_io
from gymv.data.images import ImageError, png_data_url
from gymv.envs.messages import Image
from gymv.rollout.images import ImageCache


def pictures(n: int, size: int = 64) -> list[Image]:
    rng = np.random.default_rng(0)
    return [Image(png_data_url(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))) for _ in range(n)]


def test_prefetch_decodes_each_distinct_picture_once_and_gets_are_served_from_it(monkeypatch):
    real, calls, lock = image_io.decode_data_url, [], threading.Lock()
    both_in = threading.Barrier(2, timeout=30)  # the first two decodes wait for each other: they must overlap

    def recording(url, **kw):
        with lock:
            calls.append(url)
            first_two = len(calls) <= 2
        if first_two:
            both_in.wait()
        return real(url, **kw)

    monkeypatch.setattr(image_io, "decode_data_url", recording)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    pics = pictures(6)
    batch = pics * 3  # a group of three shares each picture
    cache = ImageCache()
    cache.prefetch(batch)
    assert cache.decodes == len(calls) == 6 and not both_in.broken  # decoded on two threads at once
    got = [cache.get(im, where="row") for im in batch]
    assert (cache.decodes, cache.hits) == (6, 12)  # as if decoded on first use
    serial = ImageCache()
    assert [h for _, h in got] == [serial.get(im)[1] for im in batch]


def test_a_picture_that_fails_in_prefetch_raises_from_get_naming_the_row(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    good, bad = pictures(1)[0], Image("data:image/png;base64,bm90IGEgcG5n")
    cache = ImageCache()
    cache.prefetch([good, bad])
    assert cache.get(good)[1]
    with pytest.raises(ImageError) as e:
        cache.get(bad, where="rows.jsonl line 7")
    assert "rows.jsonl line 7" in str(e.value)


def test_on_one_core_pictures_are_decoded_on_first_use(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    cache = ImageCache()
    cache.prefetch(pictures(3))
    assert cache.decodes == 0
    cache.get(pictures(3)[0])
    assert (cache.decodes, cache.hits) == (1, 0)
