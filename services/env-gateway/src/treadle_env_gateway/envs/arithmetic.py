"""Safe arithmetic on model-written text: parsed with `ast`, never `eval`ed.

Only integer literals, + - * /, unary minus and parentheses are accepted; values are exact
`Fraction`s so `6/4*2 == 3` holds.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class ExpressionError(ValueError):
    """The text is not an allowed arithmetic expression (the message says why)."""


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of `expression` and the integer literals it uses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an arithmetic expression: {exc.msg}") from exc
    literals: list[int] = []
    return _eval(tree.body, literals), literals


def _eval(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, literals)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left, literals), _eval(node.right, literals)
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
