"""circle-count: how many circles of one color are in the image? Answer `\\boxed{N}`.

Reward (NeMo Gym's rule): the first `\\boxed{<digits>}` in the concatenated assistant output text equals the
number of circles whose color is `target_color` -> 1.0, else 0.0. Default knobs are NeMo Gym's generator
defaults; the `tiny` preset is a task a tiny VLM on a CPU can learn.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from gymv.envs import circles as C
from gymv.envs import sampling
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, ModelTurn, Score
from gymv.envs.rows import answer_int, output_text, row_tools
from gymv.errors import GymvError

# gymv's own wording; the task, the answer format and the reward rule are NeMo Gym's.
DEFAULT_SYSTEM_PROMPT = (
    "Look at the picture and count only the circles that have the color named by the user. "
    "Write the count as a whole number inside \\boxed{}, for example \\boxed{4}."
)
DEFAULT_QUESTION = "Count the {color} circles in this picture."
BOXED = re.compile(r"\\boxed\{(\d+)\}")


@dataclass(frozen=True)
class CircleCountKnobs:
    image_size: tuple[int, int] = knob((1000, 1000), "side of the square image in pixels, drawn per row from lo:hi")
    radius: tuple[int, int] = knob((30, 60), "circle radius in pixels (one radius per image), lo:hi")
    circles: tuple[int, int] = knob((5, 20), "number of circles drawn, lo:hi (a circle with no free spot is left out)")
    colors: tuple[int, int] = knob((2, 4), "number of distinct colors per image, lo:hi")
    palette: tuple[str, ...] = knob(tuple(C.COLORS), "colors to draw from")
    overlap: bool = knob(False, "allow circles to overlap (false: keep min_gap pixels between them)")
    min_gap: int = knob(15, "pixels between two circles when overlap is false")
    edge_margin: int = knob(10, "pixels between a circle and the image edge")
    max_tries: int = knob(500, "placement attempts per circle")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    question: str = knob(DEFAULT_QUESTION, "user question; {color} is the target color")


TINY = CircleCountKnobs(
    image_size=(56, 56), radius=(7, 7), circles=(1, 3), colors=(1, 1), min_gap=2, edge_margin=1,
    system_prompt="", question="How many {color} circles?",
)


class CircleCount(Environment):
    name = "circle-count"
    agent_name = "circle_count_simple_agent"
    description = "count the circles of a given color; answer \\boxed{N}"
    verifier_fields = ("circles", "target_color")
    Knobs = CircleCountKnobs
    presets = {"default": CircleCountKnobs(), "tiny": TINY}

    def check_knobs(self, knobs: CircleCountKnobs) -> None:
        C.check_geometry(knobs, self.name)
        lo, hi = knobs.colors
        if lo < 1 or hi > len(knobs.palette):
            raise GymvError(f"{self.name}: colors {lo}:{hi} must lie within 1:{len(knobs.palette)} (the palette size)",
                            fix="lower colors or add palette colors")

    def make_row(self, rng: random.Random, knobs: CircleCountKnobs, index: int) -> dict:
        size = sampling.randint(rng, *knobs.image_size)
        radius = sampling.randint(rng, *knobs.radius)
        n = sampling.randint(rng, *knobs.circles)
        chosen = sampling.sample(rng, knobs.palette, sampling.randint(rng, *knobs.colors))
        target = sampling.choice(rng, chosen)
        centres = C.place(rng, n, size, radius, edge_margin=knobs.edge_margin, min_gap=knobs.min_gap,
                          overlap=knobs.overlap, max_tries=knobs.max_tries)
        circles = [{"x": x, "y": y, "radius": radius, "color": sampling.choice(rng, chosen)} for x, y in centres]
        messages: list[dict] = []
        if knobs.system_prompt:
            messages.append({"role": "system", "content": knobs.system_prompt})
        messages.append({"role": "user", "content": [
            {"type": "input_image", "image_url": C.render(size, circles), "detail": "auto"},
            {"type": "input_text", "text": C.fill(knobs.question, color=target)},
        ]})
        return {
            "responses_create_params": {"input": messages},
            "circles": circles,
            "target_color": target,
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    def expected_count(self, row: dict, *, where: str | None = None) -> int:
        circles, target = C.row_circles(row, geometry=False, where=where)
        return sum(1 for c in circles if c["color"] == target)

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        C.row_circles(row, geometry=False, where=where)
        return row

    def score_output(self, row: dict, output: list[dict]) -> Score:
        expected = self.expected_count(row)
        match = BOXED.search(output_text(output))
        predicted = answer_int(match.group(1)) if match else None  # None: too long to be any count
        correct = predicted is not None and predicted == expected
        extras = {"predicted_count": predicted, "expected_count": expected, "correct": correct}
        reason = None if correct else ("no_boxed_answer" if match is None else "wrong_count")
        return Score(1.0 if correct else 0.0, extras, reason)

    def gold_turn(self, row: dict) -> ModelTurn:
        return ModelTurn(text=f"\\boxed{{{self.expected_count(row)}}}")

    def matches(self, row: dict) -> bool:
        return super().matches(row) and not any(t.get("name") == "click" for t in row_tools(row) if isinstance(t, dict))
