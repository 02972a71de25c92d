"""The `treadle` command's settings (TREADLE_*): the common ones, `treadle up`'s ports and the
URLs of a deployed stack `treadle run` drives."""

from __future__ import annotations

from pydantic import Field

from treadle_common.settings import Settings


class CliSettings(Settings):
    """The CLI process: the stack it starts or the one it is pointed at."""

    base_port: int | None = Field(
        None, description="`treadle up`: assign the services' ports consecutively from here"
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


def get_settings() -> CliSettings:
    """The CLI's settings, from the environment (one command, one read)."""
    return CliSettings()
