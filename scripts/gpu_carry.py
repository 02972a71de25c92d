"""What `scripts/gpu_bench.sh` needs on a lent GPU machine, made here into `.dev/` (ignored):
that machine has CUDA torch, transformers and the usual numeric stack on Python 3.12 but
none of Treadle's service dependencies and no network, and what travels there is at most
64 MiB. So:

    .dev/whl/       cp312 wheels of the services' dependencies the GPU image lacks, at the
                    versions this checkout's lock pins (`pip download`, no dependencies)
    .dev/bin/       redis-server and nats-server from this venv, gzipped (static enough:
                    glibc only)
    .dev/model/     an imported model's config, tokenizer and chat template, without its
                    weights (the GPU side makes seeded random ones of the same shapes: a real
                    model's weights do not fit)

    python scripts/gpu_carry.py [--model smollm2]
    # then, with the device tool: carry [".dev"], command: bash scripts/gpu_bench.sh
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "ci.txt"
CARRY = """annotated-types anyio cachetools certifi cffi cryptography dill distro docstring-parser
fastapi google-auth googleapis-common-protos grpcio grpcio-health-checking grpcio-tools h11 h2
hpack httpcore httpcore2 httptools httpx httpx2 hyperframe idna importlib-metadata jiter msgpack
nats-py openai opentelemetry-api opentelemetry-exporter-http-transport
opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common
opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http opentelemetry-proto
opentelemetry-sdk opentelemetry-semantic-conventions orjson protobuf pyasn1 pyasn1-modules
pycparser pydantic pydantic-core pydantic-settings python-dotenv python-multipart redis sniffio
starlette structlog tenacity tinker truststore typing-extensions typing-inspection uvicorn
zstandard""".split()
"""What the bench, trainer, rollout and weight-store processes import that the GPU image (its
package list: /work/.library/device/KINDS.md, 2026-11-17) does not hold, or holds older."""
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def pinned(name: str) -> str:
    """`name==version` as the lock pins it."""
    pattern = rf"^{re.escape(name)}(?:\[[^\]]*\])?==([^ \\\n]+)"
    match = re.search(pattern, LOCK.read_text(), re.M | re.I)
    if match is None:
        raise SystemExit(f"{name} is not in {LOCK}")
    return f"{name}=={match.group(1)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="an imported model's NAME or directory")
    parser.add_argument("--out", type=Path, default=ROOT / ".dev")
    args = parser.parse_args()
    out: Path = args.out
    shutil.rmtree(out / "whl", ignore_errors=True)
    platforms = [f"--platform={p}" for p in PLATFORMS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version=3.12", "--implementation=cp", "--abi=cp312", "--abi=abi3",
         "--abi=none", *platforms, "-d", str(out / "whl"), *map(pinned, CARRY)],
        check=True,
    )  # fmt: skip
    (out / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("redis-server", "nats-server"):
        with open(Path(sys.executable).parent / name, "rb") as src:
            (out / "bin" / f"{name}.gz").write_bytes(gzip.compress(src.read()))
    from treadle_common.config.settings import Settings

    model = Path(args.model)
    if not model.is_dir():
        model = Settings().state_dir / "models" / args.model
    (out / "model").mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / "model" / f.name)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB (with the tracked tree, under 64 MiB)")


if __name__ == "__main__":
    main()
