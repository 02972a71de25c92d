"""`python -m treadle_weight_store` / `treadle-weight-store`: run the weight-store service.

Settings come from the environment (TREADLE_*), see `treadle_weight_store.settings`.
"""

from treadle_common.runtime.service import run_service
from treadle_weight_store.settings import WeightStoreSettings


def main() -> None:
    run_service("treadle_weight_store.app", WeightStoreSettings)


if __name__ == "__main__":
    main()
