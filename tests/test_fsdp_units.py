"""Which modules of a real tiny VLM fsdp2 shards as their own units, and which it keeps replicated."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.training.fsdp import _separate_embedding, is_vision
from gymv.backends.training.units import decoder_units
from tiny_models import shared_policy


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_every_language_decoder_layer_is_a_unit_and_no_vision_block_is(arch):
    model = shared_policy(arch).model
    names = [n for n, _ in decoder_units(model)]
    layers = model.config.text_config.num_hidden_layers
    assert len(names) == layers and all(n.endswith(f"layers.{i}") for i, n in enumerate(names))
    assert not any(is_vision(n) for n in names)


@pytest.mark.parametrize("arch, vision", [("tiny-llava", {"vision_tower", "multi_modal_projector"}),
                                          ("tiny-qwen2vl", {"visual"})])
def test_the_vision_tower_and_projector_are_the_replicated_parameters(arch, vision):
    model = shared_policy(arch).model
    assert {n.split(".")[1] for n, _ in model.named_parameters() if is_vision(n)} == vision


def test_an_untied_input_embedding_is_its_own_unit():
    model = shared_policy("tiny-llava").model
    assert _separate_embedding(model) is model.get_input_embeddings()


def test_the_replicated_vision_modules_compute_under_autocast_and_the_rest_does_not():
    from gymv.backends.training.fsdp import autocast_replicated

    class VLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            self.multi_modal_projector = torch.nn.Linear(4, 4)
            self.language_model = torch.nn.Linear(4, 4)

    model = VLM()
    assert autocast_replicated(model, "cpu", torch.bfloat16).names == ["vision_tower", "multi_modal_projector"]
    x = torch.randn(2, 4)
    assert model.vision_tower(x).dtype == model.multi_modal_projector(x).dtype == torch.bfloat16
    assert model.language_model(x).dtype == torch.float32
    assert model.vision_tower[0].weight.dtype == torch.float32  # master weights stay float32
