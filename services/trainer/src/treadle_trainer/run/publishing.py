"""A run's weight versions: step s publishes version V0 + s, every `publish_every` steps.

They go to the run's policy model (`RunConfig.policy_model`): the model itself for a
full-weight run; for a LoRA run its own adapter model (`{model}.{run}`), whose versions apply
to a full-weight version of the shared base model (`full_base_version`), so that runs on one
base never number versions of the same model.

Published off the step's critical path by the background, newest-first `Publisher`
(`treadle_trainer/publisher.py`), from a child process when training is on an accelerator
(`PublishWorker`: the publish's Python then never takes the GIL from the training thread);
the weight-store announces each version on NATS. A step's
record gets its publish's duration and size once both exist (the publish may end after the
step's record is written, or never, when a newer snapshot replaced it).
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis
import torch
from opentelemetry.context import Context

from treadle_common import names
from treadle_common.api.runs import RunStatus, StepRecord
from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient, build_manifest, chunk_positions
from treadle_common.clients.weights_worker import WORKER_AVAILABLE, PublishWorker
from treadle_common.config.recipe import RunConfig
from treadle_common.model import lora
from treadle_common.model.export import export_hf
from treadle_common.proto.treadle.v1 import weights_pb2
from treadle_common.runtime import tracing
from treadle_trainer import metrics as tm
from treadle_trainer.backends import on_torch_thread
from treadle_trainer.backends.lora import LoraBackend
from treadle_trainer.publisher import Published, Publisher, Snapshot
from treadle_trainer.run import claims


class BaseInUse(RuntimeError):
    """A LoRA run's base weights differ from those other active runs of its model train on."""


class RunVersions:
    def __init__(self, config: RunConfig, store: WeightStoreClient, status: RunStatus):
        self.config = config
        self.store = store
        self.status = status
        self.publisher = Publisher(self._publish_snapshot, self._published)
        self.assets = model_assets(config.model.path)  # config + tokenizer travel with weights
        self.metadata: dict[str, str] = {}
        """Recorded on every version this run publishes (a LoRA run: the adapter's config
        and the full-weight version it applies to)."""
        self._records: dict[int, StepRecord] = {}  # steps whose publish is not recorded yet
        self._done: dict[int, Published] = {}
        self.worker: PublishWorker | None = None
        """Where the background publishes run when training is on an accelerator
        (`trainer_publish_worker`): a child process, off this process's GIL."""

    def choose_sender(self, mode: str, device: str) -> None:
        """`trainer_publish_worker`: background publishes from a child process (`always`, or
        `auto` with training on an accelerator, on Linux: the weights travel in a memfd) or
        from this one."""
        if mode == "always" or (mode == "auto" and device != "cpu" and WORKER_AVAILABLE):
            s = self.store
            self.worker = PublishWorker(s.address, s.token, s.retry_s, s.attempts)

    async def close(self) -> None:
        """The run is over or failed: stop publishing (what waits is dropped), end the worker."""
        await self.publisher.close()
        if self.worker is not None:
            await self.worker.close()

    def publishes(self, step: int) -> bool:
        t = self.config.trainer
        return step % t.publish_every == 0 or step == t.num_steps

    async def publish_now(
        self, state: dict[str, torch.Tensor], step: int, version: int = -1
    ) -> int:
        """Publish now, in the foreground (the base and restored weights: version -1 takes
        the next free one); the version."""
        response = await self._send(state, step, version)
        self.status.versions.append(response.version)
        return response.version

    async def base_version(self, state: dict[str, torch.Tensor]) -> int:
        """The version rollout must hold before generating for step 1, given the run's
        initial weights: 0 (the model directory itself) when the store has no version of
        this model; the latest when it holds exactly these weights; else these, published."""
        name = self.config.policy_model
        versions = await self.store.list_versions(name)
        if not versions:
            return 0
        latest = await self.store.get_manifest(name, versions[-1].version)
        ours, _ = build_manifest(name, state_dict_to_raw(state))
        if chunk_positions(latest) == chunk_positions(ours):
            return latest.version
        return await self.publish_now(state, step=0)

    async def adapter_base(self, backend: LoraBackend, r: aioredis.Redis) -> None:
        """A LoRA run's versions are adapters over its base's full weights: those published
        (or found) as a version of the model, unless other active runs of the model train on
        other weights (`BaseInUse`); recorded in every version's metadata."""
        cfg = self.config
        full = await on_torch_thread(backend.base_state_cpu)
        raw = state_dict_to_raw(full)
        if why := await claims.base_change_refused(r, self.store, cfg.model.name, raw, cfg.run_id):
            raise BaseInUse(why)
        base = await self.full_base_version(full)
        self.metadata = {**backend.publish_metadata(base), "lora_base_model": cfg.model.name}

    async def full_base_version(self, state: dict[str, torch.Tensor]) -> int:
        """A LoRA run's base: the newest full-weight version of the model if it holds exactly
        these weights, else these, published now (the store must hold the base, so that
        rollout and an export can always rebuild the full weights of an adapter version)."""
        name = self.config.model.name
        for info in reversed((await self.store.list_versions(name))[-64:]):
            manifest = await self.store.get_manifest(name, info.version)
            if lora.is_adapter(dict(manifest.metadata)):
                continue
            ours, _ = build_manifest(name, state_dict_to_raw(state))
            if chunk_positions(manifest) == chunk_positions(ours):
                return manifest.version
            break
        response = await self.store.publish(
            name,
            state_dict_to_raw(state),
            trainer_step=0,
            assets=self.assets,
            metadata={"run_id": self.config.run_id, "lora_base": "1"},
        )
        return response.version

    async def submit(self, snapshot: Snapshot, wait: bool) -> None:
        """Hand a step's weights to the background publisher; `wait`: until committed."""
        await self.publisher.submit(snapshot)
        if wait:
            await self.publisher.wait_for(snapshot.version)

    def record(self, record: StepRecord) -> None:
        """A published step's record: its publish fields are filled in once it is done."""
        self._records[record.step] = record
        self._fill(record.step)

    async def _send(
        self, state: dict[str, torch.Tensor], step: int, version: int, background: bool = False
    ) -> weights_pb2.PublishResponse:
        sender = self.worker if background and self.worker is not None else self.store
        response = await sender.publish(
            self.config.policy_model,
            state_dict_to_raw(state),
            version=version,
            trainer_step=step,
            parent_version=self.status.versions[-1] if self.status.versions else -1,
            assets=self.assets,
            metadata={
                "run_id": self.config.run_id,
                names.WEIGHTS_TENANT_KEY: self.status.tenant,
                **self.metadata,
            },
        )
        if version >= 0 and response.version != version:
            raise RuntimeError(f"published version {response.version}, wanted {version}")
        return response

    async def _publish_snapshot(self, snapshot: Snapshot) -> int:
        """The background publisher's work: one step's weights as version V0 + step."""
        with tracing.tracer().start_as_current_span("trainer.publish", context=Context()) as span:
            span.set_attributes(
                {
                    "treadle.run_id": self.config.run_id,
                    "treadle.model": self.config.policy_model,
                    "treadle.step": snapshot.step,
                    "treadle.version": snapshot.version,
                }
            )
            response = await self._send(
                snapshot.state, snapshot.step, snapshot.version, background=True
            )
        return response.bytes_received

    def _published(self, done: Published) -> None:
        self.status.versions.append(done.version)
        self.status.usage.weight_bytes_published += done.bytes_sent
        self.status.publishes_coalesced = self.publisher.coalesced
        self._done[done.step] = done
        self._fill(done.step)
        for step in [s for s in self._records if s < done.step]:  # coalesced: never published
            del self._records[step]
        tm.PUBLISH_SECONDS.labels(self.config.run_id).observe(done.publish_s)

    def _fill(self, step: int) -> None:
        """Fill in the step record's publish once both the record and the publish exist."""
        record, done = self._records.get(step), self._done.get(step)
        if record is None or done is None:
            return
        record.published = True
        record.publish_duration_s = done.publish_s
        record.publish_latency_s = done.latency_s
        record.bytes_published = done.bytes_sent
        del self._records[step], self._done[step]


async def initial_model_dir(config: RunConfig, store: WeightStoreClient, run_dir: Path) -> Path:
    """`model.path`, or `model.init_version` exported as an HF directory in the run dir."""
    m = config.model
    if m.init_version is None:
        return m.path
    out = run_dir / f"init-v{m.init_version}"
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + ".tmp")
        await export_hf(store, m.name, m.init_version, tmp)
        tmp.rename(out)
    return out
