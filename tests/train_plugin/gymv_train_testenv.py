"""A test environment installed the way a third-party plugin is (a dist-info with a `gymv.envs` entry point),
so Ray workers find it too. Its reward is 1 when the answer's text has even length: a random policy earns
it about half the time, so GRPO groups carry signal from the first step."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gymv.envs.circles import render
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, ModelTurn, Score
from gymv.envs.rows import output_text


@dataclass(frozen=True)
class EvenKnobs:
    image_size: int = knob(28, "side of the prompt image")


class EvenLength(Environment):
    name = "even-length"
    agent_name = "even_length_agent"
    verifier_fields = ("parity",)
    Knobs = EvenKnobs
    presets = {"default": EvenKnobs()}
    description = "answer with a text of even length"

    def make_row(self, rng: random.Random, knobs: EvenKnobs, index: int) -> dict:
        r = knobs.image_size // 4
        x = rng.randint(r, knobs.image_size - r)
        circles = [{"x": x, "y": knobs.image_size // 2, "radius": r, "color": "red"}]
        return {
            "responses_create_params": {"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": render(knobs.image_size, circles), "detail": "auto"},
                {"type": "input_text", "text": "Say something."}]}]},
            "parity": 0,
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    def score_output(self, row: dict, output: list[dict]) -> Score:
        text = output_text(output)
        ok = len(text) % 2 == row["parity"]
        return Score(1.0 if ok else 0.0, {"length": len(text)}, None if ok else "odd_length")

    def gold_turn(self, row: dict) -> ModelTurn:
        return ModelTurn(text="ok")


class EvenLengthText(EvenLength):
    """The same task without the image, for text-only models."""

    name = "even-length-text"
    agent_name = "even_length_text_agent"

    def make_row(self, rng: random.Random, knobs: EvenKnobs, index: int) -> dict:
        row = super().make_row(rng, knobs, index)
        row["responses_create_params"]["input"][0]["content"] = [{"type": "input_text", "text": "Say something."}]
        return row
