"""`treadle conformance ...`: added to the `treadle` command through the `treadle.commands`
entry-point group (see `treadle_cli.cli.add_plugins`).

treadle conformance openai URL [--model M] [--api-key K] [--repeats N] [--only P] [--json]
    the OpenAI suite (`openai_checks.py`) against a server whose API is at URL (…/v1)
treadle conformance tinker URL [--base-model M] [--api-key K] [--only P] [--json]
    the Tinker suite (`tinker_checks.py`) against a Tinker API server at URL
treadle conformance list [openai|tinker]
    every check of a suite: its id and the behaviour it checks

Each prints a table (or, with --json, one JSON object) of every check: pass, FAIL with what
was seen, or skip with why; it exits 1 when a check failed.
"""

from __future__ import annotations

import json
import os
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.table import Table

from treadle_conformance import openai_checks, openai_server, tinker_checks
from treadle_conformance.report import Report, Status, Suite

app = typer.Typer(
    no_args_is_help=True,
    help="Check a server's OpenAI or Tinker API against documented behaviours.",
)
SUITES: dict[str, Suite] = {"openai": openai_checks.suite, "tinker": tinker_checks.suite}
Only = Annotated[
    list[str] | None, typer.Option(help="Only the checks whose id starts with this (repeatable)")
]
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object instead of the table")]


def show(report: Report, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        behaviours = {c.id: c.behaviour for c in SUITES[report.suite].checks}
        table = Table(title=f"{report.suite} conformance: {report.server}")
        for column in ("check", "result", "behaviour / what was seen"):
            table.add_column(column)
        for o in report.outcomes:
            style = {"pass": "green", "FAIL": "red", "skip": "yellow"}[o.status.value]
            table.add_row(o.check, f"[{style}]{o.status.value}[/]", o.detail or behaviours[o.check])
        console = Console(width=max(Console().width, 120))
        console.print(table)
        counts = ", ".join(f"{report.count(s)} {s.name}" for s in Status)
        console.print(f"{len(report.outcomes)} checks: {counts}")
    if not report.ok:
        raise typer.Exit(1)


@app.command("openai")
def openai(
    url: Annotated[str, typer.Argument(help="The API's base URL, e.g. http://host:8000/v1")],
    model: Annotated[
        str | None, typer.Option(help="Model to test (default: the first listed)")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="Bearer key (default: $OPENAI_API_KEY; none if unset)")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Requests per structured-output check")] = 3,
    timeout_s: Annotated[float, typer.Option(help="Per request")] = 120.0,
    only: Only = None,
    as_json: AsJson = False,
) -> None:
    """The OpenAI suite: models, chat and completions, streaming, logprobs, stop strings,
    tools under each tool_choice, response formats, error shapes."""
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) as http:
        if model is None:
            listed = http.get("/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
        server = openai_server.OpenAIServer(http, model, repeats=repeats, keyed=bool(key))
        report = openai_checks.suite.run(server, f"{url} ({model})", only)
    show(report, as_json)


@app.command("tinker")
def tinker(
    url: Annotated[str, typer.Argument(help="The server's base URL, e.g. http://host:8000")],
    base_model: Annotated[
        str | None, typer.Option(help="Base model to train (default: the first listed)")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="The API key (default: $TINKER_API_KEY)")
    ] = None,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank of the clients made")] = 4,
    only: Only = None,
    as_json: AsJson = False,
) -> None:
    """The Tinker suite: capabilities, LoRA clients, losses at known inputs, futures in order
    and retried by seq_id, adapter isolation, checkpoints, sampling, errors and auth."""
    key = api_key or os.environ.get("TINKER_API_KEY")
    if not key:
        raise typer.BadParameter("give --api-key or set TINKER_API_KEY")
    server = tinker_checks.TinkerServer(url.rstrip("/"), key, base_model, rank)
    try:
        report = tinker_checks.suite.run(server, url, only)
    finally:
        server.close()
    show(report, as_json)


@app.command("list")
def list_checks(
    suite: Annotated[str | None, typer.Argument(help="openai or tinker (default: both)")] = None,
) -> None:
    """Every check of a suite: its id and the behaviour it checks."""
    for name in [suite] if suite else list(SUITES):
        if name not in SUITES:
            raise typer.BadParameter(f"no suite {name!r}; known: {', '.join(SUITES)}")
        for check in SUITES[name].checks:
            print(f"{name}\t{check.id}\t{check.behaviour}")
