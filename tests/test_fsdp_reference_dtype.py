"""The fsdp2 backend holds its frozen KL reference in bfloat16 where that loses nothing: a bfloat16 checkpoint
under bfloat16 mixed precision (FSDP2 gathers every sharded weight in bfloat16 for compute anyway); else in
float32, as the policy's master weights. The CUDA case skips without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from gymv.backends.training.hf_fsdp import reference_dtype
from gymv.models.load import checkpoint_dtype


def test_a_bfloat16_checkpoint_under_bfloat16_compute_is_held_in_bfloat16_and_anything_else_in_float32():
    assert reference_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert reference_dtype("float32", torch.bfloat16) == torch.float32  # would round the stored weights
    assert reference_dtype("bfloat16", None) == torch.float32  # float32 compute
    assert reference_dtype(None, torch.bfloat16) == torch.float32  # the stored dtype unknown


def test_the_stored_dtype_is_read_from_the_checkpoints_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert checkpoint_dtype(tmp_path) == "float32"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None


@pytest.mark.gpu
def test_on_cuda_the_bfloat16_reference_scores_as_a_float32_copy_would(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gymv.backends.policy import load_policy
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_fsdp import HFFSDPBackend
    from gymv.backends.training.hf_torch import copy_hf_files
    from gymv.config.schema import TrainingSection
    from test_train_nemotron_omni import _samples_with
    from tiny_models import tiny_path

    source = tiny_path("tiny-llava")
    load_policy(source, dtype=torch.bfloat16).model.save_pretrained(tmp_path)
    copy_hf_files(source, tmp_path)
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    setup = TrainingSetup(model_path=str(tmp_path), training=TrainingSection(dtype="bfloat16"), kl_reference=True)
    backend = HFFSDPBackend.create(setup, device="cuda")
    assert {p.dtype for p in backend.reference.model.parameters()} == {torch.bfloat16}
    samples = _samples_with(backend.policy, [1, -1], shared_prompt=False)
    held = backend.compute_logprobs(samples, reference=True)
    backend.reference_dtype = lambda: torch.float32  # the same backend's reference, held in float32
    backend.reference = backend._make_reference("cuda")
    for a, b in zip(held, backend.compute_logprobs(samples, reference=True)):
        # the sharded decoder gathers the same bfloat16 weights; the replicated vision tower's elementwise sums
        # (position embeddings) round in bfloat16 rather than float32
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)
