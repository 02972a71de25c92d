"""Write the nats-server config (users, permissions) that compose and k8s mount, rendered
from `treadle_common.auth.infra` (the same one `treadle up` starts nats-server with)."""

from pathlib import Path

from treadle_common.auth.infra import render_nats_conf

ROOT = Path(__file__).resolve().parents[1]
COPIES = ("deploy/nats/nats.conf", "k8s/base/nats.conf")

if __name__ == "__main__":
    for path in COPIES:
        (ROOT / path).write_text(render_nats_conf())
        print(f"wrote {path}")
