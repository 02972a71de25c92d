"""`python -m treadle_trainer` / `treadle-trainer`: run the trainer service.

Settings come from the environment (TREADLE_*), see `treadle_trainer.settings`. Under
`torchrun --nproc-per-node N -m treadle_trainer`, rank 0 serves and ranks 1..N-1 follow it
(FSDP2 or megatron-core, see backends/follower.py).
"""

import os

from treadle_common.runtime.service import run_service
from treadle_trainer.settings import TrainerSettings


def main() -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        from treadle_trainer.backends.follower import follow

        follow()
        return
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        run_service("treadle_trainer.app", TrainerSettings)
        return
    from treadle_trainer.backends.group import leave
    from treadle_trainer.backends.ranks import shutdown_followers

    try:
        run_service("treadle_trainer.app", TrainerSettings)
    finally:
        shutdown_followers()
    leave(0)


if __name__ == "__main__":
    main()
