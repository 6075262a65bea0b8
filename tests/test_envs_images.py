"""Images as data URLs: deterministic PNG encoding and decoding that refuses hostile or broken input."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from gymv.data.images import (
    ImageError,
    decode_data_url,
    encode_png,
    encode_png_indexed,
    png_data_url,
    to_data_url,
)


def _palette_image() -> Image.Image:
    from PIL import ImageDraw

    img = Image.new("P", (57, 31), 0)
    img.putpalette([255, 255, 255, 220, 50, 47, 38, 139, 210])
    draw = ImageDraw.Draw(img)
    draw.ellipse([3, 3, 20, 20], fill=1)
    draw.ellipse([30, 3, 50, 25], fill=2)
    return img


def _bomb_png(width: int, height: int) -> bytes:
    """A real, valid 1-bit PNG of width x height white pixels: tiny on disk, huge once decompressed."""
    row = b"\x00" + b"\x00" * ((width + 7) // 8)
    comp = zlib.compressobj(9)
    block = row * 500
    idat = b"".join(comp.compress(block) for _ in range(height // 500)) + comp.compress(row * (height % 500)) + comp.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_palette_png_decodes_to_the_same_rgb_pixels():
    img = _palette_image()
    back = decode_data_url(png_data_url(img))
    assert np.array_equal(np.asarray(back), np.asarray(img.convert("RGB")))


def test_equal_pixels_always_encode_to_equal_bytes():
    assert encode_png(_palette_image()) == encode_png(_palette_image())


def test_two_color_images_are_written_at_one_bit_per_pixel():
    png = encode_png_indexed(np.array([[0, 1, 1], [1, 0, 0]], dtype=np.uint8), [(255, 255, 255), (1, 2, 3)])
    assert png[24] == 1  # IHDR bit depth byte


def test_rgb_array_round_trips_exactly():
    rgb = np.random.RandomState(0).randint(0, 256, (13, 17, 3)).astype(np.uint8)
    assert np.array_equal(np.asarray(decode_data_url(png_data_url(rgb))), rgb)


def test_decoded_images_are_rgb_even_when_stored_with_a_palette():
    assert decode_data_url(png_data_url(_palette_image())).mode == "RGB"


def test_a_remote_url_is_refused_as_not_a_data_url():
    with pytest.raises(ImageError, match="not a data URL"):
        decode_data_url("https://example.com/cat.png", where="row 3")


def test_a_data_url_of_text_is_refused_as_not_an_image():
    with pytest.raises(ImageError, match="not an image"):
        decode_data_url("data:text/plain;base64,aGVsbG8=")


def test_image_bytes_that_are_not_an_image_are_refused():
    url = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()
    with pytest.raises(ImageError, match="readable image"):
        decode_data_url(url)


def test_invalid_base64_is_refused():
    with pytest.raises(ImageError, match="invalid base64"):
        decode_data_url("data:image/png;base64,@@@@")


def test_a_truncated_png_is_refused_as_corrupt():
    png = encode_png(np.random.RandomState(1).randint(0, 256, (64, 64, 3)).astype(np.uint8))
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_data_url(to_data_url(png[: len(png) // 2]))


def test_error_names_where_the_image_was():
    with pytest.raises(ImageError) as e:
        decode_data_url("nope", where="rows.jsonl line 7: input[1].content[0]")
    assert "rows.jsonl line 7" in e.value.one_line()


def test_image_over_the_pixel_limit_is_refused_from_its_header():
    url = to_data_url(_bomb_png(5000, 5000))  # 25 Mpx, above the 16.7 Mpx default
    with pytest.raises(ImageError, match="pixel limit"):
        decode_data_url(url)


def test_decompression_bomb_is_refused_without_decompressing_it():
    png = _bomb_png(30000, 30000)  # 900 Mpx (~110 MB as 1-bit) in a file of about 100 kB
    assert len(png) < 300_000
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="decompression bomb|pixel limit"):
        decode_data_url(to_data_url(png))
    assert time.perf_counter() - t0 < 1.0


def test_payload_over_the_byte_limit_is_refused_before_decoding():
    url = png_data_url(np.zeros((64, 64, 3), dtype=np.uint8))
    with pytest.raises(ImageError, match="byte limit"):
        decode_data_url(url, max_bytes=10)


def test_pixel_limit_is_adjustable():
    url = png_data_url(np.zeros((100, 100), dtype=np.uint8))
    with pytest.raises(ImageError, match="pixel limit"):
        decode_data_url(url, max_pixels=9999)
    assert decode_data_url(url, max_pixels=10000).size == (100, 100)


def test_jpeg_data_urls_decode_too():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 30)).save(buf, format="JPEG")
    assert decode_data_url(to_data_url(buf.getvalue(), "image/jpeg")).size == (8, 8)
