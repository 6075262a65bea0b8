"""Preprocessed pixels are cached by picture content: a cached result equals a fresh preprocessing call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gymv.backends.multimodal import image_hash
from gymv.backends.pixel_cache import PixelCache
from tiny_models import shared_policy

VISION = ["tiny-llava", "tiny-qwen2vl", "tiny-qwen2_5vl", "tiny-llava-next", "tiny-llava-onevision", "tiny-gemma3",
          "tiny-smolvlm"]


def _pictures(n: int, seed: int = 0) -> list:
    return [Image.fromarray(np.random.default_rng(seed + i).integers(0, 255, (60 + 7 * i, 80 - 3 * i, 3),
                                                                       dtype=np.uint8)) for i in range(n)]


def _same(a, b) -> bool:
    def eq(x, y):
        if x is None or y is None:
            return x is None and y is None
        return torch.equal(torch.as_tensor(x), torch.as_tensor(y))

    return (eq(a.pixel_values, b.pixel_values) and eq(a.image_grid_thw, b.image_grid_thw)
            and eq(a.image_sizes, b.image_sizes) and a.tokens_per_image == b.tokens_per_image
            and a.extra.keys() == b.extra.keys() and all(eq(a.extra[k], b.extra[k]) for k in a.extra))


@pytest.mark.parametrize("family", VISION)
def test_cached_and_fresh_pixels_equal_one_preprocessing_call(family):
    adapter = shared_policy(family).adapter
    cache = PixelCache()
    first, second = _pictures(3), _pictures(3, seed=10)
    mixed = [second[0], first[2], second[1], first[0]]  # two cached, two new, in a new order
    cache.inputs(adapter, first, [image_hash(im) for im in first])
    got = cache.inputs(adapter, mixed, [image_hash(im) for im in mixed])
    assert _same(got, adapter.preprocess(mixed))


def test_a_repeated_picture_is_preprocessed_once():
    adapter = shared_policy("tiny-llava").adapter
    cache = PixelCache()
    pics = _pictures(2)
    keys = [image_hash(im) for im in pics]
    cache.inputs(adapter, pics, keys)
    assert (cache.hits, cache.misses) == (0, 2)
    cache.inputs(adapter, pics[::-1], keys[::-1])
    assert (cache.hits, cache.misses) == (2, 2)


def test_equal_pixels_in_another_image_object_hit_the_cache():
    adapter = shared_policy("tiny-llava").adapter
    cache = PixelCache()
    pic = _pictures(1)[0]
    cache.inputs(adapter, [pic], [image_hash(pic)])
    twin = pic.copy()
    cache.inputs(adapter, [twin], [image_hash(twin)])
    assert cache.hits == 1


def test_the_cache_drops_least_recently_used_pictures_past_its_byte_bound():
    adapter = shared_policy("tiny-llava").adapter
    pics = _pictures(3)
    keys = [image_hash(im) for im in pics]
    one = adapter.preprocess(pics[:1]).pixel_values
    cache = PixelCache(max_bytes=2 * one.numel() * one.element_size())
    cache.inputs(adapter, pics[:2], keys[:2])
    cache.inputs(adapter, pics[:1], keys[:1])  # picture 0 is now the most recent
    cache.inputs(adapter, pics[2:], keys[2:])  # evicts picture 1
    assert len(cache) == 2
    cache.inputs(adapter, [pics[0]], [keys[0]])
    cache.inputs(adapter, [pics[1]], [keys[1]])
    assert (cache.hits, cache.misses) == (2, 4)


def test_a_picture_padded_in_one_batch_is_served_unpadded_in_the_next():
    from tiny_models import solid

    adapter = shared_policy("tiny-smolvlm").adapter  # pads each batch's pictures to its most tiles
    wide, small = solid("red", (400, 40)), solid("blue", (40, 40))
    assert adapter.preprocess([wide]).pixel_values.shape[1] < adapter.preprocess([wide, small]).pixel_values.shape[1]
    cache = PixelCache()
    cache.inputs(adapter, [wide, small], [image_hash(wide), image_hash(small)])
    assert _same(cache.inputs(adapter, [wide], [image_hash(wide)]), adapter.preprocess([wide]))


def test_a_cached_entry_holds_its_own_storage_not_a_view_of_its_batch():
    adapter = shared_policy("tiny-llava").adapter
    cache = PixelCache()
    pics = _pictures(4)
    cache.inputs(adapter, pics, [image_hash(im) for im in pics])
    one = adapter.preprocess(pics[:1]).pixel_values
    assert cache._bytes == 4 * one.numel() * one.element_size()
    assert all(e.pixel_values.untyped_storage().nbytes() == one.numel() * one.element_size()
               for e, _ in cache._entries.values())


class _Counting:
    """The real adapter, with its preprocessing calls counted and held until a gate opens."""

    def __init__(self, adapter, gate):
        self.adapter, self.gate, self.calls = adapter, gate, 0

    def preprocess(self, images):
        self.calls += 1
        self.gate.wait()
        return self.adapter.preprocess(images)


def test_a_prefetched_picture_is_not_preprocessed_again_by_the_pass_that_needs_it():
    import threading

    real = shared_policy("tiny-llava").adapter
    gate = threading.Event()
    adapter = _Counting(real, gate)
    cache = PixelCache()
    pics = _pictures(3)
    keys = [image_hash(im) for im in pics]
    cache.prefetch(adapter, pics, keys)
    got = {}
    needs = threading.Thread(target=lambda: got.update(out=cache.inputs(adapter, pics, keys)))
    needs.start()
    gate.set()
    needs.join()
    assert adapter.calls == 3 and cache.misses == 0
    assert _same(got["out"], real.preprocess(pics))


def test_a_picture_that_fails_to_preprocess_in_the_background_raises_where_it_is_needed():
    adapter = shared_policy("tiny-llava").adapter
    cache = PixelCache()
    cache.prefetch(adapter, ["not a picture"], ["k"])
    with pytest.raises(Exception):
        cache.inputs(adapter, ["not a picture"], ["k"])
    assert len(cache) == 0


def test_pinned_joining_gives_the_same_inputs_and_leaves_the_cache_joinable():
    adapter = shared_policy("tiny-llava").adapter
    cache = PixelCache()
    pics = _pictures(3)
    keys = [image_hash(im) for im in pics]
    got = cache.inputs(adapter, pics, keys, pin=True)  # without CUDA: joined in pageable memory
    assert cache.joinable and _same(got, adapter.preprocess(pics))
    assert got.pixel_values.is_pinned() == torch.cuda.is_available()
