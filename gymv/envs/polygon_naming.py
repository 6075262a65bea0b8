"""polygon-naming: three pictures of one polygon each; two are in the prompt, the third only behind a tool.

The model sees pictures 1 and 2, calls `get_picture(index=3)` (its result carries the third picture),
then names each polygon's color and shape, e.g. ``1: red triangle``, one picture per line.

Reward: the final model turn is read for "<color> <shape>" pairs; a pair preceded by a label ``1:``,
``2)`` or ``3.`` names that picture, an unlabelled pair names the picture of its position among the
pairs, and the first naming of a picture counts. Each picture named with both its color and its shape
right earns 1/3; picture 3 counts only if `get_picture` was called with index 3 in an earlier turn (a
guess is not an answer). Reward = pictures right / 3.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from gymv.envs import sampling
from gymv.envs.circles import COLORS
from gymv.envs.knobs import knob
from gymv.envs.protocol import (Environment, EpisodeState, Image, ModelTurn, RowError, Score, Tool, ToolCall,
                                ToolCallError, ToolOutput)
from gymv.envs.shapes import POLYGONS, check_names, draw_polygon_picture, word_pattern
from gymv.envs.transcript import final_turn_text, function_call_arguments, model_turns
from gymv.errors import GymvError

PICTURES = 3
HIDDEN = 3  # the picture only the tool shows

DEFAULT_SYSTEM_PROMPT = (
    "You see pictures of single flat-colored polygons. When you need a picture that you have not been shown, "
    "ask for it with the get_picture tool. Answer with the requested lines only."
)
DEFAULT_QUESTION = (
    "There are three pictures, each with one polygon. Pictures 1 and 2 are above; picture 3 is only "
    "available through get_picture with index 3. Look at all three, then write one line per picture "
    "giving its color and shape, like `1: red triangle`."
)
GET_PICTURE_DESCRIPTION = "Show one of the three numbered pictures."
GET_PICTURE_PARAMETERS = {
    "type": "object",
    "properties": {"index": {"type": "integer", "minimum": 1, "maximum": PICTURES,
                             "description": "which picture to show: 1, 2 or 3"}},
    "required": ["index"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class PolygonNamingKnobs:
    image_size: tuple[int, int] = knob((512, 512), "side of each square picture in pixels, lo:hi per row")
    shapes: tuple[str, ...] = knob(tuple(POLYGONS), "polygon shapes to draw from")
    palette: tuple[str, ...] = knob(tuple(COLORS), "colors to draw from")
    radius: tuple[int, int] = knob((60, 200), "polygon circumradius in pixels, lo:hi per picture")
    centred: bool = knob(False, "put each polygon at its picture's centre (false: anywhere it fits)")
    rotate: bool = knob(True, "turn each polygon by a random angle")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    question: str = knob(DEFAULT_QUESTION, "the user's request after pictures 1 and 2")


TINY = PolygonNamingKnobs(
    image_size=(56, 56), shapes=("triangle", "square", "hexagon"), palette=("red", "green", "blue"),
    radius=(20, 20), centred=True, rotate=False, system_prompt="",
    question="Get picture 3, then name all three like 1: red square.",
)

_COLOR_WORDS = word_pattern(tuple(COLORS))
_SHAPE_WORDS = word_pattern(tuple(POLYGONS))
_PAIR = re.compile(rf"(?:\b([1-3])\s*[:.)\-]\s*)?\b({_COLOR_WORDS})[\s-]+({_SHAPE_WORDS})s?\b", re.IGNORECASE)


def parse_names(text: str) -> dict[int, tuple[str, str]]:
    """Picture number -> (color, shape) as named in `text`; the first naming of a picture wins."""
    named: dict[int, tuple[str, str]] = {}
    for k, m in enumerate(_PAIR.finditer(text), 1):
        pos = int(m.group(1)) if m.group(1) else k
        if 1 <= pos <= PICTURES and pos not in named:
            named[pos] = (m.group(2).lower(), m.group(3).lower())
    return named


def fetched_hidden(output: list) -> bool:
    """Whether get_picture was called with index 3 before the model's final turn."""
    for turn in model_turns(output)[:-1]:
        for item in turn:
            if item.get("type") == "function_call" and item.get("name") == "get_picture":
                args = function_call_arguments(item)
                try:
                    if args is not None and int(args.get("index")) == HIDDEN:
                        return True
                except (TypeError, ValueError, OverflowError):
                    continue
    return False


class PolygonNaming(Environment):
    name = "polygon-naming"
    agent_name = "polygon_naming_agent"
    description = "name three polygons' colors and shapes; the third picture comes from the tool get_picture"
    verifier_fields = ("polygons",)
    max_turns = 3
    Knobs = PolygonNamingKnobs
    presets = {"default": PolygonNamingKnobs(), "tiny": TINY}

    def tool_specs(self) -> list[Tool]:
        return [Tool("get_picture", GET_PICTURE_DESCRIPTION, GET_PICTURE_PARAMETERS, self._get_picture)]

    def _get_picture(self, state: EpisodeState | None, args: dict) -> ToolOutput:
        if state is None:
            raise ToolCallError("get_picture needs an episode: start the session with the row "
                                "(POST /seed_session or /reset with it)", status=409)
        k = args["index"]
        return ToolOutput(f"Picture {k}:", [Image(self.picture(state.row, k))])

    # -- data ----------------------------------------------------------------------------------------
    def check_knobs(self, knobs: PolygonNamingKnobs) -> None:
        check_names(self.name, "shapes", knobs.shapes, POLYGONS)
        check_names(self.name, "palette", knobs.palette, COLORS)
        if len(knobs.shapes) * len(knobs.palette) < PICTURES:
            raise GymvError(f"{self.name}: shapes x palette must give at least {PICTURES} distinct polygons",
                            fix="add shapes or colors")
        (smin, smax), (rmin, rmax) = knobs.image_size, knobs.radius
        if smin < 16 or smax > 4096:
            raise GymvError(f"{self.name}: image_size {smin}:{smax} must lie within 16:4096",
                            fix="set image_size within 16:4096")
        if rmin < 3 or 2 * rmax + 2 > smin:
            raise GymvError(f"{self.name}: radius {rmin}:{rmax} must be at least 3 and fit a {smin}px picture",
                            fix=f"use radius up to {(smin - 2) // 2}")

    def make_row(self, rng: random.Random, knobs: PolygonNamingKnobs, index: int) -> dict:
        size = sampling.randint(rng, *knobs.image_size)
        polygons: list[dict] = []
        seen: set[tuple[str, str]] = set()
        while len(polygons) < PICTURES:
            shape, color = sampling.choice(rng, knobs.shapes), sampling.choice(rng, knobs.palette)
            if (shape, color) in seen:
                continue
            seen.add((shape, color))
            r = sampling.randint(rng, *knobs.radius)
            if knobs.centred:
                x = y = size // 2
            else:
                x, y = sampling.randint(rng, r + 1, size - r - 1), sampling.randint(rng, r + 1, size - r - 1)
            rotation = round(rng.random() * 360.0, 1) if knobs.rotate else 0.0
            polygons.append({"shape": shape, "color": color, "x": x, "y": y, "radius": r, "rotation": rotation})
        row = {"polygons": polygons, "image_size": size}
        content: list[dict] = []
        for k in range(1, PICTURES):
            content.append({"type": "input_text", "text": f"Picture {k}:"})
            content.append({"type": "input_image", "image_url": self.picture(row, k), "detail": "auto"})
        content.append({"type": "input_text", "text": knobs.question})
        messages: list[dict] = [{"role": "system", "content": knobs.system_prompt}] if knobs.system_prompt else []
        messages.append({"role": "user", "content": content})
        return {"responses_create_params": {"input": messages, "tools": self.tools()}, **row,
                "agent_ref": {"type": "responses_api_agents", "name": self.agent_name}}

    def picture(self, row: dict, k: int) -> str:
        """Picture k (1-based) of a row, drawn from its geometry (the row never stores picture 3)."""
        p = row["polygons"][k - 1]
        return draw_polygon_picture(int(row["image_size"]), p["shape"], p["color"], x=p["x"], y=p["y"],
                                    radius=p["radius"], rotation=p.get("rotation", 0.0))

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        polygons = row["polygons"]
        if not isinstance(polygons, list) or len(polygons) != PICTURES:
            raise RowError(f"verifier field 'polygons' must be a list of {PICTURES} objects", where=where,
                           fix="write polygons as gymv prepare polygon-naming does")
        for i, p in enumerate(polygons):
            if not isinstance(p, dict) or not all(isinstance(p.get(k), str) for k in ("shape", "color")) \
                    or p["shape"] not in POLYGONS or p["color"] not in COLORS:
                raise RowError(f"polygons[{i}] needs a known 'shape' ({', '.join(POLYGONS)}) and 'color' "
                               f"({', '.join(COLORS)})", where=where, fix="use a known shape and color name")
            if not all(isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool)
                       for k in ("x", "y", "radius")):
                raise RowError(f"polygons[{i}] x, y and radius must be numbers", where=where,
                               fix="write x, y and radius as numbers")
        size = row.get("image_size")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 4096:
            raise RowError("field 'image_size' must be an integer from 1 to 4096", where=where,
                           fix="set image_size to an integer from 1 to 4096")
        return row

    # -- scoring -------------------------------------------------------------------------------------
    def score_output(self, row: dict, output: list[dict]) -> Score:
        self.check_row(row)
        named = parse_names(final_turn_text(output))
        fetched = fetched_hidden(output)
        truth = [(p["color"], p["shape"]) for p in row["polygons"]]
        by_name = [named.get(k) == truth[k - 1] for k in range(1, PICTURES + 1)]
        correct = [ok and (k != HIDDEN or fetched) for k, ok in enumerate(by_name, 1)]
        n = sum(correct)
        if n == PICTURES:
            reason = None
        elif not named:
            reason = "no_answer"
        elif by_name[HIDDEN - 1] and not fetched and all(by_name):
            reason = "third_not_fetched"
        else:
            reason = "wrong_names"
        extras = {"named": [" ".join(named[k]) if k in named else None for k in range(1, PICTURES + 1)],
                  "correct": correct, "n_correct": n, "fetched_third": fetched}
        return Score(n / PICTURES, extras, reason)

    def gold_turns(self, row: dict) -> list[ModelTurn]:
        fetch = ModelTurn(tool_calls=[ToolCall("get_picture", json.dumps({"index": HIDDEN}), call_id="call_gold_0")])
        lines = "\n".join(f"{k}: {p['color']} {p['shape']}" for k, p in enumerate(row["polygons"], 1))
        return [fetch, ModelTurn(text=lines)]

    def gold_turn(self, row: dict) -> ModelTurn:
        """The first gold turn (the fetch); the whole episode is `gold_turns`."""
        return self.gold_turns(row)[0]
