"""`python -m treadle_rollout` / `treadle-rollout`: run the rollout service.

Settings come from the environment (TREADLE_*), see `treadle_rollout.settings`.
"""

from treadle_common.service import run_service
from treadle_rollout.engines import prestart
from treadle_rollout.settings import RolloutSettings


def start_engine_process(settings: RolloutSettings) -> None:
    """Before the service's own imports: its engine process imports at the same time."""
    if settings.rollout_engine == "hf" and settings.rollout_engine_process:
        if settings.rollout_model is not None:
            prestart.prestart(prestart.options_for(settings))


def main() -> None:
    run_service("treadle_rollout.app", RolloutSettings, prepare=start_engine_process)


if __name__ == "__main__":
    main()
