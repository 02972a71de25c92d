"""The guessing game's MCP toolset (verifiers starts it with `python -m vf1_tiny_guess.tools`).
The secret lives in the rollout's state, which the task's `setup` writes and verifiers carries
to this server for each call; every guess is counted there too."""

import verifiers.v1 as vf


class GuessState(vf.State):
    secret: int = 0
    guesses: int = 0
    solved: bool = False


class GuessToolset(vf.Toolset[vf.ToolsetConfig, GuessState]):
    TOOL_PREFIX = "game"

    @vf.tool
    def guess(self, number: int) -> str:
        """Guess the secret number; the answer is higher, lower or correct."""
        state = self.state
        state.guesses += 1
        if number == state.secret:
            state.solved = True
            return "correct"
        return "higher" if number < state.secret else "lower"


if __name__ == "__main__":
    GuessToolset.run()
