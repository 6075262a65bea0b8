"""The door-and-key grid world: its rules, a shortest solution, and its picture.

A grid is a list of equal-length strings: ``#`` wall, ``.`` floor, ``A`` the agent's start, ``K`` the key,
``D`` the locked door, ``G`` the goal. The agent moves one cell per move. Stepping onto the key picks it
up; walking into the locked door while holding the key unlocks it and steps into the doorway (without the
key the door blocks like a wall); stepping onto the goal ends the episode. Walls block.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

from gymv.envs.shapes import Canvas

WALL, FLOOR, AGENT, KEY, DOOR, GOAL = "#", ".", "A", "K", "D", "G"
DIRECTIONS: dict[str, tuple[int, int]] = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}

# What each move did, and the sentence the move tool answers with.
EVENTS = {
    "moved": "You moved {direction}.",
    "wall": "A wall is in the way; you did not move.",
    "locked": "The door is locked and you have no key; you did not move.",
    "unlocked": "You unlocked the door with the key and stepped into the doorway.",
    "key": "You moved {direction} and picked up the key.",
    "goal": "You reached the goal. Well done!",
    "over": "You are already on the goal; the episode is over.",
}

GRAY, WHITE = (128, 128, 128), (255, 255, 255)
AGENT_COLOR, KEY_COLOR, DOOR_COLOR, GOAL_COLOR = "red", "yellow", "blue", "green"


class GridError(ValueError):
    """A grid that does not describe one door-and-key world."""


@dataclass
class World:
    cells: list[list[str]]  # static cells: wall, floor, door, goal (agent and key are kept apart)
    agent: tuple[int, int]
    key: tuple[int, int] | None
    has_key: bool = False
    door_open: bool = False
    at_goal: bool = False
    moves: int = 0

    @classmethod
    def parse(cls, rows: object) -> "World":
        if not isinstance(rows, list) or not rows or not all(isinstance(r, str) for r in rows):
            raise GridError("'grid' must be a non-empty list of strings")
        width = len(rows[0])
        if width < 3 or any(len(r) != width for r in rows) or len(rows) < 3:
            raise GridError("'grid' rows must all have the same length, at least 3x3")
        found: dict[str, list[tuple[int, int]]] = {c: [] for c in (AGENT, KEY, DOOR, GOAL)}
        cells = []
        for y, r in enumerate(rows):
            line = []
            for x, c in enumerate(r):
                if c not in (WALL, FLOOR, AGENT, KEY, DOOR, GOAL):
                    raise GridError(f"'grid' has an unknown cell {c!r} at row {y}, column {x} (use # . A K D G)")
                if c in found:
                    found[c].append((x, y))
                line.append(c if c in (WALL, DOOR, GOAL) else FLOOR)
            cells.append(line)
        for c, where in found.items():
            if len(where) != 1:
                raise GridError(f"'grid' must hold exactly one {c!r}, found {len(where)}")
        if any(rows[0][x] != WALL or rows[-1][x] != WALL for x in range(width)) or \
                any(r[0] != WALL or r[-1] != WALL for r in rows):
            raise GridError("'grid' must be surrounded by walls")
        return cls(cells, found[AGENT][0], found[KEY][0])

    @property
    def width(self) -> int:
        return len(self.cells[0])

    @property
    def height(self) -> int:
        return len(self.cells)

    def copy(self) -> "World":
        return copy.deepcopy(self)

    def move(self, direction: str) -> str:
        """Apply one move; returns the event name (a key of EVENTS)."""
        if self.at_goal:
            return "over"
        dx, dy = DIRECTIONS[direction]
        x, y = self.agent[0] + dx, self.agent[1] + dy
        cell = self.cells[y][x]
        if cell == WALL:
            return "wall"
        event = "moved"
        if cell == DOOR and not self.door_open:
            if not self.has_key:
                return "locked"
            self.door_open = True
            event = "unlocked"
        self.agent = (x, y)
        self.moves += 1
        if self.key == (x, y):
            self.key, self.has_key = None, True
            event = "key"
        if cell == GOAL:
            self.at_goal = True
            event = "goal"
        return event

    def _state(self) -> tuple:
        return self.agent, self.has_key, self.door_open

    def shortest_path(self) -> list[str] | None:
        """The fewest moves that reach the goal (breadth-first over position, key and door), or None."""
        start = self.copy()
        seen = {start._state()}
        queue: deque[tuple[World, list[str]]] = deque([(start, [])])
        while queue:
            world, path = queue.popleft()
            for d in DIRECTIONS:
                nxt = world.copy()
                if nxt.move(d) in ("wall", "locked"):
                    continue
                if nxt.at_goal:
                    return path + [d]
                if nxt._state() not in seen:
                    seen.add(nxt._state())
                    queue.append((nxt, path + [d]))
        return None

    def render(self, size: int) -> str:
        """A PNG data URL of the world, `size` pixels square (cells are size // side pixels)."""
        side = max(self.width, self.height)
        cell = size // side
        ox, oy = (size - cell * self.width) // 2, (size - cell * self.height) // 2
        canvas = Canvas(size, background=WHITE)
        line = max(1, cell // 6)

        def box(x: int, y: int, inset: float = 0.0) -> tuple[float, float, float, float]:
            m = min(cell * inset, (cell - 1) / 2)  # tiny cells still get a one-pixel mark
            return (ox + x * cell + m, oy + y * cell + m, ox + (x + 1) * cell - 1 - m, oy + (y + 1) * cell - 1 - m)

        for y, row in enumerate(self.cells):
            for x, c in enumerate(row):
                if c == WALL:
                    canvas.rectangle(box(x, y), GRAY)
                elif c == GOAL:
                    canvas.rectangle(box(x, y), GOAL_COLOR)
                elif c == DOOR:
                    if self.door_open:
                        canvas.rectangle(box(x, y), outline=DOOR_COLOR, width=line)
                    else:
                        canvas.rectangle(box(x, y), DOOR_COLOR)
        if self.key is not None:
            canvas.rectangle(box(*self.key, inset=0.3), KEY_COLOR)
        canvas.ellipse(box(*self.agent, inset=0.12), AGENT_COLOR)
        if self.has_key:
            canvas.rectangle(box(*self.agent, inset=0.38), KEY_COLOR)
        return canvas.data_url()
