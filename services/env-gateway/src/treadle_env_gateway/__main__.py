"""`python -m treadle_env_gateway` / `treadle-env-gateway`: run the env-gateway service.

Settings come from the environment (TREADLE_*), see treadle_common.settings.
"""

from treadle_common.service import run_service


def main() -> None:
    run_service("treadle_env_gateway.app")


if __name__ == "__main__":
    main()
