"""Small pieces: no function over 60 lines and no class over 400, outside tests and generated
code (`make lint` runs this; it prints the largest of each either way).

    python scripts/check_sizes.py          # exit 1 on a piece over its limit
    python scripts/check_sizes.py --top 20

A piece's size is its lines from `def`/`class` to its last line, docstring included.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["libs", "services", "bench", "sim", "conformance", "scripts"]
LIMITS = {"function": 60, "class": 400}


@dataclass(frozen=True)
class Piece:
    kind: str
    where: str
    lines: int


def pieces(path: Path) -> list[Piece]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Piece] = []
    rel = path.relative_to(ROOT)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append(Piece(kind, f"{rel}:{name}", size))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def source_files() -> list[Path]:
    return sorted(
        path
        for top in SOURCES
        for path in (ROOT / top).rglob("*.py")
        if "/proto/" not in path.as_posix() and not path.name.endswith(("_pb2.py", "_grpc.py"))
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=5, help="how many of the largest to print")
    args = parser.parse_args()
    every = [piece for path in source_files() for piece in pieces(path)]
    failures = []
    for kind, limit in LIMITS.items():
        ranked = sorted((p for p in every if p.kind == kind), key=lambda p: -p.lines)
        print(f"largest {kind}s (limit {limit}):")
        for piece in ranked[: args.top]:
            print(f"  {piece.lines:5d}  {piece.where}")
        for piece in ranked:
            if piece.lines <= limit:
                break
            failures.append(f"{piece.where}: {piece.lines} lines (limit {limit})")
    for failure in failures:
        print(f"too large: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
