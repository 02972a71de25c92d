"""The reward service's settings (TREADLE_*): the common ones and its own (and its scorers')."""

from __future__ import annotations

from pydantic import Field

from treadle_common.config.settings import Settings


class RewardSettings(Settings):
    """Concurrency, the score cache, extra scorer modules and the scorers that call out."""

    reward_max_concurrency: int = Field(64, ge=1, description="reward: requests per scorer at once")
    reward_max_in_flight: int = Field(
        256,
        ge=1,
        description="reward: requests one replica handles at once, all scorers together (past "
        "it, NATS messages wait in the client)",
    )
    reward_cpu_workers: int = Field(
        2,
        ge=0,
        description="reward: worker processes for compute-only scorers (math_verify, "
        "format_regex), killed past reward_timeout_s; 0 computes in the service's process",
    )
    reward_cache_size: int = Field(10_000, ge=0, description="reward: cached deterministic scores")
    judge_base_url: str = Field(
        "", description="reward llm_judge: OpenAI-compatible base URL (…/v1)"
    )
    judge_model: str = Field("", description="reward llm_judge: model name")
    judge_api_key: str = Field(
        "", description="reward llm_judge: API key, if the endpoint needs one"
    )
    reward_model_dir: str = Field(
        "", description="reward reward_model: HF sequence-classifier directory"
    )
    scorer_modules: str = Field(
        "", description="reward: comma-separated modules to import that register extra scorers"
    )
