"""Bad data rows fail on the driver, before Ray or any worker starts, with the file and line."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest

from envs_scripts import tiny_rows
from gymv.envs import get_env
from gymv.envs.protocol import RowError
from gymv.train import train
from gymv.train.data import read_rows
from gymv.train.row_checks import check_training_rows
from tiny_models import tiny_path
from train_helpers import no_shared_ray, tiny_grpo_settings, write_recipe


def _png(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")  # 1-bit: a huge canvas stays a small file
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _with_image(row: dict, url) -> dict:
    row = json.loads(json.dumps(row))
    for msg in row["responses_create_params"]["input"]:
        for part in msg["content"] if isinstance(msg["content"], list) else []:
            if part.get("type") == "input_image":
                part["image_url"] = url
                return row
    raise AssertionError("the row has no prompt image")


def _with_text(row: dict, text: str) -> dict:
    row = json.loads(json.dumps(row))
    row["responses_create_params"]["input"].append({"role": "user", "content": text})
    return row


@pytest.fixture(scope="module")
def good():
    return tiny_rows(get_env("circle-count"), 1)[0][1]


def _rows_file(tmp_path, good, bad):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    return path


BAD_IMAGES = {
    "http": ("http://example.com/cat.png", "not a data URL"),
    "file": ("file:///etc/passwd", "not a data URL"),
    "html": ("data:text/html;base64,PGI+aGk8L2I+", "not an image"),
    "empty-data-url": ("data:,", "not an image"),
    "not-a-string": (12, "must be a string"),
    "not-base64": ("data:image/png;base64,@@@", "invalid base64"),
    "not-an-image": ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "readable image"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_prompt_image_that_is_no_usable_image_names_its_row(tmp_path, good, case):
    url, expected = BAD_IMAGES[case]
    rows = read_rows(str(_rows_file(tmp_path, good, _with_image(good, url))))
    with pytest.raises(RowError, match=expected) as e:
        check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256)
    assert "train.jsonl line 2" in e.value.one_line()


def test_a_prompt_image_over_the_pixel_limit_is_refused_without_decoding_it(tmp_path, good):
    rows = read_rows(str(_rows_file(tmp_path, good, _with_image(good, _png(5000, 5000)))))
    with pytest.raises(RowError, match="pixel limit") as e:
        check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256, max_pixels=1024 * 1024)
    assert "line 2" in e.value.one_line()


def _with_images(row: dict, n: int) -> dict:
    row = json.loads(json.dumps(row))
    msg = next(m for m in row["responses_create_params"]["input"] if isinstance(m["content"], list))
    image = next(p for p in msg["content"] if p.get("type") == "input_image")
    msg["content"] = [dict(image) for _ in range(n)] + [p for p in msg["content"] if p is not image]
    return row


def test_a_prompt_with_more_images_than_a_sample_may_hold_names_its_row_and_the_key(tmp_path, good):
    rows = read_rows(str(_rows_file(tmp_path, good, _with_images(good, 1000))))
    with pytest.raises(RowError, match="1000 images, over vision.max_images_per_sample 8") as e:
        check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256, max_images=8)
    assert "line 2" in e.value.one_line()
    check_training_rows(rows[:1], model_path=str(tiny_path("tiny-llava")), max_seq_len=256, max_images=8)


def test_train_refuses_a_row_with_too_many_images_before_starting_ray(tmp_path, good):
    import ray

    no_shared_ray()
    data = _rows_file(tmp_path, good, _with_images(good, 9))
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
        "env.name": "circle-count", "data.train": str(data), "data.prepare": None})
    with pytest.raises(RowError, match="9 images, over vision.max_images_per_sample 8"):
        train(write_recipe(tmp_path, "many-images", "vlm_grpo.yaml", settings))
    assert not ray.is_initialized()


def test_a_prompt_longer_than_max_seq_len_names_its_row_and_the_limit(tmp_path, good):
    rows = read_rows(str(_rows_file(tmp_path, good, _with_text(good, "count the circles " * 200))))
    with pytest.raises(RowError, match=r"tokens, leaving no room to generate within model.max_seq_len 256") as e:
        check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256)
    assert "line 2" in e.value.one_line()


def test_a_64_mib_prompt_is_refused_at_once_from_its_size(tmp_path, good):
    rows = read_rows(str(_rows_file(tmp_path, good, _with_text(good, "x" * (64 << 20)))))
    t0 = time.perf_counter()
    with pytest.raises(RowError, match="bytes, far over model.max_seq_len"):
        check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256)
    assert time.perf_counter() - t0 < 10


def test_good_rows_pass(tmp_path, good):
    rows = read_rows(str(_rows_file(tmp_path, good, good)))
    check_training_rows(rows, model_path=str(tiny_path("tiny-llava")), max_seq_len=256)


def test_train_refuses_a_bad_row_before_starting_ray(tmp_path, good):
    import ray

    no_shared_ray()
    data = _rows_file(tmp_path, good, _with_image(good, "https://example.com/x.png"))
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
        "env.name": "circle-count", "data.train": str(data), "data.prepare": None})
    assert not ray.is_initialized()
    with pytest.raises(RowError, match="not a data URL") as e:
        train(write_recipe(tmp_path, "bad-row", "vlm_grpo.yaml", settings))
    assert "train.jsonl line 2" in e.value.one_line()
    assert not ray.is_initialized()
