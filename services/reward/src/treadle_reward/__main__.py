"""`python -m treadle_reward` / `treadle-reward`: run the reward service.

Settings come from the environment (TREADLE_*), see `treadle_reward.settings`.
"""

from treadle_common.runtime.service import run_service
from treadle_reward.settings import RewardSettings


def main() -> None:
    run_service("treadle_reward.app", RewardSettings)


if __name__ == "__main__":
    main()
