"""Rank 0 idles 5 s between commands under `TREADLE_TRAINER_DIST_TIMEOUT_S=2`, pinging its
follower every `argv[1]` seconds (0: never), then shuts it down. Run under `torchrun`."""

import os
import sys
import time

from treadle_trainer.backends.follower import follow
from treadle_trainer.backends.group import init_distributed
from treadle_trainer.backends.ranks import ping, shutdown_followers

if int(os.environ["RANK"]) > 0:
    follow()
    sys.exit(0)
init_distributed()
every = float(sys.argv[1])
deadline = time.monotonic() + 5.0
while time.monotonic() < deadline:
    time.sleep(every or 5.0)
    if every:
        ping()
shutdown_followers()
