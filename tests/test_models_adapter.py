"""Multimodal adapters: exact image spans, placeholder checks, and the vision tokens never to sample."""

from __future__ import annotations

import pytest

from gymv.errors import GymvError
from tiny_models import chat_ids, shared_policy, solid


def test_llava_processor_expansion_equals_adapter_span():
    policy = shared_policy("tiny-llava")
    text = "<|im_start|>user\n<image>hi<image><|im_end|>"
    images = [solid("red"), solid("blue", (30, 90))]
    hf = policy.processor(images=images, text=[text], return_tensors="pt")["input_ids"][0].tolist()
    assert hf == policy.adapter.encode_text(text, images)
    assert policy.adapter.count_placeholders(hf) == 2 * policy.adapter.tokens_per_image(images[0]) == 128


@pytest.mark.parametrize("size", [(56, 56), (100, 70), (30, 200), (400, 300), (13, 17)])
def test_grid_span_equals_image_grid_over_merge_and_the_model_accepts_it(size):
    import torch

    policy = shared_policy("tiny-qwen2vl")
    image = solid("green", size)
    grid = policy.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert policy.adapter.tokens_per_image(image) == int(grid.prod()) // 4
    ids = torch.tensor([chat_ids(policy, "count", [image])])
    inputs = policy.adapter.preprocess([image])
    assert inputs.tokens_per_image == [policy.adapter.tokens_per_image(image)]
    with torch.no_grad():
        policy.model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                     mm_token_type_ids=(ids == policy.adapter.image_token_id).int())


def test_grid_spans_depend_on_image_size():
    adapter = shared_policy("tiny-qwen2vl").adapter
    assert adapter.tokens_per_image(solid("red", (112, 112))) == 16 * 4
    assert adapter.tokens_per_image(solid("red", (112, 56))) < 64


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_matching_spans_pass_the_check(arch):
    policy = shared_policy(arch)
    images = [solid("red"), solid("blue", (90, 40))]
    policy.adapter.check(chat_ids(policy, "two", images), images, where="row 0 turn 0")


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_truncated_image_span_is_an_error_naming_row_and_turn(arch):
    policy = shared_policy(arch)
    images = [solid("red")]
    ids = chat_ids(policy, "one", images)
    ids.remove(policy.adapter.image_token_id)
    with pytest.raises(GymvError) as err:
        policy.adapter.check(ids, images, where="rows.jsonl line 4, turn 2")
    msg = str(err.value)
    assert msg.startswith("rows.jsonl line 4, turn 2: image placeholder tokens do not match the images")
    assert f"span(s) [{policy.adapter.tokens_per_image(images[0]) - 1}]" in msg


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl"])
def test_image_without_placeholders_and_placeholders_without_image_are_errors(arch):
    policy = shared_policy(arch)
    images = [solid("red")]
    ids = chat_ids(policy, "one", images)
    with pytest.raises(GymvError, match="do not match"):
        policy.adapter.check(ids, images * 2, where="row 1")
    with pytest.raises(GymvError, match="do not match"):
        policy.adapter.check(ids, [], where="row 1")


def test_grid_spans_of_two_images_must_each_match_their_own_image():
    policy = shared_policy("tiny-qwen2vl")
    big, small = solid("red", (112, 112)), solid("red", (56, 28))
    ids = chat_ids(policy, "two", [big, small])
    with pytest.raises(GymvError, match="do not match"):
        policy.adapter.check(ids, [small, big])


def test_encode_text_requires_one_image_per_placeholder():
    policy = shared_policy("tiny-llava")
    with pytest.raises(GymvError, match="1 image placeholder"):
        policy.adapter.encode_text("<image>hi", [], where="row 2")


def test_vision_token_ids_list_every_vision_special():
    llava = shared_policy("tiny-llava")
    assert llava.adapter.vision_token_ids == (llava.tokenizer.convert_tokens_to_ids("<image>"),)
    qwen = shared_policy("tiny-qwen2vl")
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    assert set(qwen.adapter.vision_token_ids) == {qwen.tokenizer.convert_tokens_to_ids(n) for n in names}


def test_image_hash_is_a_content_hash():
    from gymv.backends.multimodal import image_hash

    assert image_hash(solid("red")) == image_hash(solid("red"))
    assert image_hash(solid("red")) != image_hash(solid("blue"))
    assert image_hash(solid("red", (10, 20))) != image_hash(solid("red", (20, 10)))


def test_unsupported_processor_class_lists_supported_ones():
    from gymv.backends.multimodal import make_adapter

    policy = shared_policy("tiny-llava")
    with pytest.raises(GymvError, match=r"unsupported processor 'IdeficsProcessor'.*LlavaProcessor \(placeholder\)"):
        make_adapter("IdeficsProcessor", policy.tokenizer, policy.image_processor, policy.model.config)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl", "tiny-smolvlm", "tiny-qwen3"])
def test_a_padded_batch_passes_the_check_where_each_row_does(arch):
    from gymv.backends.logprobs import right_pad

    policy = shared_policy(arch)
    rows = [[], [solid("red")], [solid("blue", (90, 40)), solid("red")]] if arch != "tiny-qwen3" else [[], [], []]
    ids = [chat_ids(policy, f"row {b}", images) if images or arch != "tiny-qwen3" else
           policy.tokenizer.encode(f"row {b}" * (b + 1)) for b, images in enumerate(rows)]
    batch = right_pad(ids, rows, pad_id=0)
    policy.adapter.check_batch(batch.input_ids, batch.images, None, batch.attention_mask)


@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-qwen2vl", "tiny-smolvlm"])
def test_a_padded_batch_names_the_first_row_whose_spans_do_not_match(arch):
    from gymv.backends.logprobs import right_pad

    policy = shared_policy(arch)
    rows = [[solid("red")], [solid("blue")], [solid("green")]]
    ids = [chat_ids(policy, f"row {b}", images) for b, images in enumerate(rows)]
    ids[1].remove(policy.adapter.image_token_id)
    batch = right_pad(ids, rows, pad_id=policy.adapter.image_token_id)  # padding never counts as a placeholder
    with pytest.raises(GymvError, match="^sample 7: image placeholder tokens do not match"):
        policy.adapter.check_batch(batch.input_ids, batch.images, ["sample 6", "sample 7", "sample 8"],
                                   batch.attention_mask)
