"""What circle-count and circle-click share: the palette, placement, rendering and row checks.

The eight colors and their RGB values are NeMo Gym's, so that a gymv image and a NeMo Gym image of the
same circles are pixel-identical (drawn as filled ellipses on white, box [x-r, y-r, x+r, y+r]).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from gymv.data.images import encode_png_indexed, image_size, to_data_url
from gymv.envs import sampling
from gymv.envs.protocol import RowError
from gymv.envs.rows import input_messages
from gymv.errors import GymvError

if TYPE_CHECKING:
    import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 50, 47),
    "blue": (38, 139, 210),
    "green": (133, 153, 0),
    "yellow": (181, 137, 0),
    "purple": (108, 113, 196),
    "orange": (203, 75, 22),
    "cyan": (42, 161, 152),
    "pink": (211, 54, 130),
}
WHITE = (255, 255, 255)


def fill(template: str, **values: Any) -> str:
    """Replace `{name}` placeholders for the given names only, so templates may contain `\\boxed{N}`."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def place(rng: random.Random, n: int, size: int, radius: int, *, edge_margin: int, min_gap: int,
          overlap: bool, max_tries: int) -> list[tuple[int, int]]:
    """Centres for up to n circles inside the image; a circle that finds no free spot is left out."""
    lo, hi = radius + edge_margin, size - radius - edge_margin
    min_d2 = (2 * radius + min_gap) ** 2
    centres: list[tuple[int, int]] = []
    for _ in range(n):
        for _ in range(max_tries):
            x, y = sampling.randint(rng, lo, hi), sampling.randint(rng, lo, hi)
            if overlap or all((x - cx) ** 2 + (y - cy) ** 2 > min_d2 for cx, cy in centres):
                centres.append((x, y))
                break
    return centres


def _disc(radius: int) -> "np.ndarray":
    """Boolean mask of a filled circle as PIL draws it in the box [0, 0, 2r, 2r]."""
    import numpy as np
    from PIL import Image, ImageDraw

    mask = _DISCS.get(radius)
    if mask is None:
        img = Image.new("L", (2 * radius + 1, 2 * radius + 1), 0)
        ImageDraw.Draw(img).ellipse([0, 0, 2 * radius, 2 * radius], fill=1)
        mask = _DISCS[radius] = np.asarray(img, dtype=bool)
    return mask


_DISCS: dict[int, "np.ndarray"] = {}


def render(size: int, circles: list[dict]) -> str:
    """A PNG data URL of the circles, filled in order on a white square (later circles on top).

    Each circle is PIL's filled ellipse in the box [x-r, y-r, x+r, y+r], stamped from a cached mask, so the
    pixels equal drawing the ellipses one by one while skipping a full-image copy out of PIL.
    """
    import numpy as np

    palette = [WHITE]
    index: dict[str, int] = {}
    canvas = np.zeros((size, size), dtype=np.uint8)
    for c in circles:
        color = c["color"]
        if color not in index:
            index[color] = len(palette)
            palette.append(COLORS[color])
        x, y, r = int(c["x"]), int(c["y"]), int(c["radius"])
        mask = _disc(r)
        x0, y0 = max(x - r, 0), max(y - r, 0)
        x1, y1 = min(x + r + 1, size), min(y + r + 1, size)
        if x0 < x1 and y0 < y1:
            canvas[y0:y1, x0:x1][mask[y0 - (y - r):y1 - (y - r), x0 - (x - r):x1 - (x - r)]] = index[color]
    return to_data_url(encode_png_indexed(canvas, palette))


def check_geometry(knobs: Any, env: str) -> None:
    """Knob checks both circle environments share."""
    (smin, smax), (rmin, rmax) = knobs.image_size, knobs.radius
    if smin < 8 or smax > 4096:
        raise GymvError(f"{env}: image_size {smin}:{smax} must lie within 8:4096", fix="e.g. image_size=56")
    if rmin < 1:
        raise GymvError(f"{env}: radius must be at least 1 pixel", fix="e.g. radius=7")
    if knobs.edge_margin < 0 or knobs.max_tries < 1:
        raise GymvError(f"{env}: edge_margin must be >= 0 and max_tries >= 1",
                        fix="set edge_margin to 0 or more and max_tries to 1 or more")
    if 2 * (rmax + knobs.edge_margin) > smin:
        raise GymvError(
            f"{env}: a circle of radius {rmax} with edge_margin {knobs.edge_margin} does not fit in a "
            f"{smin}px image", fix="lower radius or edge_margin, or raise image_size")
    if knobs.circles[0] < 1:
        raise GymvError(f"{env}: circles must be at least 1", fix="e.g. circles=1:3")
    unknown = [c for c in knobs.palette if c not in COLORS]
    if unknown:
        raise GymvError(f"{env}: unknown color {unknown[0]!r} in palette", fix=f"colors: {', '.join(COLORS)}")
    if len(set(knobs.palette)) != len(knobs.palette):
        raise GymvError(f"{env}: palette lists a color twice", fix="list each color once")


def row_circles(row: dict, *, geometry: bool, where: str | None = None) -> tuple[list[dict], str]:
    """The row's `circles` and `target_color`, checked; RowError (the data's fault) when malformed."""
    circles, target = row.get("circles"), row.get("target_color")
    if not isinstance(circles, list):
        raise RowError("verifier field 'circles' must be a list", where=where,
                       fix="write circles as a list of {x, y, radius, color} (gymv prepare makes such rows)")
    if not isinstance(target, str):
        raise RowError("verifier field 'target_color' must be a string", where=where,
                       fix='write target_color as a color name, e.g. "red"')
    keys = ("x", "y", "radius", "color") if geometry else ("color",)
    for i, c in enumerate(circles):
        if not isinstance(c, dict) or any(k not in c for k in keys):
            raise RowError(f"circles[{i}] must be an object with {', '.join(keys)}", where=where,
                           fix="write each circle as {x, y, radius, color}")
        if not isinstance(c["color"], str):
            raise RowError(f"circles[{i}].color must be a string", where=where,
                           fix='write the color as a name, e.g. "red"')
        if geometry and not all(isinstance(c[k], (int, float)) and not isinstance(c[k], bool) for k in ("x", "y", "radius")):
            raise RowError(f"circles[{i}] x, y and radius must be numbers", where=where,
                           fix="write x, y and radius as numbers")
    return circles, target


def image_size_of(row: dict) -> int | None:
    """Side of the row's (square) image from its PNG header, without decoding pixels."""
    for msg in input_messages(row):
        for img in msg.images:
            return image_size(img.url)[0]
    return None
