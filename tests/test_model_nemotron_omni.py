"""The Nemotron 3 Omni family on its tiny stand-in (real transformers classes): the hybrid layer pattern and its
knobs, the reasoning switch of its chat template, dynamic-resolution images (flattened patches, `image_grid_hw`,
tokens after the 2x2 pixel shuffle), logprobs equal to the model's own forward from pixels, and the hybrid
(Mamba state + KV) cache. The checks every family shares are in tests/test_model_families.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gymv.errors import GymvError
from tiny_models import chat_ids, fresh_policy, shared_policy, solid, tiny_path
from train_helpers import REPO

ARCH = "tiny-nemotron-omni"


def test_the_tiny_omni_has_a_mamba_an_attention_and_a_moe_layer_with_routed_and_shared_experts():
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_path(ARCH))
    text = model.config.text_config
    mixers = [type(layer.mixer).__name__ for layer in model.language_model.model.layers]
    assert mixers == ["NemotronHMamba2Mixer", "NemotronHMoE", "NemotronHAttention", "NemotronHMoE"]
    assert (text.n_routed_experts, text.num_experts_per_tok, text.n_shared_experts) == (4, 2, 1)
    assert text.num_nextn_predict_layers == 0 and model.vision_final_layernorm is None
    assert type(model.vision_model).__name__ == "RadioModel"


def test_layer_pattern_top_k_and_mtp_knobs_shape_the_checkpoint(tmp_path):
    from gymv.models.tiny import init_tiny

    path = init_tiny(ARCH, tmp_path / "m", hidden=32, layer_pattern="M*E-M", experts=3, experts_per_token=1,
                     mtp_layers=1, vocab_size=512)
    config = json.loads((path / "config.json").read_text())["text_config"]
    assert config["layers_block_type"] == ["linear_attention", "full_attention", "moe", "mlp", "linear_attention"]
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["num_nextn_predict_layers"]) == (3, 1, 1)
    knobs = json.loads((path / "gymv_model.json").read_text())["knobs"]
    assert (knobs["layers"], knobs["layer_pattern"]) == (5, "M*E-M")


@pytest.mark.parametrize("knobs,message", [
    ({"layer_pattern": "MMEE"}, "not a hybrid pattern"),
    ({"layer_pattern": "ME*X"}, "not a hybrid pattern"),
    ({"layer_pattern": "ME*E", "layers": 6}, "disagrees"),
    ({"experts": 2, "experts_per_token": 3}, "exceeds experts"),
])
def test_bad_hybrid_knobs_are_one_line_errors(tmp_path, knobs, message):
    from gymv.models.tiny import init_tiny

    with pytest.raises(GymvError, match=message):
        init_tiny(ARCH, tmp_path / "m", **knobs)


def test_hybrid_knobs_are_refused_for_other_architectures(tmp_path):
    from gymv.models.tiny import init_tiny

    with pytest.raises(GymvError, match="only apply to the hybrid"):
        init_tiny("tiny-llava", tmp_path / "m", experts=8)


def test_reasoning_is_on_by_default_and_enable_thinking_false_opens_each_turn_with_an_empty_think_block():
    from gymv.rollout.render import ChatRenderer

    policy = shared_policy(ARCH)
    chat = [{"role": "user", "content": "How many?"}]
    on = ChatRenderer(policy.tokenizer, policy.chat_template).render(chat, add_generation_prompt=True)
    off = ChatRenderer(policy.tokenizer, policy.chat_template, {"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n")
    assert off.render(chat, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think></think>")
    text, _ = off.addition([({"role": "user", "content": "And now?"}, [])], turn_closed=True)
    assert text == "<|im_start|>user\nAnd now?<|im_end|><|im_start|>assistant\n<think></think>"


@pytest.mark.parametrize("size,grid", [((64, 48), (6, 8)), ((30, 90), (12, 4)), ((300, 200), (10, 14)),
                                       ((8, 8), (4, 4)), ((96, 96), (12, 12))])
def test_an_image_takes_its_patch_grid_over_four_tokens_between_img_markers(size, grid):
    policy = shared_policy(ARCH)
    image = solid("red", size)
    inputs = policy.adapter.preprocess([image])
    assert inputs.image_grid_thw.tolist() == [list(grid)]
    assert inputs.pixel_values.shape == (grid[0] * grid[1], 3 * 8 * 8)
    n = grid[0] * grid[1] // 4
    ids = policy.adapter.image_token_ids(image)
    tokens = policy.tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["<img>", *["<image>"] * n, "</img>"] and policy.adapter.tokens_per_image(image) == n


def test_several_images_per_turn_keep_their_own_sizes_and_the_check_counts_each_span():
    policy = shared_policy(ARCH)
    images = [solid("red", (64, 48)), solid("blue", (30, 90)), solid("green", (200, 120))]
    ids = chat_ids(policy, "How many?", images)
    policy.adapter.check(ids, images, where="row 0")
    inputs = policy.adapter.preprocess(images)
    alone = [policy.adapter.preprocess([im]) for im in images]
    assert torch.equal(inputs.pixel_values, torch.cat([a.pixel_values for a in alone]))
    assert inputs.tokens_per_image == [policy.adapter.tokens_per_image(im) for im in images] == [12, 12, 32]
    with pytest.raises(GymvError, match="placeholder"):
        policy.adapter.check(ids, images[:2], where="row 0")


def test_a_patch_budget_that_would_depend_on_the_image_count_is_refused_at_load(tmp_path):
    from gymv.backends.policy import load_policy

    folder = tmp_path / "omni"
    shutil.copytree(tiny_path(ARCH), folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    cfg.update(max_num_patches=0, max_model_len=8)
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(GymvError, match="depends on how many images share a call"):
        load_policy(folder)


def _with_config(tmp_path, edit=None, *, text: str | None = None):
    """A copy of the tiny Omni whose config.json `edit` (a function of the parsed dict) changed, or is `text`."""
    folder = tmp_path / "omni"
    shutil.copytree(tiny_path(ARCH), folder)
    if text is None:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        text = json.dumps(cfg, indent=2)
    (folder / "config.json").write_text(text)
    return folder


def _short(c):
    c["text_config"]["layers_block_type"] = c["text_config"]["layers_block_type"][:-1]


def _set(**values):
    return lambda c: c["text_config"].update(values)


@pytest.mark.parametrize("edit,message", [
    (_short, "`text_config.layers_block_type` lists 3 layers, the weights hold 4"),
    (_set(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]), "layer 3 is mlp, its stored tensors are a moe"),
    (_set(layers_block_type=["linear_attention", "moe", "full_attention", "dense"]), "unknown layer kinds 'dense'"),
    (_set(num_hidden_layers=5), "lists 4 layers, num_hidden_layers is 5"),
    (_set(num_experts_per_tok=0), "`text_config.num_experts_per_tok` is 0: each token is routed to between 1 and"),
    (_set(num_experts_per_tok=5), "`text_config.num_experts_per_tok` is 5"),
    (_set(n_routed_experts=3), "`text_config.n_routed_experts` is 3, the weights' routers choose among 4"),
    (_set(n_groups=3), "`text_config.n_groups` (3) does not divide mamba_num_heads (4)"),
    (_set(num_key_value_heads=3), "not a multiple of num_key_value_heads (3)"),
    (_set(hidden_size=0), "`text_config.hidden_size` is 0, it must be at least 1"),
    (_set(hidden_size="128"), '`text_config.hidden_size` is "128", not an integer'),
    (_set(num_experts_per_tok=True), "`text_config.num_experts_per_tok` is true, not an integer"),
    (lambda c: c["text_config"].pop("vocab_size"), "`text_config.vocab_size` is missing"),
    (lambda c: c.pop("text_config"), "`text_config` is missing"),
    (lambda c: c["vision_config"].update(hidden_size=66), "`vision_config.hidden_size` (66) is not a multiple"),
    (lambda c: c.update(image_token_id=99999), "`image_token_id` is 99999, outside the vocabulary"),
    (_set(time_step_limit="x"), "transformers refuses config.json: Validation error for field 'time_step_limit'"),
])
def test_a_config_that_breaks_the_family_or_its_weights_is_one_line_naming_the_key(tmp_path, edit, message):
    from gymv.models.config_check import check_checkpoint

    folder = _with_config(tmp_path, edit)
    with pytest.raises(GymvError) as err:
        check_checkpoint(folder)
    assert message in err.value.message and err.value.where == str(folder / "config.json") and err.value.fix
    assert "learning rate" not in err.value.one_line()


def test_a_truncated_config_is_one_line_naming_the_file_and_line(tmp_path):
    from gymv.models.config_check import check_checkpoint

    whole = (tiny_path(ARCH) / "config.json").read_text()
    folder = _with_config(tmp_path, text=whole[:len(whole) // 2])
    with pytest.raises(GymvError, match="config.json is not valid JSON") as err:
        check_checkpoint(folder)
    assert err.value.where.startswith(f"{folder / 'config.json'} line ")


def test_a_released_style_config_with_a_pattern_string_and_llm_config_passes(tmp_path):
    from gymv.models.config_check import check_checkpoint

    def released(c):
        text = c.pop("text_config")
        text["hybrid_override_pattern"] = "ME*E"
        text["num_hidden_layers"] = len(text.pop("layers_block_type"))
        c["llm_config"] = text

    check_checkpoint(_with_config(tmp_path, released))


@pytest.mark.parametrize("edit,key", [
    (_short, "text_config.layers_block_type"),
    (_set(num_experts_per_tok=0), "text_config.num_experts_per_tok"),
    (_set(num_experts_per_tok=8), "text_config.num_experts_per_tok"),
])
def test_model_info_refuses_a_config_that_does_not_match_its_weights(gymv, tmp_path, edit, key):
    result = gymv("model", "info", _with_config(tmp_path, edit))
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.code == 2 and len(errors) == 1 and "Traceback" not in result.stderr
    assert f"`{key}`" in errors[0] and "config.json" in errors[0] and "(fix: " in errors[0]


def test_lint_refuses_a_recipe_whose_local_model_folder_does_not_match_its_config(gymv, tmp_path):
    folder = _with_config(tmp_path, _short)
    recipe = tmp_path / "omni.yaml"
    recipe.write_text(f"defaults: {REPO / 'recipes/vlm/vlm_sft-tinyomni-1n0g-torch.yaml'}\nmodel:\n  path: {folder}\n")
    result = gymv("lint", recipe, "--format", "text")
    assert result.code == 1
    assert f"omni.yaml:3: GV023 model.path {folder}: {folder / 'config.json'}: `text_config.layers_block_type` " \
           "lists 3 layers, the weights hold 4" in result.stdout


def test_pixels_equal_the_transformers_image_processor():
    pytest.importorskip("torchvision")
    from transformers import NemotronH_Omni_Reasoning_V3ImageProcessor as HFImageProcessor

    from tiny_models import noise

    policy = shared_policy(ARCH)
    hf = HFImageProcessor(**json.loads((tiny_path(ARCH) / "preprocessor_config.json").read_text()))
    for image in (noise(1, (64, 48)), noise(2, (30, 90)), noise(3, (300, 200))):
        want = hf(images=[image], return_tensors="pt")
        got = policy.adapter.preprocess([image])
        assert torch.equal(got.image_grid_thw, want["image_grid_hw"])
        assert torch.allclose(got.pixel_values, want["pixel_values"], atol=1e-5)


def test_logprobs_equal_the_plain_hf_forward_from_pixels():
    from gymv.backends.logprobs import right_pad, sequence_logprobs

    policy = shared_policy(ARCH)
    images = [solid("red", (64, 48)), solid("blue", (30, 90))]
    ids = chat_ids(policy, "How many?", images)
    inputs = policy.adapter.preprocess(images)
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = policy.model(input_ids=t, pixel_values=inputs.pixel_values,
                              image_grid_hw=inputs.image_grid_thw).logits[0].float()
        got = sequence_logprobs(policy.model, policy.adapter, right_pad([ids], [images], 0))[0]
    logits[:, list(policy.adapter.vision_token_ids)] = float("-inf")
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, t[0, 1:, None]).squeeze(-1)
    text = ~torch.isin(t[0, 1:], torch.tensor(policy.adapter.vision_token_ids))
    assert torch.allclose(got[1:][text], ref[text], atol=1e-5)


def test_generation_keeps_the_mamba_state_beside_the_kv_cache_and_continues_a_longer_prompt_exactly():
    """Left-padded prompts of different lengths and rows leaving the batch as they finish: each row's
    logprobs equal the trainer's over the whole sequence (the conv and SSM states of the Mamba layer follow
    the rows, padding adds nothing to them)."""
    from family_checks import logprob_error

    from gymv.backends.generation import GenerationRequest, SamplingParams
    from gymv.backends.generation.hf import HFGenerationBackend

    policy = shared_policy(ARCH)
    images = [solid("red", (64, 48))]
    short = chat_ids(policy, "How many?", images)
    longer = chat_ids(policy, "How many circles are there in this picture, counted one by one?", images)
    backend = HFGenerationBackend.from_policy(policy, seed=0)
    reqs = [GenerationRequest(short, images), GenerationRequest(longer, images)]
    outs = backend.generate(reqs, SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[]))
    for prompt, out in zip((short, longer), outs):
        assert logprob_error(policy, [prompt + out.token_ids], [images], [out], len(prompt)) < 1.0001


def test_a_packed_row_restarts_the_mamba_state_at_each_sequence():
    """Unwrapped, the Mamba-2 layer carries the first sequence's state into the second; with
    gymv.backends.packed_mamba each sequence of the row scores as it does alone."""
    from gymv.backends import packed_attention, packed_mamba
    from gymv.backends.logprobs import MultimodalBatch, right_pad, token_scores

    policy = fresh_policy(ARCH)
    images = [[solid("red", (64, 48))], [solid("blue", (30, 90))], []]
    rows = [chat_ids(policy, "How many?", images[0]) + [40, 41, 42],
            chat_ids(policy, "Which colour is it?", images[1]) + [43, 44],
            chat_ids(policy, "No picture", images[2]) + [45, 46, 47, 48]]
    batch = right_pad(rows, images, 0)

    def packed():
        return token_scores(policy.model, policy.adapter, MultimodalBatch(batch.input_ids, batch.attention_mask, images),
                            packed=True).logp

    assert packed_attention.install(policy.model)
    with torch.no_grad():
        apart = [token_scores(policy.model, policy.adapter, right_pad([r], [im], 0)).logp[0] for r, im in zip(rows, images)]
        leaky = packed()
        assert packed_mamba.install(policy.model)
        restarted = packed()
    assert torch.allclose(leaky[0, :len(rows[0])], apart[0], atol=1e-5)  # the first sequence starts clean
    assert not torch.allclose(leaky[1, :len(rows[1])], apart[1], atol=1e-3)  # unwrapped, the second inherits
    for b, r in enumerate(rows):
        assert torch.allclose(restarted[b, :len(r)], apart[b], atol=1e-5)


def test_the_trainer_packs_this_family_with_a_groups_prompt_once_in_the_row():
    from gymv.backends.training.hf_torch import BatchLayout

    policy = fresh_policy(ARCH)
    layout = BatchLayout(policy.adapter, policy.model, 0, packing=True)
    assert layout.packing is True and layout.shares_in_row
    assert all(getattr(m, "gymv_packed", False) for m in policy.model.modules() if type(m).__name__ == "NemotronHMamba2Mixer")


def test_rows_sharing_a_prompt_are_scored_as_if_alone_when_prompt_lengths_differ():
    """The shared-prompt path pads each group's prompt to the longest; a Mamba state would run on through
    that padding, so with unequal prompts the rows run in full instead."""
    from gymv.backends.logprobs import right_pad, token_scores

    policy = shared_policy(ARCH)
    im = [solid("red", (64, 48))]
    a, b = chat_ids(policy, "How many?", im), chat_ids(policy, "How many circles do you see here?", im)
    rows = [a + [40, 41], a + [42, 43], b + [44], b + [45, 46]]
    score = torch.zeros(4, max(map(len, rows)), dtype=torch.bool)
    for i, r in enumerate(rows):
        score[i, len(a if i < 2 else b):len(r)] = True
    with torch.no_grad():
        together = token_scores(policy.model, policy.adapter, right_pad(rows, [im] * 4, 0), score_mask=score).logp
        for i, r in enumerate(rows):
            alone = token_scores(policy.model, policy.adapter, right_pad([r], [im], 0)).logp[0]
            assert torch.allclose(together[i][score[i]], alone[score[i, :len(r)]], atol=1e-5)


def test_a_second_turn_with_a_new_image_continues_the_first_with_the_trainers_logprobs():
    """Turn 1 is sampled, a user turn with another image is appended in token space, turn 2 is sampled on the
    whole history: the trainer's logprobs of the final sequence equal both turns' sampling logprobs."""
    from gymv.backends.generation import GenerationRequest, SamplingParams
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.logprobs import right_pad, sequence_logprobs
    from gymv.rollout.render import ChatRenderer

    policy = shared_policy(ARCH)
    backend = HFGenerationBackend.from_policy(policy, seed=1)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=[], ignore_eos=True)
    first, second = solid("red", (64, 48)), solid("blue", (90, 30))
    ids = chat_ids(policy, "How many?", [first])
    turn1 = backend.generate([GenerationRequest(ids, [first])], params)[0]
    text, _ = ChatRenderer(policy.tokenizer, policy.chat_template).addition(
        [({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And now?"}]}, [second])],
        turn_closed=False)
    history = ids + turn1.token_ids + policy.adapter.encode_text(text, [second])
    turn2 = backend.generate([GenerationRequest(history, [first, second])], params)[0]
    full = history + turn2.token_ids
    with torch.no_grad():
        train = sequence_logprobs(policy.model, policy.adapter, right_pad([full], [[first, second]], 0))[0]
    got = torch.cat([train[len(ids):len(ids) + 5], train[len(history):]])
    want = torch.tensor(turn1.logprobs + turn2.logprobs)
    assert float(torch.exp((got - want).abs()).mean()) < 1.0001


def test_a_teacher_reads_an_omni_students_vision_tokens_without_torchvision():
    from gymv.backends.teacher import student_vision_ids

    assert student_vision_ids(tiny_path(ARCH)) == shared_policy(ARCH).adapter.vision_token_ids
