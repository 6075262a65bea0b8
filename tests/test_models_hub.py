"""Hub ids resolve offline through the local Hugging Face cache (standard layout); an id not cached is one
line that says how to download it. The cache is populated here with a locally built model in hub layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gymv.errors import GymvError
from gymv.models.hub import hub_cache_dir, is_hub_id
from gymv.backends.policy import load_policy
from gymv.models.load import resolve_model_path
from tiny_models import tiny_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hub: Path, repo: str, arch: str, revision: str = "main") -> Path:
    """Lay a tiny checkpoint out as `hf download` leaves it: refs/<revision> -> snapshots/<commit>/files."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / revision).write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    shutil.copytree(tiny_path(arch), snapshot)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def test_the_cache_is_read_from_hf_hub_cache_then_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"


def test_a_cached_hub_id_loads_its_snapshot(hub):
    snapshot = cache_model(hub, "Qwen/Qwen3-Tiny", "tiny-qwen3")
    assert resolve_model_path("Qwen/Qwen3-Tiny") == snapshot
    policy = load_policy("Qwen/Qwen3-Tiny")
    assert type(policy.model).__name__ == "Qwen3ForCausalLM" and policy.path == snapshot


def test_a_revision_after_at_picks_that_ref(hub):
    snapshot = cache_model(hub, "org/vlm", "tiny-qwen2_5vl", revision="v1")
    assert resolve_model_path("org/vlm@v1") == snapshot


def test_a_hub_id_not_in_the_cache_says_how_to_download_it(hub):
    with pytest.raises(GymvError) as e:
        resolve_model_path("Qwen/Qwen2.5-VL-3B-Instruct")
    assert "nor in the local Hugging Face cache" in e.value.message and str(hub) in e.value.message
    assert "hf download Qwen/Qwen2.5-VL-3B-Instruct" in e.value.fix
    assert "huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct" in e.value.fix


def test_local_folders_and_runs_are_not_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert is_hub_id("Qwen/Qwen3-1.7B")
    assert not is_hub_id("runs/missing")  # a missing run under an existing runs/ folder
    assert not is_hub_id(str(tmp_path / "x"))
    assert not is_hub_id("embedded:tiny-llava")


def test_a_training_run_resolves_a_cached_hub_id(hub):
    from gymv.train.setup import resolve_init_path

    snapshot = cache_model(hub, "meta-llama/Tiny", "tiny-llama")
    assert resolve_init_path("meta-llama/Tiny") == str(snapshot)
    with pytest.raises(GymvError) as e:
        resolve_init_path("meta-llama/Other", where="recipe.yaml: model.path")
    assert e.value.where == "recipe.yaml: model.path" and "hf download meta-llama/Other" in e.value.fix
