"""doorkey: walk a grid world with the `move` tool — fetch the key, unlock the door, reach the goal.

The prompt shows the world from above (gray walls, the red agent, the yellow key, the blue locked door,
the green goal); every `move(direction)` call answers with a sentence saying what happened and a new
picture of the world, so the model sees the world again after each move.

Reward: 1.0 when the agent stands on the goal at the end of the episode, else 0.0. The verifier replays
the transcript's `move` calls in order from the row's `grid` under the same rules the tool applies
(calls whose arguments the tool would refuse move nothing), so an in-process episode, an HTTP
`/verify` and a recorded rollout score alike. The episode ends when the goal is reached, when the model
answers without a tool call, or after `max_turns` model turns (the episode's move budget).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from gymv.envs import sampling
from gymv.envs.gridworld import AGENT, DIRECTIONS, DOOR, EVENTS, FLOOR, GOAL, KEY, WALL, GridError, World
from gymv.envs.knobs import knob
from gymv.envs.protocol import (Environment, EpisodeState, Image, ModelTurn, RowError, Score, Tool, ToolCall,
                                ToolCallError, ToolOutput, ToolResult)
from gymv.envs.schema import SchemaError, validate_arguments
from gymv.envs.transcript import model_turns
from gymv.errors import GymvError

DEFAULT_SYSTEM_PROMPT = (
    "You control the red disc in a grid world seen from above. Gray cells are walls. Step onto the yellow "
    "key to pick it up; walking into the blue door while you hold the key unlocks it. Your goal is the "
    "green cell. Use the move tool to go one cell up, down, left or right; each move shows you the world "
    "again."
)
DEFAULT_QUESTION = "Reach the green cell."
MOVE_DESCRIPTION = "Move the agent one cell in a direction and see the world afterwards."
MOVE_PARAMETERS = {
    "type": "object",
    "properties": {"direction": {"type": "string", "enum": list(DIRECTIONS),
                                 "description": "up, down, left or right"}},
    "required": ["direction"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class DoorKeyKnobs:
    grid: tuple[int, int] = knob((8, 8), "side of the square grid in cells, walls included, lo:hi (at least 5)")
    image_size: int = knob(512, "side of the picture in pixels")
    mirror: bool = knob(True, "put the start side on the left or the right at random")
    transpose: bool = knob(True, "make the dividing wall horizontal half of the time")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    question: str = knob(DEFAULT_QUESTION, "the user's request under the first picture")


TINY = DoorKeyKnobs(grid=(5, 5), image_size=56, transpose=False, system_prompt="",
                    question="Get the key, open the door, reach green.")


def _moves(output: list) -> list[str]:
    """The directions of the transcript's `move` calls that the tool would accept, in order."""
    found = []
    for turn in model_turns(output):
        for item in turn:
            if item.get("type") != "function_call" or item.get("name") != "move":
                continue
            raw = item.get("arguments")
            try:
                args = validate_arguments(json.loads(raw) if isinstance(raw, str) else raw, MOVE_PARAMETERS)
            except (ValueError, RecursionError, SchemaError):  # json errors are ValueErrors
                continue
            found.append(args["direction"])
    return found


class DoorKey(Environment):
    name = "doorkey"
    agent_name = "doorkey_agent"
    description = "grid world: pick up the key, unlock the door, reach the goal with move(direction)"
    verifier_fields = ("grid",)
    max_turns = 24
    Knobs = DoorKeyKnobs
    presets = {"default": DoorKeyKnobs(), "tiny": TINY}

    def tool_specs(self) -> list[Tool]:
        return [Tool("move", MOVE_DESCRIPTION, MOVE_PARAMETERS, self._move)]

    def _move(self, state: EpisodeState | None, args: dict) -> ToolOutput:
        if state is None:
            raise ToolCallError("move needs an episode: start the session with the row "
                                "(POST /seed_session or /reset with it)", status=409)
        world: World = state.data["world"]
        event = world.move(args["direction"])
        text = EVENTS[event].format(direction=args["direction"])
        return ToolOutput(text, [Image(world.render(self._image_size(state.row)))])

    @staticmethod
    def _image_size(row: dict) -> int:
        size = row.get("image_size")
        return size if isinstance(size, int) and not isinstance(size, bool) and 8 <= size <= 4096 else 256

    # -- episode -------------------------------------------------------------------------------------
    def start(self, row: dict, *, where: str | None = None) -> EpisodeState:
        state = super().start(row, where=where)
        state.data["world"] = World.parse(row["grid"])
        return state

    def is_done(self, state: EpisodeState, turn: ModelTurn, results: list[ToolResult], follow_ups: list) -> bool:
        return state.data["world"].at_goal or super().is_done(state, turn, results, follow_ups)

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        try:
            world = World.parse(row["grid"])
        except GridError as e:
            raise RowError(str(e), where=where, fix="generate rows with `gymv prepare doorkey`") from None
        if world.shortest_path() is None:
            raise RowError("the grid's goal cannot be reached", where=where,
                           fix="make a grid whose goal is reachable (gymv prepare doorkey makes such rows)")
        return row

    # -- data ----------------------------------------------------------------------------------------
    def check_knobs(self, knobs: DoorKeyKnobs) -> None:
        lo, hi = knobs.grid
        if lo < 5 or hi > 32:
            raise GymvError(f"{self.name}: grid {lo}:{hi} must lie within 5:32", fix="e.g. grid=5 or grid=8")
        if knobs.image_size < hi or knobs.image_size > 4096:
            raise GymvError(f"{self.name}: image_size {knobs.image_size} must give each of {hi} cells a pixel "
                            "and be at most 4096", fix=f"use image_size of at least {hi}")

    def make_row(self, rng: random.Random, knobs: DoorKeyKnobs, index: int) -> dict:
        n = sampling.randint(rng, *knobs.grid)
        wall = sampling.randint(rng, 2, n - 3)
        door = sampling.randint(rng, 1, n - 2)
        start_side = [(x, y) for x in range(1, wall) for y in range(1, n - 1)]
        far_side = [(x, y) for x in range(wall + 1, n - 1) for y in range(1, n - 1)]
        agent, key = sampling.sample(rng, start_side, 2)
        goal = sampling.choice(rng, far_side)
        cells = [[WALL if x in (0, n - 1) or y in (0, n - 1) or x == wall else FLOOR for x in range(n)]
                 for y in range(n)]
        for (x, y), c in ((agent, AGENT), (key, KEY), ((wall, door), DOOR), (goal, GOAL)):
            cells[y][x] = c
        if knobs.mirror and rng.random() < 0.5:
            cells = [row[::-1] for row in cells]
        if knobs.transpose and rng.random() < 0.5:
            cells = [list(col) for col in zip(*cells)]
        grid = ["".join(r) for r in cells]
        world = World.parse(grid)
        messages: list[dict] = [{"role": "system", "content": knobs.system_prompt}] if knobs.system_prompt else []
        messages.append({"role": "user", "content": [
            {"type": "input_image", "image_url": world.render(knobs.image_size), "detail": "auto"},
            {"type": "input_text", "text": knobs.question},
        ]})
        return {
            "responses_create_params": {"input": messages, "tools": self.tools()},
            "grid": grid,
            "image_size": knobs.image_size,
            "optimal_moves": len(world.shortest_path() or []),
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    # -- scoring -------------------------------------------------------------------------------------
    def score_output(self, row: dict, output: list[dict]) -> Score:
        try:
            world = World.parse(row.get("grid"))
        except GridError as e:
            raise RowError(str(e), fix="write the grid as gymv prepare doorkey does") from None
        moves = _moves(output)
        for d in moves:
            world.move(d)
            if world.at_goal:
                break
        extras = {"reached_goal": world.at_goal, "moves": world.moves, "has_key": world.has_key,
                  "door_open": world.door_open}
        reason = None if world.at_goal else ("no_moves" if not moves else "goal_not_reached")
        return Score(1.0 if world.at_goal else 0.0, extras, reason)

    def gold_turns(self, row: dict) -> list[ModelTurn]:
        path = World.parse(row["grid"]).shortest_path()
        if path is None:
            raise GymvError(f"{self.name}: the row's goal cannot be reached, so it has no gold episode",
                            fix="make a grid whose goal is reachable (gymv prepare doorkey makes such rows)")
        return [ModelTurn(tool_calls=[ToolCall("move", json.dumps({"direction": d}), call_id=f"call_gold_{i}")])
                for i, d in enumerate(path)]

    def gold_turn(self, row: dict) -> ModelTurn:
        """The first gold move; the whole episode is `gold_turns`."""
        return self.gold_turns(row)[0]
