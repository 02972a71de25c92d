"""`treadle bench weights`: weight sync through the weight-store vs a plain gRPC byte stream.

Two processes: this one (the trainer / a replica) and a server process hosting the real
WeightStore gRPC servicer plus a raw `bytes` stream service. In the same run we measure:

    publish_gbps        full publish of a state dict (hash, ask what is missing, stream, commit):
                        until the version is visible to replicas, held by the store
    publish_durable_gbps ... until the version is durable: on the store's disk as well (the
                        store writes behind, while replicas already fetch it)
    fetch_gbps          full fetch into a resident state dict, in place
    raw_grpc_gbps       the same bytes as a plain client->server gRPC stream (publish's twin)
    raw_grpc_fetch_gbps the same bytes as a plain server->client gRPC stream (fetch's twin)
    publish_ratio       raw upload time / publish time
    fetch_ratio         raw download time / fetch time
    delta_bytes_ratio   bytes sent to publish a step that changed `changed` of the tensors / full
    fanout8_fetch_gbps  aggregate rate of 8 replica processes fetching all of the new version
                        at once. Each is a running replica, warm like the single fetch's
                        client: connected, it has fetched the warm-up model and then the
                        previous version in full (its warm-up round)
    raw_disk_write_gbps the same bytes written to one file in the store's directory, like
                        `dd oflag=direct` (a publish persists every byte it receives, so on a
                        machine whose disk is slower than its loopback this bounds publish)

With `model`, the state dict is that model's own tensors (its safetensors files, as the
trainer publishes a full model) instead of `size_mb` of random ones in `num_tensors`.

Rates are gigabits per second (1e9 bit/s) of tensor bytes; each is the median of `repeats`
rounds after a warm-up round. Ratios are the median of the per-round ratios (ours and raw
measured back to back in each round, so that drifts of a shared machine cancel out).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file

from treadle_bench.harness import free_port, server_process
from treadle_common.clients.torch_weights import ChunkCache, fetch_into, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.runtime.logs import configure_logging

CHUNK = 4 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.max_receive_message_length", 64 * 2**20),
]


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes * 8 / 1e9 / seconds


def make_state(size_mb: int, num_tensors: int, model: str = "") -> dict[str, torch.Tensor]:
    """`model`'s tensors (a directory of safetensors files), or random ones."""
    if model:
        return {
            k: v for f in sorted(Path(model).glob("*.safetensors")) for k, v in load_file(f).items()
        }
    numel = size_mb * 2**20 // 4 // num_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(num_tensors)}


def warm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The small warm-up model: the first 64 Ki values of each tensor."""
    return {k: v.reshape(-1)[: 2**16].clone() for k, v in state.items()}


async def raw_rates(address: str, payload: memoryview) -> tuple[float, float]:
    """Plain gRPC streams of `payload` in 4 MiB messages: (upload s, download s)."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        upload = channel.stream_unary("/treadle.bench.Raw/Upload")
        download = channel.unary_stream("/treadle.bench.Raw/Download")

        async def pieces():
            for i in range(0, len(payload), CHUNK):
                yield bytes(payload[i : i + CHUNK])

        start = time.perf_counter()
        assert int(await upload(pieces())) == len(payload)
        up = time.perf_counter() - start
        start = time.perf_counter()
        received = 0
        async for data in download(str(len(payload)).encode()):
            received += len(data)
        down = time.perf_counter() - start
        assert received == len(payload)
    return up, down


async def raw_round(address: str, state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The raw streams of the state's bytes, joined into one buffer just before (not timed)
    and freed right after, whichever order the round takes."""
    flat = memoryview(b"".join(t.data for t in state_dict_to_raw(state).values()))
    try:
        return await raw_rates(address, flat)
    finally:
        flat.release()
        del flat


async def until_durable(client: WeightStoreClient, version: int) -> float:
    """When (perf_counter) the store reported `version` of `bench` durable."""
    while True:
        info = {v.version: v for v in await client.list_versions("bench")}[version]
        if info.durable:
            return time.perf_counter()
        await asyncio.sleep(0.005)


async def measure(address: str, state: dict, repeats: int) -> dict:
    """Median of `repeats` rounds of: raw upload + download, full publish, full fetch.

    Each round publishes new content (every tensor shifted) so every publish is a full one,
    and fetches it into a replica that holds nothing yet. The raw streams go first in even
    rounds and last in odd ones (once the version is durable): whichever runs right after
    the other finds the machine as the other left it (its memory, its caches), and
    alternating the order shares that between the two. A warm-up first: a small model
    (connections, thread pools; the fan-out replicas fetch it too), then one full round that
    is not counted (buffers at full size in both processes, as in a run's later steps).
    """
    client = WeightStoreClient(address)
    warm = warm_state(state)
    await client.publish("warmup", state_dict_to_raw(warm))
    await fetch_into(
        client, "warmup", -1, {k: torch.zeros_like(v) for k, v in warm.items()}, ChunkCache({})
    )
    await raw_rates(address, memoryview(b"".join(t.data for t in state_dict_to_raw(warm).values())))
    replica = {k: torch.zeros_like(v) for k, v in state.items()}  # resident, like a loaded model
    rounds: dict[str, list[float]] = {
        "raw_up": [],
        "raw_down": [],
        "publish": [],
        "fetch": [],
        "durable": [],
        "publish_ratio": [],
        "fetch_ratio": [],
    }
    for round_ in range(repeats + 1):
        for tensor in state.values():
            tensor.add_(1.0)
        if round_ % 2 == 0:  # raw first in even rounds, ours first in odd ones
            up_s, down_s = await raw_round(address, state)
        published_at = time.perf_counter()
        published = await client.publish("bench", state_dict_to_raw(state))
        publish_s = time.perf_counter() - published_at
        start = time.perf_counter()
        await fetch_into(client, "bench", published.version, replica, ChunkCache({}))
        fetch_s = time.perf_counter() - start
        assert all(torch.equal(replica[k], state[k]) for k in state), "fetched tensors differ"
        # the raw streams never share the machine with our disk writes: the next round, or
        # an odd round's raw streams, start once this version is on disk (written behind)
        durable_s = await until_durable(client, published.version) - published_at
        if round_ % 2 == 1:
            up_s, down_s = await raw_round(address, state)
        if round_ == 0:  # the full-size warm-up round is not counted
            continue
        values = (up_s, down_s, publish_s, fetch_s, durable_s, up_s / publish_s, down_s / fetch_s)
        for key, value in zip(rounds, values, strict=True):
            rounds[key].append(value)
    await client.close()
    return {key: statistics.median(values) for key, values in rounds.items()}


async def delta_bytes(address: str, state: dict, changed: list[str]) -> tuple[int, int]:
    """Bytes a publish sends for a step that changed `changed` tensors, and the full size."""
    client = WeightStoreClient(address)
    for name in changed:
        state[name].add_(1e-3)
    response = await client.publish("bench", state_dict_to_raw(state))
    await client.close()
    return response.bytes_received, response.version


def raw_disk_write(directory: str, num_bytes: int) -> float:
    """Seconds to write `num_bytes` to a new file in 4 MiB O_DIRECT writes (buffered where
    the filesystem has no O_DIRECT), from one page-aligned buffer."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    path = os.path.join(directory, "raw-disk")
    start = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for _ in range(num_bytes // CHUNK):
            os.write(fd, buf)
    finally:
        os.close(fd)
        elapsed = time.perf_counter() - start
        os.unlink(path)
    return elapsed


def fanout(
    address: str,
    warm_version: int,
    version: int,
    size_mb: int,
    num_tensors: int,
    replicas: int,
    rounds: int,
    model: str,
) -> float:
    """`replicas` fetcher processes, warm like the single fetch, fetch `version` together,
    `rounds` times: the median of the seconds until the last one holds it."""
    cmd = [sys.executable, "-m", "treadle_bench.weights", "--fetcher", address]
    cmd += [str(warm_version), str(version), str(size_mb), str(num_tensors), model]
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(replicas)
    ]
    for p in procs:  # each allocates its tensors and warms its client, then waits for the go
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:  # each says `done` once its tensors hold the version
            assert p.stdout is not None and p.stdout.readline().strip() == "done"
        times.append(time.perf_counter() - start)
    for p in procs:  # end of input: the replica exits (teardown is not counted)
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
        assert p.returncode == 0
    return statistics.median(times)


def fetcher_main(
    address: str, warm_version: int, version: int, size_mb: int, num_tensors: int, model: str
) -> None:
    """One replica of the fan-out, warm like the single fetch: a connected client that has
    fetched the small warm-up model and then one full version (`warm_version`) into its
    resident tensors. It says `ready`, then fetches all of `version` on each `go`."""
    state = {k: torch.zeros_like(v) for k, v in make_state(size_mb, num_tensors, model).items()}

    async def main() -> None:
        client = WeightStoreClient(address)
        warm = {k: torch.zeros_like(v) for k, v in warm_state(state).items()}
        await fetch_into(client, "warmup", -1, warm, ChunkCache({}))
        await fetch_into(client, "bench", warm_version, state, ChunkCache({}))
        print("ready", flush=True)
        while await asyncio.to_thread(sys.stdin.readline):
            await fetch_into(client, "bench", version, state, ChunkCache({}))  # all of it
            print("done", flush=True)
        await client.close()

    asyncio.run(main())


def run(
    size_mb: int = 512,
    num_tensors: int = 64,
    changed_fraction: float = 0.03,
    replicas: int = 8,
    repeats: int = 6,  # even: as many rounds with raw first as with ours first
    model: Path | None = None,
) -> dict:
    configure_logging("bench", level="WARNING")
    state = make_state(size_mb, num_tensors, str(model or ""))
    num_tensors = len(state)
    size = sum(t.numel() * t.element_size() for t in state.values())
    size_mb = round(size / 2**20)
    changed = list(state)[: max(1, round(num_tensors * changed_fraction))]
    port = free_port()
    address = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        with server_process("treadle_bench.weights_server", str(port), tmp):
            timings = asyncio.run(measure(address, state, repeats))
            sent, version = asyncio.run(delta_bytes(address, state, changed))
            fanout_s = fanout(
                address,
                version - 1,
                version,
                size_mb,
                num_tensors,
                replicas,
                repeats,
                str(model or ""),
            )
            disk_s = statistics.median(raw_disk_write(tmp, size) for _ in range(3))
    publish, fetch = gbps(size, timings["publish"]), gbps(size, timings["fetch"])
    raw_up, raw_down = gbps(size, timings["raw_up"]), gbps(size, timings["raw_down"])
    return {
        "bench": "weights",
        "model": model.name if model is not None else None,
        "size_mb": size_mb,
        "num_tensors": num_tensors,
        "repeats": repeats,
        "changed_tensors": len(changed),
        "units": "Gbit/s",
        "publish_gbps": round(publish, 3),
        "fetch_gbps": round(fetch, 3),
        "raw_grpc_gbps": round(raw_up, 3),
        "raw_grpc_fetch_gbps": round(raw_down, 3),
        "publish_ratio": round(timings["publish_ratio"], 3),
        "publish_durable_gbps": round(gbps(size, timings["durable"]), 3),
        "fetch_ratio": round(timings["fetch_ratio"], 3),
        "delta_bytes_ratio": round(sent / size, 4),
        "fanout8_fetch_gbps": round(gbps(size * replicas, fanout_s), 3),
        "fanout_replicas": replicas,
        "raw_disk_write_gbps": round(gbps(size, disk_s), 3),
    }


if __name__ == "__main__" and sys.argv[1:2] == ["--fetcher"]:
    warm_at, at, size_arg, tensors_arg = (int(arg) for arg in sys.argv[3:7])
    fetcher_main(sys.argv[2], warm_at, at, size_arg, tensors_arg, sys.argv[7])
elif __name__ == "__main__":
    print(json.dumps(run()))
    os._exit(0)
