"""The weight-store's settings (TREADLE_*): the common ones and its own."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from treadle_common.config.settings import LOCAL_SECRET, Settings


class WeightStoreSettings(Settings):
    """Where weights are kept, how many, and how much memory they may use."""

    weight_store_dir: Path | None = Field(
        None, description="weight-store data dir for the local backend (default state_dir/weights)"
    )
    weight_store_backend: Literal["local", "s3"] = Field(
        "local", description="Where weights are kept"
    )
    weight_store_bucket: str = Field("treadle-weights", description="S3 bucket of the s3 backend")
    weight_store_keep_last: int = Field(8, ge=1, description="Versions kept per model, pins aside")
    weight_store_cache_mb: int = Field(1024, ge=0, description="Hot-chunk cache size")
    weight_store_dirty_mb: int = Field(
        2048,
        ge=1,
        description="Received bytes held in memory while they are written behind to the "
        "backend; past it, publishes wait for the disk or S3",
    )
    weight_store_gc_grace_s: float = Field(
        600.0,
        ge=0,
        description="Unreferenced chunks younger than this survive GC (resumable publishes)",
    )
    s3_secure: bool = Field(False, description="Use HTTPS for S3")

    @model_validator(mode="after")
    def _refuse_default_s3_keys(self) -> WeightStoreSettings:
        keys = (self.s3_access_key, self.s3_secret_key)
        if self.environment == "production" and self.weight_store_backend == "s3":
            if LOCAL_SECRET in keys:
                raise ValueError("TREADLE_S3_ACCESS_KEY/SECRET_KEY must be set in production")
        return self
