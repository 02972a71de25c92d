"""`python -m treadle_env_gateway` / `treadle-env-gateway`: run the env-gateway service.

Settings come from the environment (TREADLE_*), see `treadle_env_gateway.settings`.
"""

from treadle_common.runtime.service import run_service
from treadle_env_gateway.settings import EnvGatewaySettings


def main() -> None:
    run_service("treadle_env_gateway.app", EnvGatewaySettings)


if __name__ == "__main__":
    main()
