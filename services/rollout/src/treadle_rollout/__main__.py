"""`python -m treadle_rollout` / `treadle-rollout`: run the rollout service.

Settings come from the environment (TREADLE_*), see `treadle_rollout.settings`.
"""

from treadle_common.runtime.service import run_service
from treadle_rollout.engines import cpus, prestart
from treadle_rollout.settings import RolloutSettings


def start_engine_process(settings: RolloutSettings) -> None:
    """Before the service's own imports: its engine process imports at the same time; the
    service's threads run off the engine's CPUs (`TREADLE_ROLLOUT_ENGINE_CPUS`)."""
    if settings.rollout_engine != "hf":
        return
    try:
        split = cpus.split(settings.rollout_engine_cpus, settings.torch_threads)
    except ValueError as exc:
        raise SystemExit(f"TREADLE_ROLLOUT_ENGINE_CPUS: {exc}") from None
    if settings.rollout_engine_process and settings.rollout_model is not None:
        prestart.prestart(prestart.options_for(settings))
    if split is not None:
        cpus.bind(split[1])


def main() -> None:
    run_service("treadle_rollout.app", RolloutSettings, prepare=start_engine_process)


if __name__ == "__main__":
    main()
