"""`WeightStoreClient.publish` run by a child process (`PublishWorker`), so that a publish's
Python (the stream's per-chunk work, the hashing's bookkeeping, gRPC's event loop) never
holds the GIL of the process that asked for it.

A trainer on a GPU publishes each step's weights while the next step trains. Its training
thread launches kernels and takes the GIL back after each one; a publish on the same
process's event loop holds it for long stretches, and the training thread waits for every
kernel it launches (`treadle bench gil` measures it). Here the publish runs elsewhere:

    parent: the tensors and assets --copied (numpy, GIL released)--> a memfd
            --its descriptor (SCM_RIGHTS) over a Unix socket pair--> the child
    child:  maps the memfd (a JSON layout at its start, the bytes after it),
            WeightStoreClient.publish(...) --one JSON line back--> the PublishResponse
            (protobuf, base64) or the error (a gRPC status code and its details)

Nothing is pickled: the layout is JSON and the answer a protobuf. One publish at a time. A
child that dies (or is killed) mid-publish is started again and the publish sent again,
once, under the same `publish_id`: a store that committed it answers with that version.
A cancelled publish kills the child (it would answer a publish nobody waits for).
The child ends when its socket closes, so it never outlives the parent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import mmap
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
from opentelemetry import context as otel_context

from treadle_common.clients.weights import RETRY_S, RawTensor, WeightStoreClient
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger

log = get_logger(__name__)
ALIGN = 64
"""Each tensor's bytes start at a multiple of this in the memfd."""
WORKER_AVAILABLE = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
"""Linux: the weights travel in a memfd, its descriptor over a Unix socket."""
TOKEN_ENV = "TREADLE_PUBLISH_WORKER_TOKEN"
"""The child's bearer token travels in its environment, never on its command line."""


class WorkerDied(RuntimeError):
    """The publish worker ended before it answered (twice)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_payload(
    model: str,
    tensors: Mapping[str, RawTensor],
    assets: Mapping[str, bytes],
    fields: dict[str, Any],
) -> int:
    """A memfd holding `[8-byte layout length][layout JSON][bytes...]`; its descriptor. The
    copies are numpy's, which releases the GIL while it copies."""
    blobs: list[tuple[str, str, memoryview, dict[str, Any]]] = [
        ("tensors", name, t.data, {"dtype": t.dtype, "shape": list(t.shape)})
        for name, t in tensors.items()
    ] + [("assets", name, memoryview(data), {}) for name, data in assets.items()]
    layout: dict[str, Any] = {"model": model, "fields": fields, "tensors": [], "assets": []}
    offset = 0
    for kind, name, data, extra in blobs:
        layout[kind].append({"name": name, "offset": offset, "nbytes": data.nbytes, **extra})
        offset = _align(offset + data.nbytes)
    head = json.dumps(layout).encode()
    base = _align(8 + len(head))
    fd = os.memfd_create("treadle-publish", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(base + offset, 1))
        with mmap.mmap(fd, base + offset or 1) as mm:
            mm[:8] = len(head).to_bytes(8, "little")
            mm[8 : 8 + len(head)] = head
            out = np.frombuffer(mm, dtype=np.uint8)
            entries = layout["tensors"] + layout["assets"]
            for (*_, data, _), entry in zip(blobs, entries, strict=True):
                start = base + entry["offset"]
                np.copyto(out[start : start + data.nbytes], np.frombuffer(data, dtype=np.uint8))
            del out
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_payload(
    mm: mmap.mmap,
) -> tuple[str, dict[str, RawTensor], dict[str, bytes], dict[str, Any]]:
    """What `write_payload` wrote: (model, tensors as views of `mm`, assets, fields)."""
    length = int.from_bytes(mm[:8], "little")
    layout = json.loads(mm[8 : 8 + length])
    base = _align(8 + length)
    view = memoryview(mm)

    def blob(entry: dict[str, Any]) -> memoryview:
        start = base + entry["offset"]
        return view[start : start + entry["nbytes"]]

    tensors = {
        e["name"]: RawTensor(e["dtype"], tuple(e["shape"]), blob(e)) for e in layout["tensors"]
    }
    assets = {e["name"]: bytes(blob(e)) for e in layout["assets"]}
    return layout["model"], tensors, assets, layout["fields"]


class PublishWorker:
    """`publish(model, tensors, **fields)` as `WeightStoreClient.publish`, in a child."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        retry_s: float = RETRY_S,
        attempts: int | None = None,
    ):
        self.config = {"address": address, "retry_s": retry_s, "attempts": attempts}
        self.token = token
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.started = 0
        """Children started so far (a restarted one counts again)."""
        self._lock = asyncio.Lock()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        if self.token is not None:
            env[TOKEN_ENV] = self.token
        config = json.dumps({**self.config, "fd": theirs.fileno()})
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, config], pass_fds=(theirs.fileno(),), env=env
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.started += 1
        log.info("publish worker started", pid=self.proc.pid, store=self.config["address"])

    def _stop(self, kill: bool = False) -> None:
        """Close the socket (the child then ends) and reap the child."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if kill:
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    async def publish(
        self,
        model: str,
        tensors: Mapping[str, RawTensor],
        *,
        assets: Mapping[str, bytes] | None = None,
        **fields: Any,
    ) -> pb.PublishResponse:
        fields["metadata"] = {"publish_id": uuid.uuid4().hex, **fields.get("metadata", {})}
        fields["trace"] = dict(tracing.grpc_metadata())
        async with self._lock:
            fd = await _written(model, tensors, assets or {}, fields)
            try:
                for _ in range(2):  # once more after a child that died
                    reply = await self._ask(fd)
                    if reply is not None:
                        return _answer(reply)
                    self._stop(kill=True)  # the child died: reaped (then a new one, same id)
                raise WorkerDied("the publish worker died twice during one publish")
            finally:
                os.close(fd)

    async def _ask(self, fd: int) -> dict[str, Any] | None:
        """Send one publish; the child's answer, or None when it ended without one."""
        if self.sock is None:
            self._start()
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        try:
            socket.send_fds(self.sock, [b"P"], [fd])
            line = b""
            while not line.endswith(b"\n"):
                part = await loop.sock_recv(self.sock, 1 << 16)
                if not part:
                    return None
                line += part
        except (BrokenPipeError, ConnectionResetError):
            return None
        except BaseException:  # cancelled mid-publish: its answer must never be read later
            self._stop(kill=True)
            raise
        return json.loads(line)

    async def close(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._stop)


async def _written(*args: Any) -> int:
    """`write_payload` on a thread; a memfd it makes after its caller was cancelled is closed."""
    writing = asyncio.ensure_future(asyncio.to_thread(write_payload, *args))
    try:
        return await asyncio.shield(writing)
    except asyncio.CancelledError:
        writing.add_done_callback(_close_written)
        raise


def _close_written(done: asyncio.Future[int]) -> None:
    if not done.cancelled() and done.exception() is None:
        os.close(done.result())


def _answer(reply: dict[str, Any]) -> pb.PublishResponse:
    if "response" in reply:
        return pb.PublishResponse.FromString(base64.b64decode(reply["response"]))
    code = getattr(grpc.StatusCode, reply.get("code") or "", None)
    if code is None:
        raise RuntimeError(f"publish worker: {reply['error']}")
    raise grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=reply["error"]
    )


# --- the child ---------------------------------------------------------------------------------
async def _serve(config: dict[str, Any]) -> None:
    sock = socket.socket(fileno=config["fd"])
    client = WeightStoreClient(
        config["address"],
        attempts=config["attempts"],
        retry_s=config["retry_s"],
        token=os.environ.get(TOKEN_ENV),
    )
    try:
        while True:
            msg, fds, _, _ = await asyncio.to_thread(socket.recv_fds, sock, 16, 1)
            if not msg or not fds:
                return  # the parent closed the socket (or died)
            try:
                reply = await _publish_one(client, fds[0])
            finally:
                for fd in fds:
                    os.close(fd)
            sock.sendall(json.dumps(reply).encode() + b"\n")
    finally:
        await client.close()
        sock.close()


async def _publish_one(client: WeightStoreClient, fd: int) -> dict[str, Any]:
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        model, tensors, assets, fields = read_payload(mm)
        # the caller's trace goes on: the store's span is a child of the trainer's publish
        token = otel_context.attach(tracing.from_grpc(fields.pop("trace", {}).items()))
        try:
            response = await client.publish(model, tensors, assets=assets, **fields)
            return {"response": base64.b64encode(response.SerializeToString()).decode()}
        except grpc.aio.AioRpcError as exc:
            return {"error": exc.details() or str(exc.code()), "code": exc.code().name}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            otel_context.detach(token)
            del tensors  # the views of `mm` go before it closes
    finally:
        with contextlib.suppress(BufferError):  # a view still held: the collector unmaps it
            mm.close()


def main() -> None:
    asyncio.run(_serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
