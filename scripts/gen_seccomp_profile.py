"""Write the env-gateway container's seccomp profile (compose mounts it; a Kubernetes node
installs it as a `Localhost` profile), rendered from the sandbox's own deny list
(`treadle_env_gateway.sandbox.seccomp.container_profile`)."""

import json
from pathlib import Path

from treadle_env_gateway.sandbox.seccomp import container_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "deploy/seccomp/env-gateway.json"

if __name__ == "__main__":
    (ROOT / PROFILE).write_text(json.dumps(container_profile(), indent=2) + "\n")
    print(f"wrote {PROFILE}")
