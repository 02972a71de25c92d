"""`python -m treadle_rollout` / `treadle-rollout`: run the rollout service.

Settings come from the environment (TREADLE_*), see treadle_common.settings.
"""

from treadle_common.service import run_service


def main() -> None:
    run_service("treadle_rollout.app")


if __name__ == "__main__":
    main()
