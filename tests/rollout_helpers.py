"""Shared pieces of the rollout tests: real tiny-model rows, a recording backend and a scripted policy.

A randomly initialised tiny model never writes a tool call, so the multi-turn tests need a policy that
says given lines. `ScriptedBackend` is a real GenerationBackend: it emits the tokenizer's ids of a scripted
reply and reports the real model's logprobs of those tokens (teacher forcing), after the same placeholder
check every backend does. The loop under test cannot tell it from a sampler that happened to say that.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import torch

from gymv.backends.generation.base import GenerationBackend, GenerationOutput, GenerationRequest, SamplingParams
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.envs import get_env
from gymv.envs.protocol import Environment, Image, Message, ModelTurn, Score, Text, Tool, ToolOutput
from tiny_models import solid


def tiny_rows(env_name: str, n: int, *, seed: int = 0, **env_kwargs) -> tuple[object, list[tuple[int, dict]]]:
    """(env, [(index, row)]) of the env's `tiny` preset, made by the same engine call `gymv prepare` uses."""
    env = get_env(env_name, **env_kwargs)
    knobs = env.presets["tiny"]
    return env, [(i, env.make_row(random.Random(seed + i), knobs, i)) for i in range(n)]


def turn_of(where: str) -> int:
    return int(re.search(r"turn (\d+)", where).group(1))


def sample_of(where: str) -> int:
    m = re.search(r"sample (\d+)", where)
    return int(m.group(1)) if m else 0


class RecordingBackend(GenerationBackend):
    """Passes every call to a real backend and keeps the requests and outputs it saw."""

    def __init__(self, inner: GenerationBackend):
        self.inner = inner
        self.calls: list[tuple[list[GenerationRequest], list[GenerationOutput]]] = []

    def generate(self, requests, params):
        outs = self.inner.generate(requests, params)
        self.calls.append(([GenerationRequest(list(r.prompt_token_ids), list(r.images), r.where) for r in requests],
                           outs))
        return outs

    def update_weights(self, state_dict):
        self.inner.update_weights(state_dict)

    def reset_encoder_cache(self):
        self.inner.reset_encoder_cache()

    def stats(self):
        return self.inner.stats()

    def history(self, where_prefix: str) -> list[tuple[GenerationRequest, GenerationOutput]]:
        """(request, output) of one episode, turn by turn (its `where` starts with `where_prefix`)."""
        return [(r, o) for reqs, outs in self.calls for r, o in zip(reqs, outs) if r.where.startswith(where_prefix + ",")]


class ScriptedBackend(RecordingBackend):
    """Says `reply(where)` (tokenized as written; include <|im_end|> to end the turn) with real logprobs."""

    def __init__(self, policy, reply: Callable[[str], str]):
        self.policy, self.reply = policy, reply
        self.calls = []

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        tok, adapter = self.policy.tokenizer, self.policy.adapter
        outs = []
        for r in requests:
            adapter.check(r.prompt_token_ids, r.images, where=r.where)
            ids = tok.encode(self.reply(r.where), add_special_tokens=False)
            finish = "length" if len(ids) > params.max_new_tokens else "stop"
            ids = ids[:params.max_new_tokens]
            seq = list(r.prompt_token_ids) + ids
            with torch.no_grad():
                lp = sequence_logprobs(self.policy.model, adapter, right_pad([seq], [list(r.images)], 0, [r.where]),
                                       temperature=params.temperature)[0]
            n = len(r.prompt_token_ids)
            outs.append(GenerationOutput(ids, lp[n:n + len(ids)].tolist(), tok.decode(ids, skip_special_tokens=True),
                                         finish, ids[-1] if finish == "stop" and ids else None))
        self.calls.append(([GenerationRequest(list(r.prompt_token_ids), list(r.images), r.where) for r in requests],
                           outs))
        return outs

    def update_weights(self, state_dict):
        self.policy.model.load_state_dict(state_dict, strict=False)

    def reset_encoder_cache(self):
        pass  # nothing cached: logprobs are computed from scratch each call

    def stats(self):
        return {}


GREEN, RED, BLUE = (0, 200, 0), (220, 0, 0), (0, 0, 230)
LOOK = '<tool_call>{"name": "look", "arguments": {}}</tool_call><|im_end|>'


class PictureEnv(Environment):
    """Turn 1 looks (tool answers with a red image), turn 2 answers (a follow-up shows a blue image)."""

    name = "picture-test"
    agent_name = "picture_test_agent"
    max_turns = 3

    def tool_specs(self):
        return [Tool("look", "Look closer.", {"type": "object", "properties": {}}, self._look),
                Tool("explode", "Crashes.", {"type": "object", "properties": {}}, self._explode)]

    @staticmethod
    def _look(state, args):
        return ToolOutput("here", [Image.from_pil(solid(RED, (40, 30)))])

    @staticmethod
    def _explode(state, args):
        raise RuntimeError("tool backend went away")

    def follow_up(self, state, turn, results):
        if state.turns == 2:
            return [Message("user", [Text("And this?"), Image.from_pil(solid(BLUE, (30, 40)))])]
        return []

    def score_output(self, row, output):
        from gymv.envs.rows import output_text

        ok = "blue" in output_text(output)
        return Score(1.0 if ok else 0.0, {"said_blue": ok}, None if ok else "no_blue")

    def gold_turn(self, row):
        return ModelTurn(text="blue")


def picture_row():
    return {"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": Image.from_pil(solid(GREEN)).url, "detail": "auto"},
        {"type": "input_text", "text": "What colors?"}]}]},
        "agent_ref": {"type": "responses_api_agents", "name": "picture_test_agent"}}


def script(where: str) -> str:
    return {0: LOOK, 1: "Red.<|im_end|>", 2: "blue<|im_end|>"}[turn_of(where)]


class TurnsEnv(Environment):
    """An episode lasts the row's `turns` model turns, whatever the model says: after each turn but the last a
    scripted user follow-up asks it to go on (at turn 2 with an image). Rows with `crash_at` make the
    environment's step fail at that turn."""

    name = "turns-test"
    agent_name = "turns_test_agent"
    max_turns = 8

    def step(self, state, turn):
        if state.row.get("crash_at") == state.turns:
            raise RuntimeError("environment server went away")
        return super().step(state, turn)

    def follow_up(self, state, turn, results):
        if state.turns >= state.row["turns"]:
            return []
        if state.turns == 2:
            return [Message("user", [Text("And this one?"), Image.from_pil(solid(BLUE, (30, 40)))])]
        return [Message("user", [Text(f"Go on ({state.turns}).")])]

    def score_output(self, row, output):
        return Score(float(sum(1 for item in output if item.get("type") == "message")), {}, None)

    def gold_turn(self, row):
        return ModelTurn(text="ok")


def turns_row(text: str, turns: int, **extra) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": text}]}]},
        "agent_ref": {"type": "responses_api_agents", "name": "turns_test_agent"}, "turns": turns, **extra}
