"""The calculator's MCP toolset (verifiers starts it with `python -m vf1_tiny_calc.tools`)."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return their sum."""
        return a + b


if __name__ == "__main__":
    CalcToolset.run()
