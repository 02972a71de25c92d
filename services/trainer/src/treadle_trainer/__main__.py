"""`python -m treadle_trainer` / `treadle-trainer`: run the trainer service.

Settings come from the environment (TREADLE_*), see treadle_common.settings.
"""

from treadle_common.service import run_service


def main() -> None:
    run_service("treadle_trainer.app")


if __name__ == "__main__":
    main()
