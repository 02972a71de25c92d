"""`treadle bench overlap`: what a background publish costs a training thread that launches
small operations one after another, as a trainer's thread launching a step's CUDA kernels does.

A trainer on a GPU publishes each step's weights while the next step trains. Both are in one
process, and every operation the training thread launches gives the GIL up and must take it
back; a publish on the process's event loop holds it for long stretches. This bench measures
the training thread's operations per second three ways, in alternating phases of `seconds`
each, `rounds` times:

- `alone`: nothing else runs (the baseline);
- `inline`: the event loop publishes the state dict to a real weight-store again and again,
  as `trainer_publish_worker=never` does (`WeightStoreClient.publish`);
- `worker`: the same publishes from a child process (`PublishWorker`, what `auto` does on an
  accelerator); this process only copies each state into shared memory.

The training loop is a 30-layer, 64-wide MLP's forward, backward and SGD step, on `device`
(the CPU by default, where each operation takes microseconds, like a kernel launch). Where
the machine has more than one CPU the training thread runs on a CPU of its own and the rest
(this process's other threads, the weight-store, the worker) on the others, so what slows it
is the GIL, not a shared core. Each publish changes every tensor (a step's update).
`inline_over_alone` and `worker_over_alone` are the medians over rounds of each phase's rate
over the alone phase's of the same round.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from treadle_bench.harness import infra_with_weight_store
from treadle_bench.weights import make_state
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.clients.weights_worker import PublishWorker
from treadle_common.runtime.logs import configure_logging

PHASES = ("alone", "inline", "worker")


class Launcher(threading.Thread):
    """The training thread: small operations back to back; `iterations` counts them."""

    def __init__(self, device: str, cpu: int | None):
        super().__init__(daemon=True, name="launcher")
        self.device, self.cpu = device, cpu
        self.iterations = 0
        self.stop = False
        self.ready = threading.Event()

    def run(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})
        torch.set_num_threads(1)  # this thread's own OpenMP team: one thread, on its CPU
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(30)]
        model = torch.nn.Sequential(*layers).to(self.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(8, 64, device=self.device)
        self.ready.set()
        while not self.stop:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.iterations += 1
            if self.device != "cpu" and self.iterations % 64 == 0:
                torch.cuda.synchronize()  # launches stay at most 64 iterations ahead


def run(
    seconds: float = 10.0,
    rounds: int = 3,
    size_mb: int = 513,
    num_tensors: int = 273,
    model: Path | None = None,
    device: str = "cpu",
) -> dict:
    configure_logging("bench", level="WARNING")
    cpus = sorted(os.sched_getaffinity(0))
    own = cpus[0] if len(cpus) > 1 else None
    rest = set(cpus[1:]) or set(cpus)
    state = make_state(size_mb, num_tensors, str(model or ""))
    with (
        tempfile.TemporaryDirectory() as tmp,
        infra_with_weight_store(Path(tmp)) as (
            _,
            env,
            procs,
        ),
    ):
        for proc in procs:  # the weight-store and the infra off the training thread's CPU
            _pin(proc.pid, rest)
        launcher = Launcher(device, own)
        # this thread and what it starts from now on (the hashing threads, the worker)
        os.sched_setaffinity(0, rest)
        launcher.start()
        try:
            launcher.ready.wait()
            address = env["TREADLE_WEIGHT_STORE_ADDR"]
            rates = asyncio.run(_measure(address, state, launcher, seconds, rounds))
        finally:  # stopped (Ctrl-C, SIGTERM) or done: the thread ends before the stack does
            launcher.stop = True
            launcher.join()
    return _report(rates, seconds, rounds, state, device, own is not None, model)


async def _measure(
    address: str,
    state: dict[str, torch.Tensor],
    launcher: Launcher,
    seconds: float,
    rounds: int,
) -> dict[str, list[dict[str, float]]]:
    store = WeightStoreClient(address)
    worker = PublishWorker(address)
    raw = state_dict_to_raw(state)
    out: dict[str, list[dict[str, float]]] = {p: [] for p in PHASES}
    try:
        await worker.publish("overlap", raw)  # the worker started, the store warm
        for _ in range(rounds):
            for phase in PHASES:
                out[phase].append(await _phase(phase, store, worker, state, launcher, seconds))
    finally:
        await worker.close()
        await store.close()
    return out


async def _phase(
    phase: str,
    store: WeightStoreClient,
    worker: PublishWorker,
    state: dict[str, torch.Tensor],
    launcher: Launcher,
    seconds: float,
) -> dict[str, float]:
    start, first = time.perf_counter(), launcher.iterations
    publishes: list[float] = []
    while time.perf_counter() - start < seconds:
        if phase == "alone":
            await asyncio.sleep(0.1)
            continue
        for tensor in state.values():  # a step's update changes every tensor
            tensor.add_(1e-3)
        sender = store if phase == "inline" else worker
        began = time.perf_counter()
        await sender.publish("overlap", state_dict_to_raw(state))
        publishes.append(time.perf_counter() - began)
    elapsed = time.perf_counter() - start
    return {
        "iterations_per_s": (launcher.iterations - first) / elapsed,
        "publishes": len(publishes),
        "publish_s_p50": statistics.median(publishes) if publishes else 0.0,
    }


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus`."""
    spec = ",".join(map(str, sorted(cpus)))
    subprocess.run(["taskset", "-a", "-p", "-c", spec, str(pid)], capture_output=True, check=False)


def _report(
    rates: dict[str, list[dict[str, float]]],
    seconds: float,
    rounds: int,
    state: dict[str, torch.Tensor],
    device: str,
    pinned: bool,
    model: Path | None,
) -> dict:
    alone = [r["iterations_per_s"] for r in rates["alone"]]
    report: dict = {
        "bench": "overlap",
        "device": device,
        "model": model.name if model is not None else None,
        "state_mb": round(sum(t.numel() * t.element_size() for t in state.values()) / 2**20, 1),
        "tensors": len(state),
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "training_thread_pinned": pinned,
        "alone_iterations_per_s": round(statistics.median(alone), 1),
    }
    for phase in PHASES[1:]:
        mine = rates[phase]
        report |= {
            f"{phase}_iterations_per_s": round(
                statistics.median(r["iterations_per_s"] for r in mine), 1
            ),
            f"{phase}_over_alone": round(
                statistics.median(
                    r["iterations_per_s"] / a for r, a in zip(mine, alone, strict=True)
                ),
                3,
            ),
            f"{phase}_publishes": sum(int(r["publishes"]) for r in mine),
            f"{phase}_publish_s_p50": round(statistics.median(r["publish_s_p50"] for r in mine), 3),
        }
    return report
