"""Weight-store service: wires the store, the gRPC servicer, the HTTP mirror and announcements.

trainer --Publish(stream chunks + manifest)--> WeightStoreServicer --commit--> WeightStore
                                                    |                    (cache, pins, GC)
                                                    |                          |
                                                    |                 backends/{local,s3}
                                                    +--announce--> JetStream treadle.weights.{model}
rollout <--Fetch(manifest + missing chunks)--------+
"""

from __future__ import annotations

import asyncio

from treadle_common import names
from treadle_common.clients.weights import ensure_weights_stream
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.service import Service, ServiceRuntime
from treadle_weight_store import http
from treadle_weight_store.backends import make_backend
from treadle_weight_store.errors import StoreError
from treadle_weight_store.grpc import POLICY, SERVICE, WeightStoreServicer, add_to_server
from treadle_weight_store.settings import WeightStoreSettings
from treadle_weight_store.store import WeightStore

GC_INTERVAL_S = 60.0
log = get_logger(__name__)


def make_store(settings: WeightStoreSettings) -> WeightStore:
    backend = make_backend(
        settings.weight_store_backend,
        root=settings.weight_store_dir or settings.state_dir / "weights",
        endpoint=settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        bucket=settings.weight_store_bucket,
        secure=settings.s3_secure,
    )
    return WeightStore(
        backend,
        cache_bytes=settings.weight_store_cache_mb * 2**20,
        keep_last=settings.weight_store_keep_last,
        gc_grace_s=settings.weight_store_gc_grace_s,
        max_dirty_bytes=settings.weight_store_dirty_mb * 2**20,
    )


async def build(settings: WeightStoreSettings) -> Service:
    runtime = ServiceRuntime(SERVICE, settings)
    store = make_store(settings)
    grpc_addr = f"{settings.host}:{settings.port(SERVICE, 'grpc')}"
    stream_ready = False

    async def announce(manifest: pb.WeightManifest) -> None:
        nonlocal stream_ready
        js = (await runtime.wait_nats()).jetstream()
        if not stream_ready:
            await ensure_weights_stream(js)
            stream_ready = True
        message = pb.WeightAnnouncement(
            model=manifest.model,
            version=manifest.version,
            trainer_step=manifest.trainer_step,
            store_address=grpc_addr,
        )
        try:
            await js.publish(names.weights_subject(manifest.model), message.SerializeToString())
        except Exception:
            stream_ready = False  # a NATS that restarted without the stream: made again next try
            raise

    servicer = WeightStoreServicer(store, announce, settings.tenant_max_stored_bytes)
    add_to_server(servicer, runtime.make_grpc_server(POLICY))
    runtime.on_drain(servicer.drain)  # SIGTERM: versions written behind reach the backend
    runtime.set_info(
        lambda: {
            "grpc": grpc_addr,
            "backend": store.backend.name,
            "cache_mb": round(store.cache.num_bytes / 2**20, 1),
            "dirty_mb": round(store.dirty_bytes() / 2**20, 1),
            "persist_error": store.persist_error,
            "readers": store.readers(),
        }
    )
    runtime.app.state.store, runtime.app.state.tenancy = store, servicer.tenancy
    runtime.app.include_router(http.router)
    return Service(runtime, loops=[lambda: gc_loop(runtime, store)])


async def gc_loop(runtime: ServiceRuntime, store: WeightStore) -> None:
    while not runtime.stop_event.is_set():
        await asyncio.sleep(GC_INTERVAL_S)
        try:
            await store.gc()
        except StoreError as exc:  # a backend hiccup: report it, try again next round
            log.error("gc failed", error=str(exc))
