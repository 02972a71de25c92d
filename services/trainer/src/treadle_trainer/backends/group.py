"""The process group of a `torchrun` job: joined within a deadline, left without the
interpreter's finalisation.

    init_distributed()   every rank, once; a group that does not form in
                         `trainer_rendezvous_timeout_s` ends the rank with the reason
    leave(code)          end a rank's process once its group is torn down
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def dist_timeout_s() -> float:
    """How long a collective may wait (`TREADLE_TRAINER_DIST_TIMEOUT_S`): a rank that hangs
    or died fails the others within minutes, not a day. Rank 0 pings the followers while it
    has nothing for them (`ping`), so an idle trainer does not trip it."""
    from treadle_trainer.settings import TrainerSettings

    return TrainerSettings().trainer_dist_timeout_s


RENDEZVOUS_FAILED = 75
"""A rank's exit code when the process group did not form in time."""


def init_distributed() -> None:
    """Join the job's process group. Collectives may then wait `dist_timeout_s`, but the
    group itself must form within `trainer_rendezvous_timeout_s`: otherwise the rank logs
    why and exits (torchrun then stops the others), instead of waiting out the collective
    timeout with nothing in any log."""
    if dist.is_initialized():
        return
    from treadle_trainer.settings import TrainerSettings

    limit = TrainerSettings().trainer_rendezvous_timeout_s
    formed = threading.Event()
    threading.Thread(target=_watch_rendezvous, args=(formed, limit), daemon=True).start()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=dist_timeout_s()))
    formed.set()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _watch_rendezvous(formed: threading.Event, limit: float) -> None:
    if formed.wait(limit):
        return
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    log.error(
        "rank %s of %s: the process group did not form within %.0fs (rendezvous at %s): "
        "another rank did not start, crashed while starting, or cannot reach this one; "
        "see the other ranks' output (TREADLE_TRAINER_RENDEZVOUS_TIMEOUT_S)",
        env.get("RANK", "?"),
        env.get("WORLD_SIZE", "?"),
        limit,
        where,
    )
    leave(RENDEZVOUS_FAILED)


def leave(code: int) -> None:
    """End a rank's process once its work is done and its process group torn down, without
    the interpreter's finalisation: gloo's loop threads outlive `destroy_process_group` (FSDP's
    sharded parameters still hold the group), and on a loaded machine their C++ destructors
    abort the process at exit ("terminate called without an active exception", SIGABRT), which
    torchrun reports as the job failing."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
