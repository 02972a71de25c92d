"""The hf engine in its own process (`ProcessEngine`): the same generations as in-process,
streams, cancellation, errors, adapters and counters across the socket, and what happens
when either process dies."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from prometheus_client import REGISTRY

from treadle_common.model import lora
from treadle_rollout.engines.base import ContextOverflow, Sampling
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.engines.process import EngineProcessGone, ProcessEngine

pytestmark = pytest.mark.unit


@pytest.fixture
async def engine(tiny_model):
    e = ProcessEngine(tiny_model, "tiny", {"torch_threads": 1, "log_level": "WARNING"})
    await e.start()
    yield e
    await e.close()


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_generations_equal_the_engine_in_this_process(engine, tiny_model):
    local = HFEngine(tiny_model, "tiny")
    prompts = [engine.tokenizer(f"{i}+{i * 3}= what " * (1 + i % 3))["input_ids"] for i in range(4)]
    sampling = [Sampling(0.8, 1.0, 10 + i, seed=i + 1, top_logprobs=2) for i in range(4)]
    pairs = zip(prompts, sampling, strict=True)
    remote = await asyncio.gather(*(engine.generate(p, s) for p, s in pairs))
    for prompt, s, gen in zip(prompts, sampling, remote, strict=True):
        alone = await local.generate(prompt, s)
        assert gen.tokens == alone.tokens and gen.finish_reason == alone.finish_reason
        assert gen.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert gen.versions == alone.versions == [0] * len(gen.tokens)
        assert [[t for t, _ in k] for k in gen.top_logprobs] == [
            [t for t, _ in k] for k in alone.top_logprobs
        ]
    await local.close()


async def long_run(tiny_model, prompt: list[int]) -> tuple[int, int]:
    """A seed whose generation of `prompt` runs long (found on an engine in this process),
    and its length."""
    local = HFEngine(tiny_model, "tiny")
    runs = await asyncio.gather(
        *(local.generate(prompt, Sampling(1.0, 1.0, 1000, seed=s)) for s in range(12))
    )
    await local.close()
    length, seed = max((len(g.tokens), s) for s, g in enumerate(runs))
    assert length >= 300
    return length, seed


def tokens_counted() -> float:
    return REGISTRY.get_sample_value("treadle_rollout_tokens_total") or 0.0


async def test_a_stream_arrives_in_pieces_and_closing_it_cancels_the_request(engine, tiny_model):
    prompt = engine.tokenizer("stream me")["input_ids"]
    sampling = Sampling(1.0, 1.0, 12, seed=4, top_logprobs=2)
    whole = await engine.generate(prompt, sampling)
    pieces = [piece async for piece in engine.stream(prompt, sampling)]
    assert len(pieces) > 1 and all(not p.finish_reason for p in pieces[:-1])
    assert pieces[-1].finish_reason == whole.finish_reason
    assert [t for p in pieces for t in p.tokens] == whole.tokens
    assert [len(t) for p in pieces for t in p.top_logprobs] == [2] * len(whole.tokens)

    length, seed = await long_run(tiny_model, prompt)
    for cancel_by in ("closing the stream", "cancelling the caller"):
        before = tokens_counted()
        if cancel_by == "closing the stream":
            stream = engine.stream(prompt, Sampling(1.0, 1.0, 1000, seed=seed))
            await anext(stream)
            assert engine.running == 1
            await stream.aclose()  # the client went away
        else:
            task = asyncio.create_task(engine.generate(prompt, Sampling(1.0, 1.0, 1000, seed=seed)))
            await wait_for(lambda b=before: tokens_counted() > b)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert engine.running == 0
        await asyncio.sleep(1.0)  # the engine process stopped the row: its tokens stopped
        assert tokens_counted() - before < length / 2, cancel_by


async def test_errors_cross_as_their_kind_and_the_engine_stays_up(engine):
    too_long = list(range(5, 5 + engine.max_context))
    with pytest.raises(ContextOverflow):
        await engine.generate(too_long, Sampling(max_new_tokens=4))
    bad = lora.AdapterConfig(rank=2, targets=("q_proj",))
    with pytest.raises(ValueError):  # tensors that fit no layer of the model
        await engine.load_adapter("broken", {"nowhere.lora_A": torch.zeros(2, 4)}, bad)
    gen = await engine.generate(engine.tokenizer("still here")["input_ids"], Sampling(seed=1))
    assert gen.tokens


async def test_an_adapter_loaded_across_the_socket_changes_what_its_requests_sample(
    engine, tiny_model
):
    local = HFEngine(tiny_model, "tiny")
    config = lora.AdapterConfig(rank=4, alpha=8.0, targets=lora.ATTENTION + lora.MLP)
    lora.inject(local.model, config.targets)
    params = lora.add_adapter(local.model, "probe", config)
    with torch.no_grad():  # (adapter_state copies: the parameters themselves, B = 0 fresh)
        for p in params:
            p.normal_(0, 0.3)
    tensors = {k: v.detach().clone() for k, v in lora.adapter_state(local.model, "probe").items()}
    await engine.load_adapter("probe", tensors, config)
    assert engine.adapters() == ["probe"]
    await local.load_adapter("probe", tensors, config)
    prompt = engine.tokenizer("adapt")["input_ids"]
    sampling = Sampling(0.0, 1.0, 8, adapter="probe")
    adapted = await engine.generate(prompt, sampling)
    assert adapted.tokens == (await local.generate(prompt, sampling)).tokens
    plain = await engine.generate(prompt, Sampling(0.0, 1.0, 8))
    assert adapted.logprobs != pytest.approx(plain.logprobs, abs=1e-3)  # it changed them
    await engine.unload_adapter("probe")
    assert engine.adapters() == []
    await local.close()


async def test_runs_adapters_share_a_batch_and_tag_tokens_with_their_own_versions(
    engine, tiny_model
):
    """Many runs, one engine: two LoRA runs' policies loaded as adapters with their versions
    (3 and 7) sample in the same batches as the engine's own policy (version 0); each row's
    tokens carry its run's version, and a reload moves only that run's."""
    local = HFEngine(tiny_model, "tiny")
    config = lora.AdapterConfig(rank=4, alpha=8.0, targets=lora.ATTENTION + lora.MLP)
    lora.inject(local.model, config.targets)
    tensors = {}
    for name in ("tiny.ra", "tiny.rb"):
        params = lora.add_adapter(local.model, name, config)  # B = 0: give it an effect
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.3)
        tensors[name] = {
            k: v.detach().clone() for k, v in lora.adapter_state(local.model, name).items()
        }
    await engine.load_adapter("tiny.ra", tensors["tiny.ra"], config, version=3)
    await engine.load_adapter("tiny.rb", tensors["tiny.rb"], config, version=7)
    prompt = engine.tokenizer("runs")["input_ids"]
    rows = [Sampling(0.0, 1.0, 6, adapter=a) for a in ("tiny.ra", "tiny.rb", None)] * 3
    gens = await asyncio.gather(*(engine.generate(prompt, s) for s in rows))
    for s, gen in zip(rows, gens, strict=True):
        want = {"tiny.ra": 3, "tiny.rb": 7, None: 0}[s.adapter]
        assert gen.versions == [want] * len(gen.tokens), (s.adapter, gen.versions)
    assert gens[0].logprobs != pytest.approx(gens[1].logprobs, abs=1e-3)  # their own adapters
    await engine.load_adapter("tiny.ra", tensors["tiny.ra"], config, version=4)
    again = await asyncio.gather(*(engine.generate(prompt, s) for s in rows[:2]))
    assert [g.versions[0] for g in again] == [4, 7]
    await local.close()


async def test_the_engine_counters_reach_this_process_metrics(engine):
    before = tokens_counted()
    gen = await engine.generate(engine.tokenizer("count")["input_ids"], Sampling(seed=2))
    await wait_for(lambda: tokens_counted() >= before + len(gen.tokens))
    await wait_for(lambda: engine.busy_seconds() > 0)
    assert engine.busy_fraction() > 0 and engine.stats()["prefix_cache_entries"] >= 1


async def test_a_killed_engine_process_fails_its_requests_and_watch_raises(tiny_model):
    engine = ProcessEngine(tiny_model, "tiny", {"torch_threads": 1})
    await engine.start()
    watch = asyncio.create_task(engine.watch())
    prompt = engine.tokenizer("doomed")["input_ids"]
    _, seed = await long_run(tiny_model, prompt)
    stream = engine.stream(prompt, Sampling(1.0, 1.0, 1000, seed=seed))
    await anext(stream)
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessGone):
        async for _ in stream:
            pass
    with pytest.raises(EngineProcessGone):
        await watch
    with pytest.raises(EngineProcessGone):
        await engine.generate(prompt, Sampling())
    await engine.close()


async def test_the_engine_process_exits_when_the_service_side_closes(tiny_model):
    engine = ProcessEngine(tiny_model, "tiny", {"torch_threads": 1})
    await engine.start()
    assert engine._proc is not None
    os.kill(engine._proc.pid, signal.SIGTERM)  # ignored: the service drains through it
    gen = await engine.generate(engine.tokenizer("after term")["input_ids"], Sampling(seed=1))
    assert gen.tokens
    watch = asyncio.create_task(engine.watch())
    await engine.close()
    await watch  # closed by us: no error
    assert engine._proc.returncode == 0


async def test_a_prestarted_engine_process_is_taken_by_the_engine_with_its_options(tiny_model):
    """`__main__` starts the engine process before the service's imports; the engine with
    the same options takes it, and one started with other options is let go (it exits)."""
    from treadle_rollout.engines import prestart

    options = {"model_dir": str(tiny_model), "model_name": "tiny", "torch_threads": 1}
    prestart.prestart({**options, "max_batch": 3})
    assert prestart._started is not None
    stray = prestart._started[1]
    assert prestart.take(options) is None
    assert stray.wait(timeout=60) == 0  # its socket closed: it exited
    prestart.prestart(options)  # as `__main__` does it
    assert prestart._started is not None
    taken = prestart._started[1]
    engine = ProcessEngine(tiny_model, "tiny", options)
    await engine.start()
    assert engine.pid == taken.pid and prestart._started is None
    gen = await engine.generate(engine.tokenizer("prestarted")["input_ids"], Sampling(seed=1))
    assert gen.tokens
    await engine.close()


def test_engine_cpus_are_parsed_and_split_from_the_serving_ones():
    from treadle_rollout.engines import cpus

    assert cpus.parse("0, 2-3,5") == {0, 2, 3, 5}
    assert cpus.split("", 1, [0, 1]) is None  # no binding
    assert cpus.split("auto", 1, [0, 1]) == ([1], [0])
    assert cpus.split("auto", 2, [0, 1, 2, 3]) == ([2, 3], [0, 1])
    assert cpus.split("auto", 0, [0, 1, 2, 3]) == ([2, 3], [0, 1])  # half, as torch threads
    assert cpus.split("auto", 2, [0, 1]) is None  # nothing would be left to serve
    assert cpus.split("0,2", 2, [0, 1, 2, 3]) == ([0, 2], [1, 3])
    for bad, says in (
        ("7", "not among"),
        ("0-3", "leaves no CPU"),
        ("x", "not a CPU list"),
        ("3-1", "not a CPU range"),
    ):
        with pytest.raises(ValueError, match=says):
            cpus.split(bad, 1, [0, 1, 2, 3])


def thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid` and the CPUs it may run on."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to dedicate one")
async def test_the_engine_process_computes_on_its_cpus_only(tiny_model):
    engine_cpu = max(os.sched_getaffinity(0))
    e = ProcessEngine(
        tiny_model, "tiny", {"torch_threads": 1, "log_level": "WARNING", "cpus": [engine_cpu]}
    )
    await e.start()
    try:
        gen = await e.generate([1, 2, 3], Sampling(1.0, 1.0, 4, seed=1))
        assert len(gen.tokens) == 4
        assert e._proc is not None
        threads = thread_cpus(e._proc.pid)
        assert len(threads) >= 2  # the event loop and the engine's thread at least
        assert all(c == {engine_cpu} for c in threads.values()), threads
    finally:
        await e.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to dedicate one")
async def test_an_in_process_engine_computes_on_its_cpus_and_leaves_the_callers(tiny_model):
    engine_cpu = max(os.sched_getaffinity(0))
    before = thread_cpus(os.getpid())
    e = HFEngine(tiny_model, "tiny", cpus=[engine_cpu])
    try:
        await e.generate([1, 2, 3], Sampling(1.0, 1.0, 4, seed=1))
        after = thread_cpus(os.getpid())
        new = {tid: c for tid, c in after.items() if tid not in before}
        assert {engine_cpu} in new.values(), new  # the engine's thread
        assert os.sched_getaffinity(0) == before[os.getpid()]  # this thread: as it was
    finally:
        await e.close()
