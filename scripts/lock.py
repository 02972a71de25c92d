"""Lock files with hashes (pip's `--require-hashes`), made by pip-tools' `pip-compile` from
what a working environment has installed.

    python scripts/lock.py                      # requirements/ci.txt + requirements/images/*
    python scripts/lock.py --venv .venv-vllm --out requirements/vllm.txt

The environment is the one `make test` passed in (its exact versions, editables excluded);
`pip-compile --generate-hashes` adds the hash of every file of each version, so a lock
installs on any machine of the same Python (torch: the CPU build's one file). Each image's
lock (`requirements/images/<image>.txt`) is the part of the CI lock its own packages need
(their requirements, extras included, read from the installed metadata, for any Python
3.11: an image's may be older than this one), so an image holds exactly what CI tested
(what an older 3.11 needs besides, such as `async-timeout` for redis, is installed in the
locked environment too, so that the lock has it). Needs pip-tools (`pip install
pip-tools`, in any environment: `--pip-compile PATH`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ["hatchling", "editables"]
"""What builds our own packages (their build backend): locked too, and installed before them
(`--no-build-isolation`), so no build step fetches anything unpinned."""
IMAGES = {  # image -> its own packages (with extras), as its Dockerfile installs them
    "weight-store": ["treadle-common", "treadle-weight-store", *BUILD],
    "env-gateway": ["treadle-common", "treadle-env-gateway", *BUILD],
    "reward": ["treadle-common", "treadle-reward", *BUILD],
    "rollout": ["treadle-common[hf]", "treadle-rollout", *BUILD],
    "trainer": ["treadle-common[hf]", "treadle-trainer", *BUILD],
    "cli": ["treadle-common[hf]", "treadle-cli[hf,report]", *BUILD],
}
_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==", re.MULTILINE)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PAST_REQUIRES_PYTHON = {"megatron-core"}
"""Locked beside pip-compile, whose resolver refuses them on this Python: megatron-core 0.17+
declares Python >= 3.12 yet ships cp311 wheels, which pass its backend's tests here (installs
of a lock pass `--ignore-requires-python`)."""
INDEX = "https://pypi.org/simple"


def index_entry(name: str, version: str) -> str:
    """A lock entry for `name==version` with the sha256 of each of its files on the index
    (its PEP 691 JSON page)."""
    import urllib.request

    request = urllib.request.Request(
        f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    stem = f"{name.replace('-', '_')}-{version}"
    hashes = sorted(f["hashes"]["sha256"] for f in files if f["filename"].startswith(
        (f"{stem}-", f"{stem}.tar"))
    )  # fmt: skip
    if not hashes:
        raise SystemExit(f"{name}=={version}: no files on {INDEX}")
    lines = [f"{name}=={version} \\"] + [f"    --hash=sha256:{h} \\" for h in hashes]
    lines[-1] = lines[-1].removesuffix(" \\")
    via = "    # via -r frozen (its Requires-Python not judged: scripts/lock.py)"
    return "\n".join([*lines, via])


def compile_lock(venv: Path, out: Path, pip_compile: str) -> None:
    frozen = subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "freeze", "--exclude-editable", "--all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # the workspace's own packages are installed from source, never from an index
    kept = [line for line in frozen.splitlines() if not canonical(line).startswith("treadle-")]
    beside = [line for line in kept if canonical(line.split("==")[0]) in PAST_REQUIRES_PYTHON]
    kept = [line for line in kept if line not in beside]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "frozen.in"
        source.write_text("\n".join(kept) + "\n")
        subprocess.run(
            [pip_compile, "--quiet", "--generate-hashes", "--allow-unsafe", "--no-strip-extras",
             "--no-emit-index-url", "--no-emit-find-links", "--no-header", "--annotation-style",
             "line", "-o", str(out), str(source)],
            check=True,
        )  # fmt: skip
    header = f"# Locked by scripts/lock.py from {venv.name} (pip-compile --generate-hashes)\n"
    text = out.read_text().replace(str(source), "frozen")
    # one list sorted by name (pip-compile puts pip and setuptools last, under a comment)
    text = re.sub(r"^# The following packages are considered.*\n", "", text, flags=re.MULTILINE)
    entries = re.split(r"\n(?=[A-Za-z0-9])", text)
    entries += [index_entry(*line.split("==")) for line in beside]
    entries = sorted(
        (e.strip("\n") for e in entries if e.strip()),
        key=lambda e: canonical(m.group(1)) if (m := _ENTRY.match(e)) else e,
    )
    out.write_text(header + "\n".join(entries) + "\n")


def closure(venv: Path, roots: list[str]) -> set[str]:
    """Every distribution `roots` need (extras included), from the installed metadata."""
    script = """
import json, re, sys
from importlib.metadata import distribution
from packaging.requirements import Requirement
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
seen, todo = set(), [Requirement(r) for r in json.loads(sys.argv[1])]
while todo:
    req = todo.pop()
    for extra in sorted(req.extras) or [""]:
        key = (canon(req.name), extra)
        if key in seen:
            continue
        seen.add(key)
        for text in distribution(req.name).requires or []:
            dep = Requirement(text)
            # an image's Python may be an older 3.11 (Debian's 3.11.2): what it needs too
            if dep.marker is None or any(
                dep.marker.evaluate({"extra": extra, "python_full_version": v})
                for v in ("3.11.0", "3.11.99")
            ):
                todo.append(dep)
print(json.dumps(sorted({name for name, _ in seen})))
"""
    out = subprocess.run(
        [str(venv / "bin/python"), "-c", script, json.dumps(roots)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(json.loads(out))


def subset(lock: str, names: set[str]) -> str:
    """The entries of `lock` (with their hash lines) for the distributions in `names`."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock)
    kept = [b for b in blocks if (m := _ENTRY.match(b)) and canonical(m.group(1)) in names]
    # without the extras another package of CI's asked for: what an image's own packages
    # ask for is in `names` already
    kept = [_ENTRY.sub(lambda m: f"{m.group(1)}==", b, count=1) for b in kept]
    return "\n".join(b.rstrip("\n") for b in kept) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--out", type=Path, default=ROOT / "requirements/ci.txt")
    parser.add_argument("--pip-compile", default=shutil.which("pip-compile") or "pip-compile")
    parser.add_argument("--images", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--without",
        default="",
        help="comma-separated packages left out of the lock (installed with --no-deps)",
    )
    args = parser.parse_args()
    args.venv, args.out = args.venv.resolve(), args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    compile_lock(args.venv, args.out, args.pip_compile)
    if args.without:  # what the environment removed on purpose (vLLM's torchvision...)
        left_out = {canonical(n) for n in args.without.split(",")}
        lines = args.out.read_text().split("\n", 1)
        kept = subset(
            lines[1], {canonical(m.group(1)) for m in _ENTRY.finditer(lines[1])} - left_out
        )
        args.out.write_text(f"{lines[0]}\n# without (installed --no-deps): {args.without}\n{kept}")
    print(f"wrote {args.out.relative_to(ROOT)}")
    if args.images is False or (args.images is None and args.venv != ROOT / ".venv"):
        return
    lock = args.out.read_text()
    for image, roots in IMAGES.items():
        names = {n for n in closure(args.venv, roots) if not n.startswith("treadle-")}
        path = ROOT / "requirements/images" / f"{image}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = f"# {image}'s part of requirements/ci.txt (scripts/lock.py): {', '.join(roots)}\n"
        path.write_text(header + subset(lock, names))
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
