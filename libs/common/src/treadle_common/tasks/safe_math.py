"""Safe arithmetic on model-written text: parsed with `ast`, never `eval`ed.

Only number literals, + - * / **, unary minus, parentheses and (when given) single-letter
variables are accepted; values are exact `Fraction`s so `6/4*2 == 3` holds. Used by the
env-gateway (countdown, calculator) and the reward service (math_verify).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_POWER_BITS = 4096
"""A power whose numerator or denominator would pass this many bits is refused before it is
computed: `((9**64)**64)**64` has small exponents and an astronomically large value (the
parse is synchronous: it would hold the process far past any timeout)."""
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression (the message says why)."""


def evaluate(
    expression: str,
    variables: dict[str, Fraction] | None = None,
    *,
    allow_pow: bool = False,
    allow_decimals: bool = False,
) -> tuple[Fraction, list[int]]:
    """The exact value of `expression` and the integer literals it uses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an arithmetic expression: {exc.msg}") from exc
    literals: list[int] = []
    rules = _Rules(variables or {}, allow_pow, allow_decimals)
    return _eval(tree.body, literals, rules), literals


@dataclass(frozen=True)
class _Rules:
    variables: dict[str, Fraction]
    allow_pow: bool
    allow_decimals: bool


def _eval(node: ast.AST, literals: list[int], rules: _Rules) -> Fraction:
    numbers = (int, float) if rules.allow_decimals else (int,)
    if isinstance(node, ast.Constant) and type(node.value) in numbers:
        if type(node.value) is int:
            literals.append(node.value)
        return Fraction(str(node.value))
    if isinstance(node, ast.Name) and node.id in rules.variables:
        return rules.variables[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, literals, rules)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and rules.allow_pow:
        base, exponent = (
            _eval(node.left, literals, rules),
            _eval(node.right, literals, rules),
        )
        if (
            exponent.denominator != 1
            or abs(exponent) > MAX_EXPONENT
            or (base == 0 and exponent < 0)
        ):
            raise ExpressionError(f"exponent must be an integer up to {MAX_EXPONENT}")
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if bits * abs(exponent.numerator) > MAX_POWER_BITS:
            raise ExpressionError(f"the power would pass {MAX_POWER_BITS} bits")
        return base**exponent.numerator
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left, literals, rules), _eval(node.right, literals, rules)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ExpressionError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ExpressionError(
        f"only integers, + - * / and parentheses are allowed, not {type(node).__name__}"
    )


def format_number(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )
