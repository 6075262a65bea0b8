"""Image preprocessing split across threads gives what one call gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gymv.backends.multimodal import preprocess_threaded
from tiny_models import shared_policy


def _pictures(n: int) -> list:
    return [Image.fromarray(np.random.default_rng(i).integers(0, 255, (60 + 7 * i, 80 - 3 * i, 3), dtype=np.uint8))
            for i in range(n)]


@pytest.mark.parametrize("family", ["tiny-llava", "tiny-qwen2vl", "tiny-llava-next"])
@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_preprocessing_equals_one_call_image_by_image(family, threads):
    adapter = shared_policy(family).adapter
    images = _pictures(5)
    one, split = adapter.preprocess(images), preprocess_threaded(adapter, images, threads=threads)
    assert torch.equal(one.pixel_values, split.pixel_values)
    assert one.tokens_per_image == split.tokens_per_image
    assert (one.image_grid_thw is None and split.image_grid_thw is None) or torch.equal(one.image_grid_thw,
                                                                                        split.image_grid_thw)
