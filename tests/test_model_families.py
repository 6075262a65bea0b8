"""Every model family gymv supports, each on a random-initialised model of its real transformers class built
locally: the model loads as that class, rollouts carry an image per turn with the placeholder check before
every forward pass, vision tokens are never sampled, generation logprobs equal the trainer's, and a GRPO
step trains it. Text-only families (no vision path at all) run the same on a text environment."""

from __future__ import annotations

import json

import pytest
import torch

from family_checks import (check_trajectory_images, continue_with_hf, family_rollout, favour_vision_tokens,
                           grpo_step, logprob_error)
from gymv.backends.generation import GenerationRequest, SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.errors import GymvError
from gymv.rollout import run_rollouts
from rollout_helpers import tiny_rows
from tiny_models import fresh_policy, shared_policy, solid, tiny_path

# arch -> (model class, processor class, adapter style); tiny-llava and tiny-qwen2vl, the first two families,
# are covered by the rest of the suite (test_generation_*, test_rollout_*, test_train_*)
VLM_FAMILIES = {
    "tiny-qwen2_5vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "grid"),
    "tiny-qwen3vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "grid_deepstack"),
    "tiny-llava-next": ("LlavaNextForConditionalGeneration", "LlavaNextProcessor", "anyres"),
    "tiny-llava-onevision": ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor", "anyres"),
    "tiny-gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor", "image_block"),
    "tiny-smolvlm": ("SmolVLMForConditionalGeneration", "SmolVLMProcessor", "split"),
    "tiny-nemotron-omni": ("NemotronH_Omni_Reasoning_V3", "NemotronH_Omni_Reasoning_V3Processor", "patch_grid"),
}
TEXT_FAMILIES = {
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-llama": "LlamaForCausalLM",
}


# -------------------------------------------------------------------------------------------- text-only


@pytest.mark.parametrize("arch", TEXT_FAMILIES)
def test_text_only_tiny_is_a_causal_lm_with_no_vision_files_config_or_tokens(arch):
    path = tiny_path(arch)
    policy = shared_policy(arch)
    assert not (path / "preprocessor_config.json").exists() and not (path / "processor_config.json").exists()
    assert "vision_config" not in json.loads((path / "config.json").read_text())
    assert type(policy.model).__name__ == TEXT_FAMILIES[arch]
    assert (policy.adapter.style, policy.image_processor, policy.processor) == ("text", None, None)
    assert policy.adapter.vision_token_ids == ()
    assert not any(k in policy.tokenizer.get_vocab() for k in ("<image>", "<|image_pad|>", "<|vision_start|>"))


def test_text_only_policy_refuses_an_image_with_a_line_naming_the_row():
    policy = shared_policy("tiny-qwen3")
    backend = HFGenerationBackend.from_policy(policy)
    with pytest.raises(GymvError, match="text-only.*1 image") as e:
        backend.generate([GenerationRequest([1, 2, 3], [solid("red")], where="rows.jsonl line 4")], SamplingParams())
    assert "rows.jsonl line 4" in str(e.value)


def test_text_only_chat_template_rejects_an_image_part():
    policy = shared_policy("tiny-llama")
    with pytest.raises(Exception, match="text-only"):
        policy.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False,
                                             chat_template=policy.chat_template)


def arithmetic_rollouts(policy, n_rows=2, group_size=2):
    env, rows = tiny_rows("arithmetic", n_rows)
    backend = HFGenerationBackend.from_policy(policy, seed=0)
    return run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, env, rows,
                        group_size=group_size, params=SamplingParams(max_new_tokens=8), max_turns=1,
                        max_rollout_tokens=64, max_seq_len=256, seed=0)


@pytest.mark.parametrize("arch", TEXT_FAMILIES)
def test_text_only_rollouts_have_generation_logprobs_equal_to_the_trainers(arch):
    from family_checks import token_mult_prob_error
    from gymv.backends.logprobs import right_pad, sequence_logprobs

    policy = shared_policy(arch)
    trajs = arithmetic_rollouts(policy)
    assert len(trajs) == 4 and all(t.error is None and t.num_generated > 0 and not t.images for t in trajs)
    batch = right_pad([t.token_ids for t in trajs], [[] for _ in trajs], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, batch)
    gen = torch.zeros_like(train)
    mask = torch.zeros_like(train, dtype=torch.bool)
    for b, t in enumerate(trajs):
        gen[b, :len(t.logprobs)] = torch.tensor(t.logprobs)
        mask[b, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.bool)
    assert token_mult_prob_error(gen, train, mask) < 1.05


@pytest.mark.parametrize("arch", TEXT_FAMILIES)
def test_a_grpo_step_trains_a_text_only_policy(arch):
    [traj] = arithmetic_rollouts(shared_policy(arch), n_rows=1, group_size=1)
    metrics, changed = grpo_step(arch, traj)
    assert changed
    assert metrics["train/token_mult_prob_error"] < 1.05
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("train/loss"))


# -------------------------------------------------------------------------------------- vision-language


@pytest.mark.parametrize("arch", VLM_FAMILIES)
def test_vlm_family_loads_as_its_real_transformers_class(arch):
    model_cls, processor_cls, style = VLM_FAMILIES[arch]
    policy = shared_policy(arch)
    assert type(policy.model).__name__ == model_cls
    assert (policy.info["processor_class"], policy.adapter.style) == (processor_cls, style)
    assert policy.adapter.image_token_id in policy.adapter.vision_token_ids


@pytest.mark.parametrize("arch", VLM_FAMILIES)
def test_vlm_family_rollout_attributes_an_image_to_each_turn_and_passes_the_placeholder_check(arch):
    policy = shared_policy(arch)
    traj = family_rollout(arch)
    assert traj.error is None and traj.turns == 3
    assert traj.image_turns == [0, 1, 2]
    check_trajectory_images(traj, policy.adapter)
    cut = list(traj.token_ids)
    cut.remove(policy.adapter.image_token_id)  # one placeholder token short
    with pytest.raises(GymvError, match="placeholder"):
        policy.adapter.check(cut, traj.images, where="row 0")


@pytest.mark.parametrize("arch", VLM_FAMILIES)
def test_vlm_family_generation_logprobs_equal_the_trainers_after_three_image_turns(arch):
    policy = shared_policy(arch)
    traj = family_rollout(arch)
    seqs, images, outs = continue_with_hf(policy, traj, n=2, max_new_tokens=6, temperature=1.0)
    assert logprob_error(policy, seqs, images, outs, len(traj.token_ids)) < 1.05


@pytest.mark.parametrize("arch", VLM_FAMILIES)
def test_vlm_family_never_samples_a_vision_token_even_when_the_model_prefers_one(arch):
    policy = fresh_policy(arch)
    traj = family_rollout(arch)
    handle = favour_vision_tokens(policy)
    try:
        _, _, outs = continue_with_hf(policy, traj, n=2, max_new_tokens=4)
    finally:
        handle.remove()
    assert all(o.token_ids and not set(o.token_ids) & set(policy.adapter.vision_token_ids) for o in outs)


@pytest.mark.parametrize("arch", VLM_FAMILIES)
def test_a_grpo_step_trains_a_vlm_family_on_a_three_image_episode(arch):
    traj = family_rollout(arch)
    metrics, changed = grpo_step(arch, traj)
    assert changed
    assert metrics["train/token_mult_prob_error"] < 1.05
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("train/loss"))


@pytest.mark.slow
def test_model_init_and_info_build_and_describe_a_text_only_model(tmp_path):
    from conftest import invoke_gymv

    out = tmp_path / "q3"
    made = invoke_gymv("model", "init", "tiny-qwen3", str(out), "--layers", "1", "--json")
    assert made.code == 0, made.stderr
    assert json.loads(made.stdout)["arch"] == "tiny-qwen3"
    shown = invoke_gymv("model", "info", str(out), "--json")
    assert shown.code == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert (info["style"], info["model_class"], info["vision_token_ids"]) == ("text", "Qwen3ForCausalLM", [])


def test_any_resolution_token_counts_depend_on_the_image_and_equal_the_hf_processors():
    policy = shared_policy("tiny-llava-next")
    images = [solid("red", (64, 48)), solid("blue", (30, 90)), solid("green", (120, 120))]
    counts = [policy.adapter.tokens_per_image(im) for im in images]
    assert len(set(counts)) == 3
    out = policy.processor(images=images, text=["<image>a<image>b<image>"], return_tensors="pt")
    assert int((out["input_ids"] == policy.adapter.image_token_id).sum()) == sum(counts)


def test_gemma3_ids_and_logprobs_equal_the_hf_processor_and_forward_with_bidirectional_image_attention():
    from gymv.backends.logprobs import right_pad, sequence_logprobs

    policy = shared_policy("tiny-gemma3")
    images = [solid("red", (64, 48)), solid("blue", (40, 40))]
    text = "<start_of_image>How many?<start_of_image>And?"
    ours = policy.adapter.encode_text(text, images)
    hf = policy.processor(images=images, text=[text], return_tensors="pt")
    assert ours == hf["input_ids"][0].tolist()
    vision = list(policy.adapter.vision_token_ids)
    with torch.no_grad():
        want = policy.model(**hf).logits[0].float()
        causal = policy.model(**{k: v for k, v in hf.items() if k != "token_type_ids"}).logits[0]
        want[:, vision] = causal[:, vision] = float("-inf")  # gymv's logprobs exclude what is never sampled
        want, causal = torch.log_softmax(want, -1), torch.log_softmax(causal, -1)
        got = sequence_logprobs(policy.model, policy.adapter, right_pad([ours], [images], 0))[0]
    ids = torch.tensor(ours)
    text_pos = ~torch.isin(ids[1:], torch.tensor(policy.adapter.vision_token_ids))
    ref = want[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    assert torch.allclose(got[1:][text_pos], ref[text_pos], atol=1e-5)
    assert not torch.allclose(causal[-1], want[-1], atol=1e-4)  # the image attention is really bidirectional


def test_gemma3_refuses_pan_and_scan_at_load_time(tmp_path):
    import shutil

    from gymv.backends.policy import load_policy

    folder = tmp_path / "g3"
    shutil.copytree(tiny_path("tiny-gemma3"), folder)
    cfg = json.loads((folder / "processor_config.json").read_text())
    cfg["image_processor"]["do_pan_and_scan"] = True
    (folder / "processor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(GymvError, match="pan_and_scan"):
        load_policy(folder)


def test_smolvlm_splits_each_image_into_the_tiles_its_image_processor_makes():
    policy = shared_policy("tiny-smolvlm")
    images = [solid("red", (64, 48)), solid("blue", (30, 90)), solid("green", (20, 20))]
    info = policy.image_processor(images=[[im] for im in images], return_row_col_info=True)
    tiles = [r[0] * c[0] + 1 for r, c in zip(info["rows"], info["cols"])]
    assert [len(policy.adapter.runs(im)) for im in images] == tiles == [5, 3, 5]
    ids = policy.adapter.image_token_ids(images[1])
    tokens = policy.tokenizer.convert_ids_to_tokens(ids)
    assert [t for t in tokens if t.startswith("<row_") or t == "<global-img>"] == ["<row_1_col_1>", "<row_2_col_1>",
                                                                                   "<global-img>"]
    assert not set(ids) - set(policy.adapter.vision_token_ids) - set(policy.tokenizer.encode("\n", add_special_tokens=False))


@pytest.mark.parametrize("arch", ["tiny-qwen2_5vl", "tiny-qwen3vl"])
def test_grid_family_logprobs_equal_the_plain_hf_forward_from_pixels(arch):
    """gymv's precomputed-feature forward (Qwen3-VL: with its deepstack features) is the model's own."""
    from gymv.backends.logprobs import right_pad, sequence_logprobs
    from tiny_models import chat_ids

    policy = shared_policy(arch)
    images = [solid("red", (64, 48)), solid("blue", (30, 90))]
    ids = chat_ids(policy, "How many?", images)
    inputs = policy.adapter.preprocess(images)
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = policy.model(input_ids=t, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                              mm_token_type_ids=(t == policy.adapter.image_token_id).int()).logits[0].float()
        got = sequence_logprobs(policy.model, policy.adapter, right_pad([ids], [images], 0))[0]
    logits[:, list(policy.adapter.vision_token_ids)] = float("-inf")
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, t[0, 1:, None]).squeeze(-1)
    text = ~torch.isin(t[0, 1:], torch.tensor(policy.adapter.vision_token_ids))
    assert torch.allclose(got[1:][text], ref[text], atol=1e-5)


# ------------------------------------------------------------------------------ config against the weights


def _config_edited(tmp_path, arch: str, edit) -> "Path":
    import shutil

    folder = tmp_path / arch
    shutil.copytree(tiny_path(arch), folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("arch,edit,message", [
    ("tiny-llava", lambda c: c["text_config"].update(num_hidden_layers=1),
     r"\d+ stored tensors the model has no place for .*: \S*layers\.1\."),
    ("tiny-qwen3", lambda c: c.update(num_hidden_layers=3, layer_types=c["layer_types"] + c["layer_types"][:1]),
     r"\d+ model tensors the checkpoint lacks .*: \S*layers\.2\."),
    ("tiny-llava", lambda c: c["text_config"].update(intermediate_size=200),
     r"tensors whose stored shape differs from the config's: .*\(384, 128\) vs \(200, 128\)"),
])
def test_a_checkpoint_whose_tensors_do_not_fill_the_model_exactly_is_refused_at_load(tmp_path, arch, edit, message):
    from gymv.backends.policy import load_policy

    folder = _config_edited(tmp_path, arch, edit)
    with pytest.raises(GymvError, match=message) as err:
        load_policy(folder)
    assert err.value.where == str(folder) and "config.json" in err.value.fix


def test_weights_tied_to_the_embeddings_are_not_reported_missing(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from gymv.backends.policy import load_policy

    folder = _config_edited(tmp_path, "tiny-qwen3", lambda c: c.update(tie_word_embeddings=True))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lm_head" in k]  # the tied head is not stored
    policy = load_policy(folder)
    assert policy.model.lm_head.weight.data_ptr() == policy.model.model.embed_tokens.weight.data_ptr()
