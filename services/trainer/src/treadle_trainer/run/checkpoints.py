"""A run's checkpoints: save one and commit it with the ledger, restore the last committed
one (an older intact one when it is damaged: the steps after it are rolled back), and keep
the newest `KEEP_CHECKPOINTS`.

    save     flush the publisher --> backend.save(step-NNNNNN-t<lease token>) --> ledger
             commit (ack and ledger every entry since the last one) --> trim acked stream
             entries --> delete every other directory but the kept ones
    restore  committed path (else the ledger's, newest first) --> the first intact one -->
             the backend and the run's status, in place
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import RunStatus
from treadle_common.clients import streams
from treadle_common.config.recipe import RunConfig
from treadle_common.runtime.logs import get_logger
from treadle_trainer import metrics as tm
from treadle_trainer.backends import TorchBackend, on_torch_thread
from treadle_trainer.backends.checkpoint_files import verify_checkpoint
from treadle_trainer.errors import CorruptCheckpoint
from treadle_trainer.run.collector import Collector
from treadle_trainer.run.feeder import Feeder
from treadle_trainer.run.lease import Lease
from treadle_trainer.run.ledger import Drops, Ledger, LedgerEntry
from treadle_trainer.run.publishing import RunVersions

log = get_logger(__name__)
KEEP_CHECKPOINTS = 2
COMMITTED_COUNTERS = (
    "trajectories_consumed",
    "trajectories_trained",
    "trajectories_acked",
    "rejected",
    "duplicates",
    "dropped",
    "versions",
)
"""What a rollback to an older checkpoint takes from the last committed state instead."""


def intact_checkpoint(candidates: list[Path]) -> tuple[Path, dict]:
    """The first intact checkpoint of `candidates` (committed ones, newest first)."""
    errors = []
    for path in candidates:
        try:
            return path, verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            log.error("checkpoint damaged", error=str(exc))
            errors.append(str(exc))
    raise CorruptCheckpoint("no intact checkpoint to restore: " + "; ".join(errors))


class RunCheckpoints:
    def __init__(
        self,
        config: RunConfig,
        r: aioredis.Redis,
        lease: Lease,
        status: RunStatus,
        parts: tuple[Feeder, Collector, Ledger, Drops, RunVersions],
    ):
        self.config, self.r, self.lease, self.status = config, r, lease, status
        self.feeder, self.collector, self.ledger, self.drops, self.versions = parts
        self.run_dir = config.output_dir / config.run_id
        self.kept: list[Path] = []  # committed checkpoints kept, newest first
        self.rolled_back = 0

    # --- save ---------------------------------------------------------------------------------
    async def save(self, backend: TorchBackend, version: int) -> None:
        """Checkpoint, then ack and ledger every entry of the steps since the last one."""
        run, step = self.config.run_id, self.status.step
        started = time.perf_counter()
        await self.versions.publisher.flush()  # the checkpoint's versions are all in the store
        # the lease's token in the name: a stale owner (its commit refused) never writes over
        # the directory of the run's real owner
        name = f"step-{step:06d}-t{self.lease.token}"
        path = (self.run_dir / "checkpoints" / name).resolve()
        self.status.trajectories_acked += self.ledger.pending_acks
        # buffered (read, not yet trained) entries stay pending: a restored owner re-reads them
        buffered = self.collector.buffer.trajectory_ids()
        run_state = self.status.model_dump(mode="json")
        run_state["trajectories_consumed"] -= len(buffered)
        run_state["checkpoint_step"] = step
        committed = {k: v for k, v in run_state.items() if k != "steps"}
        meta = {
            "run": run_state,
            "seen": sorted(self.collector.seen - buffered),
            "version": version,
            "model": self.config.model.name,
        }
        await on_torch_thread(backend.save, path, meta)
        await self.ledger.commit(step, path, json.dumps(committed))
        self.status.checkpoint_step = step
        await self._trim()
        # only the owner gets here (a stale one's commit was refused): keep the last
        # KEEP_CHECKPOINTS committed, delete every other directory (stale owners' too)
        self.kept = [path, *self.kept][:KEEP_CHECKPOINTS]
        for stale_dir in (self.run_dir / "checkpoints").glob("step-*"):
            if stale_dir.resolve() not in self.kept:
                shutil.rmtree(stale_dir, ignore_errors=True)
        tm.CHECKPOINT_SECONDS.labels(run).observe(time.perf_counter() - started)

    async def _trim(self) -> None:
        """Drop the stream entries their consumers acked (bounded Redis); a failure only
        leaves them for the next checkpoint."""
        run = self.config.run_id
        try:
            await streams.trim_acked(self.r, names.trajectories_stream(run), names.TRAINER_GROUP)
            await streams.trim_acked(self.r, names.tasks_stream(run), names.ROLLOUT_GROUP)
        except Exception as exc:
            log.warning("trimming the run's streams failed", run=run, error=repr(exc))

    # --- restore ------------------------------------------------------------------------------
    async def restore(self, backend: TorchBackend) -> bool:
        """Load the last committed checkpoint of this run, if any; True when restored."""
        run = self.config.run_id
        await self.feeder.restore()
        raw = await self.r.hget(names.run_state(run), "checkpoint_path")
        if raw is None:
            return False
        committed = Path(streams.text(raw))
        candidates = [committed, *await self.ledger.checkpoints()]
        candidates = list(dict.fromkeys(candidates))  # committed ones only, newest first
        path, meta = await asyncio.to_thread(intact_checkpoint, candidates)
        self.kept = candidates[:KEEP_CHECKPOINTS]
        await on_torch_thread(backend.load, path)
        restored = RunStatus.model_validate(meta["run"])
        restored.tasks_fed, restored.state = self.status.tasks_fed, "running"
        restored.resumed += 1
        restored.owner = self.lease.value
        for name in RunStatus.model_fields:  # in place: every part holds this status
            setattr(self.status, name, getattr(restored, name))
        self.collector.seen = set(meta["seen"])
        if path != committed:
            await self._roll_back(restored.step, int(meta["version"]))
        self.drops.reload()
        if path != committed:
            for _ in range(self.rolled_back):
                self.drops.count("checkpoint_lost")
        log.info("run restored", run=run, step=restored.step, checkpoint=str(path))
        return True

    async def _roll_back(self, step: int, version: int) -> None:
        """The committed checkpoint was damaged and an older one (at `step`) restored: the
        steps after it are undone. Their entries were acked, so their trajectories cannot be
        trained again: a `rollback` ledger entry (committed with the next checkpoint) drops
        them as `checkpoint_lost`, and the counters go on from the committed state."""
        run = self.config.run_id
        lost: list[str] = []
        handled: set[str] = set()
        records: Any = await self.r.xrange(names.ledger_stream(run))
        for _, fields in records:
            if int(fields[b"step"]) > step and fields[b"kind"] != b"rollback":
                trained = json.loads(fields[b"trained"])
                lost += trained
                handled |= set(trained) | set(json.loads(fields[b"dropped"]))
        raw = await self.r.hget(names.run_state(run), "committed_status")
        if raw:
            committed = RunStatus.model_validate_json(raw)
            for name in COMMITTED_COUNTERS:
                setattr(self.status, name, getattr(committed, name))
        self.status.trajectories_trained -= len(lost)
        self.collector.seen |= handled
        self.rolled_back = len(lost)
        dropped = dict.fromkeys(lost, "checkpoint_lost")
        self.ledger.uncommitted.append(LedgerEntry(step, "rollback", version, [], [], dropped))
        log.error("committed checkpoint damaged: rolled back", run=run, step=step, lost=len(lost))
