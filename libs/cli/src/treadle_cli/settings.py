"""The `treadle` command's settings (TREADLE_*): the common ones, `treadle up`'s ports and the
URLs of a deployed stack `treadle run` drives."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from treadle_common.auth import policy as auth
from treadle_common.config.settings import Settings


class CliSettings(Settings):
    """The CLI process: the stack it starts or the one it is pointed at."""

    base_port: int | None = Field(
        None, description="`treadle up`: assign the services' ports consecutively from here"
    )
    rollout_python: Path | None = Field(
        None,
        description="`treadle up` and `treadle run`'s own stack: the Python interpreter rollout "
        "runs under (default: the CLI's); with TREADLE_ROLLOUT_ENGINE=vllm, the vLLM venv's "
        "(`.venv-vllm/bin/python`, scripts/setup_vllm.sh)",
    )
    trainer_url: str | None = Field(
        None, description="`treadle run` against a deployed stack: the trainer's HTTP URL"
    )
    rollout_url: str | None = Field(None, description="... and rollout's HTTP URL")
    weight_store_url: str | None = Field(None, description="... and the weight-store's HTTP URL")
    run_reconnect_s: float = Field(
        900.0,
        gt=0,
        description="`treadle run`: how long it keeps reconnecting to a trainer or rollout "
        "that does not answer (restarting, moved) before it gives up, writes the summary it "
        "has and exits 1",
    )

    def client_token(self) -> str | None:
        """`TREADLE_TOKEN` / `TREADLE_TOKEN_FILE`, else the admin token `treadle up` wrote
        into the state directory (`{state_dir}/auth/admin.token`)."""
        return super().client_token() or auth.read_token(None, admin_token_file(self.state_dir))


def auth_dir(state_dir: Path) -> Path:
    return state_dir / "auth"


def admin_token_file(state_dir: Path) -> Path:
    return auth_dir(state_dir) / "admin.token"


def get_settings() -> CliSettings:
    """The CLI's settings, from the environment (one command, one read)."""
    return CliSettings()
