"""`python -m treadle_rollout` / `treadle-rollout`: run the rollout service.

Settings come from the environment (TREADLE_*), see `treadle_rollout.settings`.
"""

from treadle_common.service import run_service
from treadle_rollout.settings import RolloutSettings


def main() -> None:
    run_service("treadle_rollout.app", RolloutSettings)


if __name__ == "__main__":
    main()
