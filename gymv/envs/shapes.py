"""Flat-color drawings for the shape environments: regular polygons, tangram pieces and grid cells.

Everything is drawn with PIL (no anti-aliasing) into a palette-index canvas and written with gymv's
deterministic indexed-PNG encoder, so the same geometry always gives the same bytes and generated rows
stay small. Colors are the eight named colors of the circle environments.
"""

from __future__ import annotations

import math
from typing import Any

from gymv.data.images import encode_png_indexed, to_data_url
from gymv.envs.circles import COLORS, WHITE
from gymv.errors import GymvError

# Regular polygons by name: number of sides.
POLYGONS: dict[str, int] = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6, "heptagon": 7, "octagon": 8}
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")

Point = tuple[float, float]


def regular_polygon(cx: float, cy: float, radius: float, sides: int, rotation: float = 0.0) -> list[Point]:
    """Vertices of a regular polygon; at rotation 0 odd polygons point up and even ones sit on a flat side."""
    start = -90.0 + (180.0 / sides if sides % 2 == 0 else 0.0) + rotation
    return [(cx + radius * math.cos(math.radians(start + 360.0 * k / sides)),
             cy + radius * math.sin(math.radians(start + 360.0 * k / sides))) for k in range(sides)]


def transform(points: list[Point], *, angle: float = 0.0, scale: float = 1.0, dx: float = 0.0, dy: float = 0.0,
              mirror: bool = False) -> list[Point]:
    """Mirror (x -> -x), rotate by `angle` degrees about the origin, scale, then translate."""
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    out = []
    for x, y in points:
        if mirror:
            x = -x
        out.append(((x * c - y * s) * scale + dx, (x * s + y * c) * scale + dy))
    return out


def centroid(points: list[Point]) -> Point:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


class Canvas:
    """A white canvas of palette indices; colors are added to the palette as they are first used."""

    def __init__(self, width: int, height: int | None = None, background: tuple[int, int, int] = WHITE):
        from PIL import Image, ImageDraw

        self.width, self.height = width, height or width
        self.palette: list[tuple[int, int, int]] = [background]
        self._img = Image.new("L", (self.width, self.height), 0)
        self._draw = ImageDraw.Draw(self._img)

    def index(self, color: str | tuple[int, int, int]) -> int:
        rgb = COLORS[color] if isinstance(color, str) else tuple(color)
        if rgb not in self.palette:
            self.palette.append(rgb)
        return self.palette.index(rgb)

    def polygon(self, points: list[Point], color: Any, *, outline: Any = None, width: int = 1) -> None:
        pts = [(round(x, 3), round(y, 3)) for x, y in points]
        self._draw.polygon(pts, fill=self.index(color))
        if outline is not None:
            self._draw.line(pts + pts[:1], fill=self.index(outline), width=width)

    def rectangle(self, box: tuple[float, float, float, float], color: Any = None, *, outline: Any = None,
                  width: int = 1) -> None:
        self._draw.rectangle(box, fill=None if color is None else self.index(color),
                             outline=None if outline is None else self.index(outline), width=width)

    def ellipse(self, box: tuple[float, float, float, float], color: Any) -> None:
        self._draw.ellipse(box, fill=self.index(color))

    def data_url(self) -> str:
        import numpy as np

        return to_data_url(encode_png_indexed(np.asarray(self._img, dtype=np.uint8), self.palette))


def draw_polygon_picture(size: int, shape: str, color: str, *, x: float, y: float, radius: float,
                         rotation: float = 0.0) -> str:
    """A PNG data URL of one regular polygon on white."""
    canvas = Canvas(size)
    canvas.polygon(regular_polygon(x, y, radius, POLYGONS[shape], rotation), color)
    return canvas.data_url()


def check_names(env: str, knob: str, names: tuple[str, ...], known: dict | tuple, *, at_least: int = 1) -> None:
    """Knob check shared by the shape environments: known, distinct names, enough of them."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise GymvError(f"{env}: unknown {knob} entry {unknown[0]!r}", fix=f"choose from: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise GymvError(f"{env}: {knob} lists a name twice", fix="list each name once")
    if len(names) < at_least:
        raise GymvError(f"{env}: {knob} needs at least {at_least} names, got {len(names)}",
                        fix=f"add {knob} names")


def word_pattern(words: list[str] | tuple[str, ...]) -> str:
    """A regex alternation of whole words, longest first (so 'large triangle' wins over 'triangle')."""
    import re

    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
