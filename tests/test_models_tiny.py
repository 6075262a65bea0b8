"""`gymv model init` and the loader: tiny checkpoints that plain transformers Auto* classes load and run."""

from __future__ import annotations

import json

import pytest
import torch

from gymv.errors import GymvError
from conftest import invoke_gymv
from tiny_models import chat_ids, shared_policy, solid, tiny_path


def test_tiny_llava_loads_with_auto_classes_and_generates():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_path("tiny-llava")
    model = AutoModelForImageTextToText.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    batch = processor(images=[solid("red")], text=["<image>How many?"], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert out.shape == (1, batch["input_ids"].shape[1] + 4)


def test_tiny_llava_default_is_small_with_64_image_tokens():
    from gymv.models.tiny import count_parameters

    path = tiny_path("tiny-llava")
    assert 500_000 < count_parameters(path) < 1_500_000
    assert shared_policy("tiny-llava").adapter.tokens_per_image(solid("red")) == 64
    assert json.loads((path / "gymv_model.json").read_text())["knobs"]["image_size"] == 56


def test_tiny_qwen2vl_loads_model_tokenizer_and_image_processor_with_auto_classes_and_generates():
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    path = tiny_path("tiny-qwen2vl")
    model = AutoModelForImageTextToText.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    image = solid("blue", (100, 70))
    policy = shared_policy("tiny-qwen2vl")
    ids = torch.tensor([chat_ids(policy, "How many?", [image])])
    pixels = image_processor(images=[image], return_tensors="pt")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == tok.image_token_id).int(),
                         **pixels, max_new_tokens=4, do_sample=False)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert out.shape == (1, ids.shape[1] + 4)


def test_qwen2vl_autoprocessor_needs_torchvision_which_gymv_does_without():
    pytest.importorskip("transformers")
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed here: AutoProcessor loads the grid model directly")
    except ImportError:
        pass
    from transformers import AutoProcessor

    path = tiny_path("tiny-qwen2vl")
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        AutoProcessor.from_pretrained(path)
    policy = shared_policy("tiny-qwen2vl")
    assert policy.processor is None and policy.adapter.style == "grid"
    assert "Torchvision" in policy.info["processor_fallback"]


def test_same_seed_gives_identical_checkpoint_and_other_seed_differs(tmp_path):
    from safetensors.torch import load_file

    from gymv.models.tiny import init_tiny_llava

    knobs = dict(hidden=32, layers=1, vocab_size=512)
    a = init_tiny_llava(tmp_path / "a", seed=5, **knobs)
    b = init_tiny_llava(tmp_path / "b", seed=5, **knobs)
    c = init_tiny_llava(tmp_path / "c", seed=6, **knobs)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_knobs_change_the_architecture(tmp_path):
    from transformers import AutoConfig

    from gymv.models.tiny import init_tiny_llava

    path = init_tiny_llava(tmp_path / "m", hidden=48, layers=3, image_size=28, patch_size=7, vocab_size=512)
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.text_config.hidden_size, cfg.text_config.num_hidden_layers) == (48, 3)
    assert cfg.text_config.vocab_size == 512 and cfg.image_seq_length == 16


def test_init_refuses_a_non_empty_folder_unless_forced(tmp_path):
    from gymv.models.tiny import init_tiny_llava

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(GymvError, match="not empty"):
        init_tiny_llava(tmp_path / "m", hidden=32, layers=1)
    init_tiny_llava(tmp_path / "m", hidden=32, layers=1, force=True)
    assert not (tmp_path / "m" / "notes.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_bad_knobs_are_one_line_errors(tmp_path):
    from gymv.models.tiny import init_tiny_llava

    with pytest.raises(GymvError, match="not a multiple of patch size"):
        init_tiny_llava(tmp_path / "m", image_size=50)
    with pytest.raises(GymvError, match="unknown knob"):
        init_tiny_llava(tmp_path / "m", depth=3)


def test_embedded_model_path_is_built_once_then_reused(tmp_path):
    from gymv.models.load import resolve_model_path

    first = resolve_model_path("embedded:tiny-llava", cache_dir=tmp_path, seed=2)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = resolve_model_path("embedded:tiny-llava", cache_dir=tmp_path, seed=2)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model_path("embedded:tiny-llava", cache_dir=tmp_path, seed=3) != first


def test_unknown_embedded_model_and_missing_folder_are_clear_errors(tmp_path):
    from gymv.models.load import resolve_model_path

    with pytest.raises(GymvError, match="embedded:tiny-llava"):
        resolve_model_path("embedded:gpt-5", cache_dir=tmp_path)
    with pytest.raises(GymvError, match="model folder not found"):
        resolve_model_path(tmp_path / "nope")


def test_unsupported_processor_fails_at_load_listing_the_supported_ones(tmp_path):
    import shutil

    from gymv.backends.policy import load_policy

    path = tmp_path / "m"
    shutil.copytree(tiny_path("tiny-llava"), path)
    cfg = path / "processor_config.json"
    cfg.write_text(cfg.read_text().replace('"LlavaProcessor"', '"PaliGemmaProcessor"'))
    with pytest.raises(GymvError) as err:
        load_policy(path)
    assert "unsupported processor 'PaliGemmaProcessor'" in str(err.value)
    assert "LlavaProcessor (placeholder), Qwen2VLProcessor (grid)" in str(err.value)


@pytest.mark.slow
def test_cli_model_init_writes_a_checkpoint_and_reports_json(tmp_path):
    r = invoke_gymv("model", "init", "tiny-llava", tmp_path / "m", "--hidden", "32", "--layers", "1", "--json")
    assert r.code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["arch"] == "tiny-llava" and out["hidden"] == 32 and out["parameters"] > 0
    assert (tmp_path / "m" / "config.json").exists()


def test_cli_model_init_unknown_arch_is_a_one_line_error(tmp_path):
    r = invoke_gymv("model", "init", "tiny-gpt", tmp_path / "m")
    assert r.code == 2
    assert "error: unknown tiny architecture 'tiny-gpt'" in r.stderr and "Traceback" not in r.stderr
