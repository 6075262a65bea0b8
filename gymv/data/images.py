"""Images as data URLs: deterministic PNG encoding, and decoding that refuses hostile input.

Rows carry images as ``data:image/png;base64,...`` strings (NeMo Gym's format). Everything that reads an
image from a row, a rollout or an HTTP body goes through :func:`decode_data_url`, which checks the byte
size before decoding base64 and the pixel count from the header before decompressing, so a small file that
declares a huge canvas (a decompression bomb) is refused without allocating it.

The encoder writes PNG itself (no metadata chunks, a fixed zlib strategy) so that the same pixels always give
the same bytes; indexed images use the smallest bit depth their palette allows, which keeps generated rows
small and fast to write while decoding to exactly the same RGB pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import zlib
from typing import TYPE_CHECKING

from gymv.errors import GymvError

if TYPE_CHECKING:  # PIL is imported lazily: `gymv --help` must not pay for it
    import numpy as np
    from PIL import Image as PILImage

DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.ASCII)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ImageError(GymvError):
    """An image in a row, rollout or request is unusable: not a data URL, not an image, or too large."""


def split_data_url(url: object, *, where: str | None = None) -> tuple[str, str]:
    """Return (mime type, base64 payload) of a base64 data URL, or raise ImageError saying what is wrong."""
    if not isinstance(url, str):
        raise ImageError(f"image_url must be a string, got {type(url).__name__}", where=where,
                         fix="write images as 'data:image/png;base64,...' strings")
    m = _DATA_URL.match(url)
    if not m:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ImageError(f"image_url is not a data URL: {shown!r}", where=where,
                         fix="embed the image as 'data:image/png;base64,...' (remote URLs are not fetched)")
    mime = (m.group("mime") or "text/plain").lower()
    if not mime.startswith("image/"):
        raise ImageError(f"data URL has media type {mime!r}, not an image", where=where,
                         fix="use an image/png or image/jpeg data URL")
    if not m.group("b64"):
        raise ImageError("image data URL is not base64-encoded", where=where,
                         fix="write it as 'data:image/png;base64,...'")
    return mime, url[m.end():]


def decode_data_url(
    url: object,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    mode: str | None = "RGB",
    where: str | None = None,
) -> "PILImage.Image":
    """Decode an image data URL into a loaded PIL image (converted to `mode` unless it is None).

    Refuses, with an ImageError naming `where`: non-data URLs, non-image media types, bad base64, payloads
    over `max_bytes`, files PIL cannot identify or that are truncated, formats outside ALLOWED_FORMATS, and
    canvases over `max_pixels` (checked from the header, before any pixel is decompressed).
    """
    _, payload = split_data_url(url, where=where)
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImageError(f"image is larger than the {max_bytes} byte limit", where=where,
                         fix="use a smaller image or raise the byte limit")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"image data URL has invalid base64: {e}", where=where,
                         fix="re-encode the image with standard base64") from None
    if len(raw) > max_bytes:
        raise ImageError(f"image is larger than the {max_bytes} byte limit", where=where,
                         fix="use a smaller image or raise the byte limit")
    return decode_image_bytes(raw, max_pixels=max_pixels, mode=mode, where=where)


def decode_image_bytes(
    raw: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, mode: str | None = "RGB", where: str | None = None
) -> "PILImage.Image":
    """Decode encoded image bytes with the same limits as decode_data_url."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            fmt = img.format
            width, height = img.size
            if fmt not in ALLOWED_FORMATS:
                raise ImageError(f"image format {fmt} is not accepted", where=where,
                                 fix=f"use one of {', '.join(ALLOWED_FORMATS)}")
            if width * height > max_pixels:
                raise ImageError(
                    f"image is {width}x{height} = {width * height} pixels, over the {max_pixels} pixel limit "
                    "(possible decompression bomb)", where=where,
                    fix="use a smaller image (training takes up to vision.max_image_pixels, which a recipe may raise)")
            img.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image refused as a decompression bomb: {e}", where=where,
                         fix="use a smaller image") from None
    except UnidentifiedImageError:
        raise ImageError("data URL does not contain a readable image", where=where,
                         fix="embed a PNG or JPEG file") from None
    except (OSError, SyntaxError, ValueError, struct.error, EOFError) as e:
        raise ImageError(f"image is corrupt or truncated: {e}", where=where, fix="re-encode the image") from None
    if mode is not None and img.mode != mode:
        img = img.convert(mode)
    return img


def image_size(url: object, *, where: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[int, int]:
    """Width and height from the header alone (cheap: nothing is decompressed)."""
    from PIL import Image, UnidentifiedImageError

    _, payload = split_data_url(url, where=where)
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImageError(f"image is larger than the {max_bytes} byte limit", where=where,
                         fix="use a smaller image (compress it or lower its resolution)")
    try:
        raw = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(raw)) as img:
            return img.size
    except (binascii.Error, ValueError):
        raise ImageError("image data URL has invalid base64", where=where,
                         fix="encode the image as standard base64 after 'data:image/png;base64,'") from None
    except (UnidentifiedImageError, OSError):
        raise ImageError("data URL does not contain a readable image", where=where,
                         fix="embed a PNG, JPEG, GIF, WebP or BMP image") from None


# ---------------------------------------------------------------------------------------------- encoding


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


_NIBBLES: list = []


def _nibble_table() -> "np.ndarray":
    """Packed byte for every little-endian pair of 4-bit indices (a 64 KiB table, built once)."""
    import numpy as np

    if not _NIBBLES:
        pairs = np.arange(65536, dtype=np.uint32)
        _NIBBLES.append((((pairs & 0x0F) << 4) | ((pairs >> 8) & 0x0F)).astype(np.uint8))
    return _NIBBLES[0]


def _pack_bits(indices: "np.ndarray", bits: int) -> "np.ndarray":
    """Pack 2-D palette indices (uint8 < 2**bits) into PNG scanline bytes, most significant bits first.

    Pixels are grouped by viewing each row as little-endian 16- or 32-bit words, which keeps every step a
    contiguous vector operation (strided per-pixel access is several times slower on large images).
    """
    import numpy as np

    if bits == 8:
        return indices
    if bits == 1:
        return np.packbits(indices, axis=1)
    per = 8 // bits
    pad = (-indices.shape[1]) % per
    if pad:
        indices = np.pad(indices, ((0, 0), (0, pad)))
    indices = np.ascontiguousarray(indices)
    if bits == 4:
        return np.take(_nibble_table(), indices.view("<u2"))
    u = indices.view("<u4")  # bits == 2
    return (((u & 0x03) << 6) | ((u >> 4) & 0x30) | ((u >> 14) & 0x0C) | (u >> 24)).astype(np.uint8)


def encode_png_indexed(indices: "np.ndarray", palette: list[tuple[int, int, int]]) -> bytes:
    """PNG bytes for a 2-D array of palette indices, at the smallest bit depth (1, 2, 4 or 8) that fits."""
    import numpy as np

    indices = np.ascontiguousarray(indices, dtype=np.uint8)
    if indices.ndim != 2 or indices.size == 0:
        raise ValueError("indices must be a non-empty 2-D array")
    if not 1 <= len(palette) <= 256:
        raise ValueError("a PNG palette holds 1 to 256 colors")
    if int(indices.max()) >= len(palette):
        raise ValueError("an index points past the end of the palette")
    bits = next(b for b in (1, 2, 4, 8) if len(palette) <= 1 << b)
    height, width = indices.shape
    packed = _pack_bits(indices, bits)
    scanlines = np.empty((height, packed.shape[1] + 1), dtype=np.uint8)
    scanlines[:, 0] = 0  # filter type None: runs of one index compress best unfiltered
    scanlines[:, 1:] = packed
    comp = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    idat = comp.compress(scanlines.tobytes()) + comp.flush()
    plte = b"".join(struct.pack("BBB", *rgb) for rgb in palette)
    ihdr = struct.pack(">IIBBBBB", width, height, bits, 3, 0, 0, 0)
    return _PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"PLTE", plte) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


_COLOR_TYPES = {"L": (0, 1), "RGB": (2, 3), "RGBA": (6, 4)}


def encode_png(img: "PILImage.Image | np.ndarray") -> bytes:
    """Deterministic PNG bytes for a PIL image or a uint8 array (H×W gray, H×W×3 RGB, H×W×4 RGBA).

    Palette ("P") images keep their palette, trimmed to the indices in use; other modes are converted to
    RGB unless they are L, RGB or RGBA already. No metadata is written, so equal pixels give equal bytes.
    """
    import numpy as np

    if isinstance(img, np.ndarray):
        arr = np.ascontiguousarray(img, dtype=np.uint8)
        mode = {2: "L", 3: {3: "RGB", 4: "RGBA"}.get(arr.shape[-1] if arr.ndim == 3 else 0)}.get(arr.ndim)
        if mode is None:
            raise ValueError(f"cannot encode an array of shape {arr.shape} as PNG")
    else:
        if img.mode == "P" and "transparency" not in img.info:
            indices = np.asarray(img, dtype=np.uint8)
            used = int(indices.max()) + 1
            flat = img.getpalette() or []
            flat = flat + [0] * (3 * used - len(flat))
            palette = [tuple(flat[3 * i: 3 * i + 3]) for i in range(used)]
            return encode_png_indexed(indices, palette)
        if img.mode not in _COLOR_TYPES:
            img = img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info else "RGB")
        mode = img.mode
        arr = np.asarray(img, dtype=np.uint8)
    color_type, channels = _COLOR_TYPES[mode]
    height, width = arr.shape[:2]
    scanlines = np.empty((height, width * channels + 1), dtype=np.uint8)
    scanlines[:, 0] = 0
    scanlines[:, 1:] = arr.reshape(height, width * channels)
    idat = zlib.compress(scanlines.tobytes(), 6)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return _PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def to_data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def png_data_url(img: "PILImage.Image | np.ndarray") -> str:
    """The data URL rows use for an image: ``data:image/png;base64,...`` of :func:`encode_png`."""
    return to_data_url(encode_png(img))
