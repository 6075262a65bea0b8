"""scripted: a picture, a first question, then scripted follow-up questions the user asks after each answer.

Rows follow NeMo Gym's example_multi_turn_gymnasium: `follow_ups` (the user's next messages, one after
each model turn) and `expected_answer`. The episode is one model turn per question: after model turn k
the k-th follow-up is added as a user message; the model's answer to the last follow-up ends it. The
name `example-multi-turn-gymnasium` (NeMo Gym's environment) resolves to this environment, and rows carry
NeMo Gym's agent name, so NeMo Gym's own rows and rollouts run and re-score here unchanged.

gymv's generator draws a row of distinct colored polygons, left to right. The questions walk along
them: the first asks for the shape at a position, then they alternate "what color is it?" and "what
shape is just right of it?", so each follow-up refers to what the previous question was about.

Reward (NeMo Gym's rule): 1.0 when `expected_answer` appears, case-insensitively, in the text of the
model's final turn — the answer after the last follow-up — else 0.0. An episode that ended before every
follow-up was asked and answered earns 0.0 (NeMo Gym never grades an unfinished episode).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gymv.envs import sampling
from gymv.envs.circles import COLORS
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, EpisodeState, Message, ModelTurn, RowError, Score, Text, ToolResult
from gymv.envs.shapes import ORDINALS, POLYGONS, Canvas, check_names, regular_polygon
from gymv.envs.transcript import final_turn_text, model_turns, user_messages
from gymv.errors import GymvError

DEFAULT_SYSTEM_PROMPT = "Answer each question about the picture briefly, in a few words."
FIRST_QUESTION = "Counting from the left, what shape is the {ordinal} one?"
COLOR_QUESTION = "What color is it?"
NEXT_QUESTION = "What shape is just to its right?"


@dataclass(frozen=True)
class ScriptedKnobs:
    image_size: tuple[int, int] = knob((512, 512), "width of the picture in pixels (its height is half), lo:hi")
    shapes: tuple[int, int] = knob((3, 5), "polygons in the row, lo:hi (distinct shapes and colors)")
    follow_ups: tuple[int, int] = knob((1, 3), "scripted follow-up questions after the first, lo:hi")
    shape_names: tuple[str, ...] = knob(tuple(POLYGONS), "polygon shapes to draw from")
    palette: tuple[str, ...] = knob(tuple(COLORS), "colors to draw from")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")


TINY = ScriptedKnobs(image_size=(56, 56), shapes=(2, 2), follow_ups=(1, 1),
                     shape_names=("triangle", "square", "hexagon"), palette=("red", "green", "blue"),
                     system_prompt="")


def _render(width: int, shapes: list[dict]) -> str:
    height = max(8, width // 2)
    canvas = Canvas(width, height)
    slot = width / len(shapes)
    radius = min(slot, height) * 0.38
    for k, s in enumerate(shapes):
        canvas.polygon(regular_polygon((k + 0.5) * slot, height / 2, radius, POLYGONS[s["shape"]]), s["color"])
    return canvas.data_url()


class Scripted(Environment):
    name = "scripted"
    agent_name = "example_multi_turn_gymnasium_agent"
    description = "a picture, then scripted follow-ups; alias example-multi-turn-gymnasium (NeMo Gym's rule)"
    verifier_fields = ("follow_ups", "expected_answer")
    max_turns = 5  # NeMo Gym's max_steps for this environment
    Knobs = ScriptedKnobs
    presets = {"default": ScriptedKnobs(), "tiny": TINY}

    # -- episode -------------------------------------------------------------------------------------
    def follow_up(self, state: EpisodeState, turn: ModelTurn, results: list[ToolResult]) -> list[Message]:
        asked = state.data.get("asked", 0)
        follow_ups = state.row["follow_ups"]
        if asked >= len(follow_ups):
            return []
        state.data["asked"] = asked + 1
        return [Message("user", [Text(follow_ups[asked])])]

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        follow_ups = row["follow_ups"]
        if not isinstance(follow_ups, list) or not all(isinstance(f, str) for f in follow_ups):
            raise RowError("verifier field 'follow_ups' must be a list of strings", where=where,
                           fix="write follow_ups as a list of strings")
        if not isinstance(row["expected_answer"], str) or not row["expected_answer"]:
            raise RowError("verifier field 'expected_answer' must be a non-empty string", where=where,
                           fix="write the expected answer as a non-empty string")
        return row

    # -- data ----------------------------------------------------------------------------------------
    def check_knobs(self, knobs: ScriptedKnobs) -> None:
        check_names(self.name, "shape_names", knobs.shape_names, POLYGONS)
        check_names(self.name, "palette", knobs.palette, COLORS)
        (slo, shi), (flo, fhi) = knobs.shapes, knobs.follow_ups
        most = min(len(knobs.shape_names), len(knobs.palette), len(ORDINALS))
        if slo < 1 or shi > most:
            raise GymvError(f"{self.name}: shapes {slo}:{shi} must lie within 1:{most} (distinct shapes and colors)",
                            fix="lower shapes or add shape_names and palette colors")
        if flo < 0 or fhi // 2 > slo - 1:
            raise GymvError(f"{self.name}: {fhi} follow-ups walk {fhi // 2} polygons to the right, which a row of "
                            f"{slo} polygons cannot always do", fix=f"use follow_ups up to {2 * (slo - 1) + 1}")
        if knobs.image_size[0] < 16 or knobs.image_size[1] > 4096:
            raise GymvError(f"{self.name}: image_size must lie within 16:4096", fix="set image_size within 16:4096")

    def make_row(self, rng: random.Random, knobs: ScriptedKnobs, index: int) -> dict:
        width = sampling.randint(rng, *knobs.image_size)
        n = sampling.randint(rng, *knobs.shapes)
        f = sampling.randint(rng, *knobs.follow_ups)
        shapes = [{"shape": s, "color": c} for s, c in zip(sampling.sample(rng, knobs.shape_names, n),
                                                           sampling.sample(rng, knobs.palette, n))]
        start = sampling.randint(rng, 0, n - 1 - f // 2)
        questions, answers = [], []
        for j in range(f + 1):
            target = shapes[start + j // 2]
            if j == 0:
                questions.append(FIRST_QUESTION.format(ordinal=ORDINALS[start]))
            else:
                questions.append(COLOR_QUESTION if j % 2 else NEXT_QUESTION)
            answers.append(target["color"] if j % 2 else target["shape"])
        messages: list[dict] = [{"role": "system", "content": knobs.system_prompt}] if knobs.system_prompt else []
        messages.append({"role": "user", "content": [
            {"type": "input_image", "image_url": _render(width, shapes), "detail": "auto"},
            {"type": "input_text", "text": questions[0]},
        ]})
        return {
            "responses_create_params": {"input": messages},
            "follow_ups": questions[1:],
            "expected_answer": answers[-1],
            "answers": answers,
            "shapes": shapes,
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    # -- scoring -------------------------------------------------------------------------------------
    def score_output(self, row: dict, output: list[dict]) -> Score:
        self.check_row(row)
        expected = row["expected_answer"]
        asked = len(user_messages(output))
        answered = len(model_turns(output))
        finished = asked >= len(row["follow_ups"]) and answered > asked
        text = final_turn_text(output)
        found = finished and expected.lower() in text.lower()
        reason = None if found else ("unfinished" if not finished else "answer_not_found")
        return Score(1.0 if found else 0.0, {"follow_ups_asked": asked, "turns_answered": answered}, reason)

    def gold_turns(self, row: dict) -> list[ModelTurn]:
        answers = row.get("answers")
        if not isinstance(answers, list) or len(answers) != len(row.get("follow_ups", [])) + 1:
            raise GymvError(f"{self.name}: the row has no 'answers' (one per question), so it has no gold episode",
                            fix="generate rows with `gymv prepare scripted`")
        return [ModelTurn(text=str(a)) for a in answers]

    def gold_turn(self, row: dict) -> ModelTurn:
        """The answer to the first question; the whole episode is `gold_turns`."""
        return self.gold_turns(row)[0]
