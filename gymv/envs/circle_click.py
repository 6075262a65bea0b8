"""circle-click: click the center of the circle of a given color with the tool `click(x, y)`.

Reward (NeMo Gym's rule): the first `click` function call in the output is read as `int(x), int(y)` of
its JSON arguments (anything that fails to parse means no click); the reward is 1.0 when that point lies
within the first circle of `target_color` (distance <= radius counts as a hit), else 0.0.

The tool itself validates its arguments against the schema (integers), and answers a wrong type with an
error the model can read; the reward rule stays NeMo Gym's, which also accepts e.g. `"x": "12"`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from gymv.envs import circles as C
from gymv.envs import sampling
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, EpisodeState, ModelTurn, Score, Tool, ToolCall, ToolOutput
from gymv.envs.rows import function_calls, row_tools
from gymv.errors import GymvError

# gymv's own wording; the tool's name and argument schema, and the reward rule, are NeMo Gym's.
DEFAULT_SYSTEM_PROMPT = (
    "Pixel (0, 0) is the top-left corner of the picture. Find the circle whose color the user names and "
    "call the click tool once at its middle. x and y are each one whole number."
)
DEFAULT_QUESTION = "The picture is {size} by {size} pixels and contains {shows}. Click the {color} circle."
CLICK_DESCRIPTION = "Press at pixel (x, y) of the picture; x and y are whole numbers."
CLICK_PARAMETERS = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "description": "column of the pixel, a whole number"},
        "y": {"type": "integer", "description": "row of the pixel, a whole number"},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class CircleClickKnobs:
    image_size: tuple[int, int] = knob((1000, 1000), "side of the square image in pixels, drawn per row from lo:hi")
    radius: tuple[int, int] = knob((60, 150), "circle radius in pixels (one radius per image), lo:hi")
    circles: tuple[int, int] = knob((3, 5), "number of circles, each a distinct color, lo:hi")
    palette: tuple[str, ...] = knob(tuple(C.COLORS), "colors to draw from")
    overlap: bool = knob(False, "allow circles to overlap (false: keep min_gap pixels between them)")
    min_gap: int = knob(15, "pixels between two circles when overlap is false")
    edge_margin: int = knob(10, "pixels between a circle and the image edge")
    max_tries: int = knob(500, "placement attempts per circle")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    question: str = knob(DEFAULT_QUESTION, "user text; {size}, {shows} (the circles listed) and {color} are filled in")


TINY = CircleClickKnobs(
    image_size=(56, 56), radius=(7, 7), circles=(2, 3), min_gap=2, edge_margin=1,
    system_prompt="", question="Click the {color} circle.",
)


def _shows(others: list[str], target: str) -> str:
    """'a blue circle, a green circle, and a pink circle' with the target last (NeMo Gym's listing)."""
    items = [f"a {c} circle" for c in others]
    return ", ".join(items) + f", and a {target} circle" if items else f"a {target} circle"


def parse_click(output: list[dict]) -> tuple[int | None, int | None, bool]:
    """(x, y, found) of the first `click` call, read as NeMo Gym reads it: int() of each JSON argument."""
    calls = function_calls(output, "click")
    if not calls:
        return None, None, False
    x = y = None
    try:
        args = json.loads(calls[0]["arguments"])
        x = int(args["x"])
        y = int(args["y"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        pass  # json.JSONDecodeError is a ValueError
    return x, y, True


class CircleClick(Environment):
    name = "circle-click"
    agent_name = "circle_click_simple_agent"
    description = "click the circle of a given color with the tool click(x, y)"
    verifier_fields = ("circles", "target_color")
    Knobs = CircleClickKnobs
    presets = {"default": CircleClickKnobs(), "tiny": TINY}

    def tool_specs(self) -> list[Tool]:
        return [Tool("click", CLICK_DESCRIPTION, CLICK_PARAMETERS, self._click)]

    @staticmethod
    def _click(state: EpisodeState | None, args: dict) -> ToolOutput:
        # Like NeMo Gym's /click, echo the point; the verifier reads the call itself.
        return ToolOutput(json.dumps({"x": args["x"], "y": args["y"]}, separators=(",", ":")))

    def check_knobs(self, knobs: CircleClickKnobs) -> None:
        C.check_geometry(knobs, self.name)
        if knobs.circles[1] > len(knobs.palette):
            raise GymvError(f"{self.name}: up to {knobs.circles[1]} circles of distinct colors need as many "
                            f"palette colors, the palette has {len(knobs.palette)}", fix="lower circles or add colors")

    def make_row(self, rng: random.Random, knobs: CircleClickKnobs, index: int) -> dict:
        size = sampling.randint(rng, *knobs.image_size)
        radius = sampling.randint(rng, *knobs.radius)
        n = sampling.randint(rng, *knobs.circles)
        colors = sampling.sample(rng, knobs.palette, n)
        centres = C.place(rng, n, size, radius, edge_margin=knobs.edge_margin, min_gap=knobs.min_gap,
                          overlap=knobs.overlap, max_tries=knobs.max_tries)
        circles = [{"x": x, "y": y, "radius": radius, "color": colors[i]} for i, (x, y) in enumerate(centres)]
        # The target is drawn among circles actually placed, so every row has a reachable answer.
        target = sampling.choice(rng, [c["color"] for c in circles])
        others = [c["color"] for c in circles if c["color"] != target]
        messages: list[dict] = []
        if knobs.system_prompt:
            messages.append({"role": "system", "content": knobs.system_prompt})
        text = C.fill(knobs.question, size=size, shows=_shows(others, target), color=target)
        messages.append({"role": "user", "content": [
            {"type": "input_image", "image_url": C.render(size, circles), "detail": "auto"},
            {"type": "input_text", "text": text},
        ]})
        return {
            "responses_create_params": {"input": messages, "tools": self.tools()},
            "circles": circles,
            "target_color": target,
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    def target_circle(self, row: dict, *, where: str | None = None) -> dict | None:
        circles, target = C.row_circles(row, geometry=True, where=where)
        return next((c for c in circles if c["color"] == target), None)

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        C.row_circles(row, geometry=True, where=where)
        return row

    def score_output(self, row: dict, output: list[dict]) -> Score:
        target = self.target_circle(row)
        x, y, found = parse_click(output)
        hit = False
        if x is not None and y is not None and target is not None:
            try:
                hit = math.sqrt((x - target["x"]) ** 2 + (y - target["y"]) ** 2) <= target["radius"]
            except OverflowError:  # a click astronomically far away
                hit = False
        if hit:
            reason = None
        elif not found:
            reason = "no_click"
        elif x is None or y is None:
            reason = "bad_click_arguments"
        elif target is None:
            reason = "no_target_circle"
        else:
            reason = "miss"
        return Score(1.0 if hit else 0.0, {"clicked_x": x, "clicked_y": y, "hit": hit}, reason)

    def gold_turn(self, row: dict) -> ModelTurn:
        target = self.target_circle(row)
        if target is None:
            raise GymvError(f"{self.name}: the row has no circle of its target color, so no gold click exists",
                            fix="give the row a circle of its target_color (gymv prepare circle-click makes such rows)")
        args = json.dumps({"x": int(target["x"]), "y": int(target["y"])})
        return ModelTurn(tool_calls=[ToolCall("click", args, call_id="call_gold")])

    def matches(self, row: dict) -> bool:
        return super().matches(row) and any(t.get("name") == "click" for t in row_tools(row) if isinstance(t, dict))
