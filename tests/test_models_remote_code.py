"""`model.trust_remote_code`: off by default, a checkpoint whose model type exists only in its own code is
refused in one line; on, every from_pretrained runs that code."""

from __future__ import annotations

import json
import shutil

import pytest

from gymv.errors import GymvError
from gymv.backends.policy import load_policy
from tiny_models import tiny_path

CODE = '''
from transformers import Qwen3Config, Qwen3ForCausalLM


class GymvRemoteConfig(Qwen3Config):
    model_type = "gymv_remote_lm"


class GymvRemoteLM(Qwen3ForCausalLM):
    config_class = GymvRemoteConfig
'''


@pytest.fixture
def remote_checkpoint(tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_path("tiny-qwen3"), folder)
    (folder / "gymv_remote.py").write_text(CODE)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gymv_remote_lm", architectures=["GymvRemoteLM"],
                  auto_map={"AutoConfig": "gymv_remote.GymvRemoteConfig",
                            "AutoModelForCausalLM": "gymv_remote.GymvRemoteLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_remote_code_is_refused_by_default_with_the_key_to_set(remote_checkpoint):
    with pytest.raises(GymvError, match="gymv_remote_lm") as e:
        load_policy(remote_checkpoint)
    assert "model.trust_remote_code: true" in e.value.fix


def test_trust_remote_code_loads_the_checkpoints_own_class(remote_checkpoint):
    policy = load_policy(remote_checkpoint, trust_remote_code=True)
    assert type(policy.model).__name__ == "GymvRemoteLM" and policy.adapter.style == "text"


def test_trust_remote_code_reaches_the_generation_and_training_backends(remote_checkpoint):
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, ModelSection, TrainingSection

    spec = WorkerSpec(model_path=str(remote_checkpoint), env=EnvSection(name="arithmetic"),
                      model=ModelSection(trust_remote_code=True))
    assert spec.training_setup().trust_remote_code
    generator = HFGenerationBackend.create(str(remote_checkpoint), trust_remote_code=True)
    trainer = HFTorchBackend.create(TrainingSetup(model_path=str(remote_checkpoint), training=TrainingSection(),
                                                  trust_remote_code=True), device="cpu")
    assert type(generator.model).__name__ == type(trainer.model).__name__ == "GymvRemoteLM"
