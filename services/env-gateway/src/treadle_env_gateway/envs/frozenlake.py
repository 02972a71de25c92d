"""`frozenlake`: a text grid world. S start, F ice, H hole, G goal; move left/right/up/down."""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any

from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option

MAX_SIZE = 12
MAX_TRIES = 1000
"""Boards drawn per task wanted before giving up (unsolvable draws are redrawn)."""
MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
_MOVE = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)


def _solvable(grid: list[str]) -> bool:
    size = len(grid)
    seen, queue = {(0, 0)}, deque([(0, 0)])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and grid[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


@register("frozenlake")
class FrozenLake(Env):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"frozenlake-{split}-{seed}")
        size = option(options, "size", 4, 2, MAX_SIZE)
        holes = option(options, "hole_prob", 0.2, 0.0, 0.5)
        tasks: list[dict] = []
        for _ in range(num_tasks * MAX_TRIES):
            if len(tasks) == num_tasks:
                break
            cells = [
                ["H" if rng.random() < holes else "F" for _ in range(size)] for _ in range(size)
            ]
            cells[0][0], cells[-1][-1] = "S", "G"
            grid = ["".join(row) for row in cells]
            if _solvable(grid):
                tasks.append({"grid": grid, "max_steps": 4 * size})
        if len(tasks) < num_tasks:
            raise EnvError(f"frozenlake: too few solvable boards with hole_prob {holes}")
        return tasks

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        grid = task.get("grid")
        if not (
            isinstance(grid, list)
            and grid
            and all(isinstance(r, str) and len(r) == len(grid) for r in grid)
        ):
            raise EnvError("frozenlake task needs a square 'grid' of strings")
        self.grid, self.pos = grid, (0, 0)
        self.steps_left = int(task.get("max_steps", 4 * len(grid)))
        return [
            Message(
                "user",
                "Reach G without falling into a hole H. Reply with one move: "
                f"left, right, up or down.\n{self.render()}",
            )
        ]

    def render(self) -> str:
        rows = [list(r) for r in self.grid]
        rows[self.pos[0]][self.pos[1]] = "P"
        return "\n".join("".join(r) for r in rows)

    async def step(self, action: Action) -> StepResult:
        moves = _MOVE.findall(action.text)
        if not moves:
            return StepResult(
                [Message("user", "Reply with one move: left, right, up or down.")], done=False
            )
        dr, dc = MOVES[moves[-1].lower()]
        size = len(self.grid)
        self.pos = (
            min(max(self.pos[0] + dr, 0), size - 1),
            min(max(self.pos[1] + dc, 0), size - 1),
        )
        self.steps_left -= 1
        cell = self.grid[self.pos[0]][self.pos[1]]
        if cell in "HG":
            return StepResult(
                [],
                done=True,
                reward=float(cell == "G"),
                info={"outcome": "goal" if cell == "G" else "hole"},
            )
        if self.steps_left <= 0:
            return StepResult([], done=True, reward=0.0, info={"outcome": "out_of_steps"})
        return StepResult([Message("user", self.render())], done=False)
