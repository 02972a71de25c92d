"""`python -m treadle_reward` / `treadle-reward`: run the reward service.

Settings come from the environment (TREADLE_*), see treadle_common.settings.
"""

from treadle_common.service import run_service


def main() -> None:
    run_service("treadle_reward.app")


if __name__ == "__main__":
    main()
