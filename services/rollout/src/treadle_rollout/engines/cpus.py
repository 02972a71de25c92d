"""Which CPUs the engine's model work runs on, and the serving process on the others.

On a machine where the engine shares its cores with the rollout service and with what
drives it (agents, the env-gateway, a load generator), every request, event and reply
wakes a process on whatever core the scheduler picks, often the one the engine is
computing on, and the engine waits for that core back. Inference servers on CPUs dedicate
cores to the engine instead (vLLM's CPU backend binds its threads by default). Here:
`TREADLE_ROLLOUT_ENGINE_CPUS` = `auto` (the last `torch_threads` of the CPUs this process
may use, when at least one is left for serving), a list (`2,3` or `2-3`), or empty (no
binding). The engine's threads run on those CPUs, the rollout service's own threads on the
rest; nothing else is bound, so the trainer and other services still use every core.
Standard library only: `prestart` applies it before the heavy imports.
"""

from __future__ import annotations

import os


def parse(spec: str) -> set[int]:
    """`"0,2-3"` -> {0, 2, 3}."""
    cpus: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r} (e.g. 2,3 or 2-3)") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part!r} in {spec!r}")
        cpus.update(range(first, last + 1))
    return cpus


_GIVEN = sorted(os.sched_getaffinity(0))
"""The CPUs this process was started with (before it bound itself to some of them)."""


def allowed() -> list[int]:
    return list(_GIVEN)


def split(
    spec: str, threads: int, given: list[int] | None = None
) -> tuple[list[int], list[int]] | None:
    """(the engine's CPUs, serving's CPUs) for `spec` among `given` (default: this
    process's); None: no binding (empty spec, or `auto` with too few CPUs to dedicate any).
    An explicit list must be CPUs this process may use and leave at least one."""
    spec = spec.strip()
    if not spec:
        return None
    mine = sorted(given) if given is not None else allowed()
    if spec == "auto":
        count = threads or max(1, len(mine) // 2)
        if len(mine) - count < 1:
            return None
        return mine[-count:], mine[:-count]
    engine = parse(spec)
    if not engine:
        raise ValueError(f"no CPUs in {spec!r}")
    if not engine <= set(mine):
        raise ValueError(f"CPUs {sorted(engine - set(mine))} of {spec!r} are not among {mine}")
    rest = [c for c in mine if c not in engine]
    if not rest:
        raise ValueError(f"{spec!r} leaves no CPU for serving (this process may use {mine})")
    return sorted(engine), rest


def bind(cpus: list[int] | None) -> None:
    """Run the calling thread, and the threads it starts from now on, on `cpus`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
