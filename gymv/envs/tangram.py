"""tangram: one question, with a checkable answer, about a picture made of colored tangram pieces.

A picture is either the classic square assembled from all seven pieces (turned and possibly mirrored)
or a few pieces laid out apart at one common scale, each turned by a multiple of 45 degrees. Pieces are
colored from the palette (colors may repeat). The question is one of:

- `count_color`: how many pieces have a given color? (a number)
- `count_triangles`: how many of the pieces are triangles? (a number)
- `color_of`: what color is a given piece? (asked only about a piece that appears once)
- `piece_of`: which piece has a given color? (asked only about a color one piece has)

Reward: the first `\\boxed{...}` in the assistant text, lower-cased with spaces collapsed and a leading
"the"/"a"/"an" and trailing punctuation dropped, equals `expected_answer` -> 1.0, else 0.0 (numbers compare
as integers, so `\\boxed{03}` is 3).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from gymv.envs import sampling
from gymv.envs.circles import COLORS
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, ModelTurn, RowError, Score
from gymv.envs.rows import answer_int, output_text
from gymv.envs.shapes import Canvas, centroid, check_names, transform
from gymv.errors import GymvError

# The seven pieces of the classic square (side 4): two large, one medium and two small right triangles,
# a square and a parallelogram; together they tile the square exactly.
PIECES: list[tuple[str, list[tuple[float, float]]]] = [
    ("large triangle", [(0, 0), (2, 2), (0, 4)]),
    ("large triangle", [(0, 4), (2, 2), (4, 4)]),
    ("medium triangle", [(2, 0), (4, 0), (4, 2)]),
    ("parallelogram", [(0, 0), (2, 0), (3, 1), (1, 1)]),
    ("square", [(2, 2), (3, 1), (4, 2), (3, 3)]),
    ("small triangle", [(1, 1), (3, 1), (2, 2)]),
    ("small triangle", [(3, 3), (4, 2), (4, 4)]),
]
PIECE_NAMES = ("large triangle", "medium triangle", "small triangle", "square", "parallelogram")
QUESTIONS: dict[str, str] = {
    "count_color": "How many {color} pieces are in the picture?",
    "count_triangles": "How many of the pieces are triangles?",
    "color_of": "What color is the {piece}?",
    "piece_of": "Which piece is {color}? Answer with its name, such as small triangle or square.",
}
LAYOUTS = ("square", "scattered")
DEFAULT_SYSTEM_PROMPT = (
    "The picture is made of tangram pieces: large, medium and small triangles, a square and a "
    "parallelogram. Answer the question about it with a single word or number inside \\boxed{}, for "
    "example \\boxed{3} or \\boxed{red}."
)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ARTICLE = re.compile(r"^(?:the|a|an)\s+")


@dataclass(frozen=True)
class TangramKnobs:
    image_size: tuple[int, int] = knob((512, 512), "side of the square picture in pixels, lo:hi per row")
    layouts: tuple[str, ...] = knob(LAYOUTS, "layouts to draw from: square (all seven assembled), scattered")
    pieces: tuple[int, int] = knob((3, 7), "pieces in a scattered picture, lo:hi (1 to 7)")
    colors: tuple[int, int] = knob((2, 4), "distinct colors per picture, lo:hi (at most the piece count)")
    palette: tuple[str, ...] = knob(tuple(COLORS), "colors to draw from")
    questions: tuple[str, ...] = knob(tuple(QUESTIONS), "question kinds to draw from")
    outline: bool = knob(True, "draw a dark edge around each piece, so touching pieces of one color stay apart")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    suffix: str = knob("", "text appended to every question")


TINY = TangramKnobs(
    image_size=(56, 56), layouts=("scattered",), pieces=(1, 3), colors=(1, 2), palette=("red", "green", "blue"),
    questions=("count_color", "color_of"), outline=False, system_prompt="", suffix=" Answer in \\boxed{}.",
)


def _reach() -> float:
    """The farthest any piece's corner lies from its centroid (a large triangle's acute corners)."""
    far = 0.0
    for _, pts in PIECES:
        cx, cy = centroid(pts)
        far = max(far, *(math.hypot(x - cx, y - cy) for x, y in pts))
    return far


_REACH = _reach()


def normalize_answer(text: str) -> str:
    text = " ".join(text.strip().lower().split()).strip(" .!?,;:'\"")
    text = _ARTICLE.sub("", text)
    number = answer_int(text) if text.isdigit() else None
    return text if number is None else str(number)


def _scattered(rng: random.Random, count: int, size: int) -> list[tuple[str, list[tuple[float, float]]]]:
    """`count` distinct pieces of the set, each turned by k*45 degrees, in its own cell of a grid."""
    chosen = sampling.sample(rng, list(range(len(PIECES))), count)
    cols = math.ceil(math.sqrt(count))
    rows = math.ceil(count / cols)
    cell = size / max(cols, rows)
    scale = cell / (2 * _REACH * 1.1)  # any piece, turned any way, fits its cell with a margin
    slots = sampling.sample(rng, list(range(cols * rows)), count)
    out = []
    for k, slot in zip(chosen, slots):
        name, pts = PIECES[k]
        cx, cy = centroid(pts)
        local = [(x - cx, y - cy) for x, y in pts]
        angle = 45.0 * sampling.randint(rng, 0, 7)
        ox = (slot % cols + 0.5) * cell + (size - cols * cell) / 2
        oy = (slot // cols + 0.5) * cell + (size - rows * cell) / 2
        out.append((name, transform(local, angle=angle, scale=scale, dx=ox, dy=oy)))
    return out


def _square(rng: random.Random, size: int) -> list[tuple[str, list[tuple[float, float]]]]:
    """All seven pieces as the classic square, turned by k*90 degrees and mirrored half of the time."""
    angle = 90.0 * sampling.randint(rng, 0, 3)
    mirror = rng.random() < 0.5
    margin = size * 0.08
    scale = (size - 2 * margin) / 4
    return [(name, transform([(x - 2, y - 2) for x, y in pts], angle=angle, scale=scale, mirror=mirror,
                             dx=size / 2, dy=size / 2)) for name, pts in PIECES]


def _question(rng: random.Random, kinds: tuple[str, ...], pieces: list[dict]) -> tuple[str, str, dict]:
    """(kind, expected answer, placeholder values) of a question the picture can answer."""
    names = [p["piece"] for p in pieces]
    colors = [p["color"] for p in pieces]
    options = []
    for kind in kinds:
        if kind == "color_of":
            options += [(kind, p["color"], {"piece": p["piece"]}) for p in pieces if names.count(p["piece"]) == 1]
        elif kind == "piece_of":
            options += [(kind, p["piece"], {"color": p["color"]}) for p in pieces if colors.count(p["color"]) == 1]
        elif kind == "count_color":
            options += [(kind, str(colors.count(c)), {"color": c}) for c in dict.fromkeys(colors)]
        else:
            options.append((kind, str(sum("triangle" in n for n in names)), {}))
    if not options:  # no piece or color is unique here: counting a color is always answerable
        options = [("count_color", str(colors.count(c)), {"color": c}) for c in dict.fromkeys(colors)]
    return sampling.choice(rng, options)


class Tangram(Environment):
    name = "tangram"
    agent_name = "tangram_agent"
    description = "answer a question about a picture of colored tangram pieces; answer \\boxed{...}"
    verifier_fields = ("pieces", "expected_answer")
    Knobs = TangramKnobs
    presets = {"default": TangramKnobs(), "tiny": TINY}

    def check_knobs(self, knobs: TangramKnobs) -> None:
        check_names(self.name, "layouts", knobs.layouts, LAYOUTS)
        check_names(self.name, "palette", knobs.palette, COLORS)
        check_names(self.name, "questions", knobs.questions, QUESTIONS)
        (smin, smax), (plo, phi), (clo, chi) = knobs.image_size, knobs.pieces, knobs.colors
        if smin < 16 or smax > 4096:
            raise GymvError(f"{self.name}: image_size {smin}:{smax} must lie within 16:4096",
                            fix="set image_size within 16:4096")
        if plo < 1 or phi > len(PIECES):
            raise GymvError(f"{self.name}: pieces {plo}:{phi} must lie within 1:{len(PIECES)}",
                            fix="set pieces within that range")
        if clo < 1 or chi > len(knobs.palette):
            raise GymvError(f"{self.name}: colors {clo}:{chi} must lie within 1:{len(knobs.palette)} (the palette)",
                            fix="lower colors or add palette colors")

    def make_row(self, rng: random.Random, knobs: TangramKnobs, index: int) -> dict:
        size = sampling.randint(rng, *knobs.image_size)
        layout = sampling.choice(rng, knobs.layouts)
        placed = _square(rng, size) if layout == "square" else \
            _scattered(rng, sampling.randint(rng, *knobs.pieces), size)
        n_colors = min(sampling.randint(rng, *knobs.colors), len(placed))
        chosen = sampling.sample(rng, knobs.palette, n_colors)
        # Every chosen color is used at least once, the rest of the pieces draw freely among them.
        colors = chosen + [sampling.choice(rng, chosen) for _ in range(len(placed) - n_colors)]
        colors = sampling.sample(rng, colors, len(colors))
        pieces = [{"piece": name, "color": c, "points": [[round(x, 2), round(y, 2)] for x, y in pts]}
                  for (name, pts), c in zip(placed, colors)]
        kind, answer, values = _question(rng, knobs.questions, pieces)
        text = QUESTIONS[kind].format(**values) + knobs.suffix
        canvas = Canvas(size)
        edge = max(1, size // 160)
        for p in pieces:
            canvas.polygon([tuple(pt) for pt in p["points"]], p["color"],
                           outline=(40, 40, 40) if knobs.outline else None, width=edge)
        messages: list[dict] = [{"role": "system", "content": knobs.system_prompt}] if knobs.system_prompt else []
        messages.append({"role": "user", "content": [
            {"type": "input_image", "image_url": canvas.data_url(), "detail": "auto"},
            {"type": "input_text", "text": text},
        ]})
        return {
            "responses_create_params": {"input": messages},
            "pieces": pieces,
            "layout": layout,
            "question_kind": kind,
            "expected_answer": answer,
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        if not isinstance(row["expected_answer"], str) or not row["expected_answer"].strip():
            raise RowError("verifier field 'expected_answer' must be a non-empty string", where=where,
                           fix="write the expected answer as a non-empty string")
        if not isinstance(row["pieces"], list):
            raise RowError("verifier field 'pieces' must be a list", where=where,
                           fix="write pieces as gymv prepare tangram does")
        return row

    def score_output(self, row: dict, output: list[dict]) -> Score:
        self.check_row(row)
        expected = normalize_answer(row["expected_answer"])
        match = BOXED.search(output_text(output))
        given = normalize_answer(match.group(1)) if match else None
        correct = given == expected
        reason = None if correct else ("no_boxed_answer" if given is None else "wrong_answer")
        return Score(1.0 if correct else 0.0, {"answer": given, "expected": expected, "correct": correct}, reason)

    def gold_turn(self, row: dict) -> ModelTurn:
        return ModelTurn(text=f"\\boxed{{{row['expected_answer']}}}")
