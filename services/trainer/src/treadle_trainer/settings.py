"""The trainer's settings (TREADLE_*): the common ones and its own."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from treadle_common.config.settings import Settings


class TrainerSettings(Settings):
    """Run ownership."""

    trainer_run_retention_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="trainer: a finished run's Redis keys (ledger, dead letters, state) expire "
        "after this",
    )
    trainer_deterministic: bool = Field(
        True,
        description="trainer: torch's deterministic algorithms (warnings where an op has none), "
        "so a run's training is a pure function of its batches and `treadle replay` reproduces "
        "its weights bit for bit; off: kernels that may sum in any order (on the CPU, index "
        "additions over two threads gave different weights on every run)",
    )
    trainer_publish_worker: Literal["auto", "always", "never"] = Field(
        "auto",
        description="trainer: where the background publish of a step's weights runs; `auto`: "
        "in a child process when training is on an accelerator, on Linux (the publish's Python "
        "then never takes the GIL from the thread launching the next step's kernels), in this "
        "process on the CPU (where a step waits for the publish anyway); `always`, `never`: "
        "either way",
    )
    trainer_torch_lanes: int = Field(
        1,
        ge=1,
        le=64,
        description="trainer: runs' steps that may train at once, each on a thread of its own "
        "(many LoRA runs on one base; give each lane torch_threads = cores / lanes)",
    )
    trainer_pace_lead: float = Field(
        2.0,
        ge=0,
        description="trainer: with the fair policy, a run this many weighted steps ahead of the "
        "least advanced run of its priority that keeps up waits for its turn, so step rates "
        "follow the weights (`treadle_common.fleet.pacing`; 0: work-conserving shares only)",
    )
    trainer_tenant_max_runs: int = Field(
        0,
        ge=0,
        description="trainer: active runs one tenant may have at once; one more is refused "
        "with 429 naming the quota (0: no limit)",
    )
    trainer_run_retries: int = Field(
        8,
        ge=0,
        description="trainer: times a run resumes from its last checkpoint after an "
        "infrastructure error (Redis, weight-store or env-gateway unreachable, a batch timeout) "
        "before it is marked failed",
    )
    trainer_dist_timeout_s: float = Field(
        600.0,
        gt=0,
        description="trainer (torchrun, FSDP): a collective that waits longer fails the job "
        "(a rank hung or died); rank 0 pings idle followers every quarter of it",
    )
    trainer_rendezvous_timeout_s: float = Field(
        60.0,
        gt=0,
        description="trainer (torchrun): the ranks must form their process group within this, "
        "or each exits saying so (a rank that did not start or cannot reach the others)",
    )
    trainer_lease_s: float = Field(
        15.0, gt=0, description="trainer: run-ownership lease; a dead owner's run resumes after"
    )
    trainer_max_training_sessions: int = Field(
        4,
        ge=0,
        description="trainer: training-API sessions open at once (each holds a model and its "
        "optimizer); one more is refused with 429",
    )
    trainer_path_roots: list[Path] = Field(
        default_factory=list,
        description="trainer: the directories a client may name server paths under (a "
        "recipe's model.path, data.path and output_dir; the training API's model_path and "
        "load_state path), as a JSON list; empty: the state dir and the working directory",
    )

    trainer_tinker_models: dict[str, Path] = Field(
        default_factory=dict,
        description="trainer: the base models the Tinker API serves, as JSON "
        '`{"name": "<HF model dir>"}`; the SDK names them in create_lora_training_client',
    )
    trainer_rollout_url: str = Field(
        "",
        description="trainer: rollout's HTTP URL; the Tinker API's sampling clients sample "
        "through it (empty: sampling is refused with 503)",
    )
    trainer_tinker_max_clients: int = Field(
        16,
        ge=0,
        description="trainer: Tinker training clients (LoRA adapters) open at once; one more "
        "is refused with 429",
    )

    trainer_tinker_session_ttl_s: float = Field(
        300.0,
        gt=10,
        description="trainer: a Tinker session whose SDK sent no heartbeat (every 10 s) for "
        "this long ends, freeing its training clients",
    )

    def path_roots(self) -> list[Path]:
        """Where client-named paths must resolve to (symlinks followed)."""
        return [p.resolve() for p in self.trainer_path_roots or [self.state_dir, Path.cwd()]]
