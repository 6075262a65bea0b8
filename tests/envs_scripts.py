"""Shared pieces of the environment tests: play turns through an environment, write a model's reply text.

A random tiny model never calls tools, so multi-turn tests through the rollout loop script the policy:
`reply_text` writes a ModelTurn as the text a model would generate (`<tool_call>` blocks, then the
end-of-turn token), and `gold_script` answers each (row, turn) with the environment's gold turns.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from gymv.envs.protocol import Environment, EpisodeState, ModelTurn, Score

END = "<|im_end|>"


def reply_text(turn: ModelTurn) -> str:
    calls = "".join(f'<tool_call>{json.dumps({"name": c.name, "arguments": json.loads(c.arguments)})}</tool_call>'
                    for c in turn.tool_calls)
    return f"{turn.text}{calls}{END}"


def play(env: Environment, row: dict, turns: list[ModelTurn]) -> tuple[EpisodeState, Score]:
    """Start an episode, step the turns while it runs, and score it."""
    state = env.start(row)
    for turn in turns:
        if state.done:
            break
        env.step(state, turn)
    return state, env.score(state)


def task_of(where: str) -> int:
    return int(re.search(r"(?:row |line )(\d+)", where).group(1))


def turn_of(where: str) -> int:
    return int(re.search(r"turn (\d+)", where).group(1))


def gold_script(env: Environment, rows: dict[int, dict], *, after: str = f"done{END}") -> Callable[[str], str]:
    """A reply function for ScriptedBackend: row i's gold turn k at turn k, then `after`."""
    golds = {i: env.gold_turns(r) for i, r in rows.items()}

    def reply(where: str) -> str:
        turns = golds[task_of(where)]
        k = turn_of(where)
        return reply_text(turns[k]) if k < len(turns) else after

    return reply


def tiny_rows(env: Environment, n: int, *, seed: int = 0, preset: str = "tiny") -> list[tuple[int, dict]]:
    knobs = env.presets[preset]
    return [(i, env.make_row(random.Random(seed + i), knobs, i)) for i in range(n)]


def dataset(env: Environment, path: Path, *, preset: str = "tiny", n: int = 40, split: str = "train",
            seed: int = 0, workers: int = 1) -> list[str]:
    """Rows written by the same engine call `gymv prepare` makes; returns the file's lines."""
    from gymv.data.generate import write_dataset
    from gymv.envs.knobs import resolve_knobs

    write_dataset(path, env, resolve_knobs(env, preset), n=n, split=split, seed=seed, workers=workers)
    return path.read_text().splitlines()


def prompt_images(row: dict) -> list[str]:
    from gymv.envs.rows import input_messages

    return [im.url for m in input_messages(row) for im in m.images]
