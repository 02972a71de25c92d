"""The hf engine: continuous batching, exact logprobs, weight swaps at step boundaries."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

from tests.support.reference import teacher_forced_logprobs
from tests.unit.rollout.test_episodes import ScriptedEnv, ScriptedReward, task
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import FetchResult, build_manifest
from treadle_common.model import lora
from treadle_rollout.engines.base import ContextOverflow, Sampling
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.episodes import EpisodeRunner

pytestmark = pytest.mark.unit


def new_weights(engine: HFEngine, version: int, scale: float = 3.0):
    """A FetchResult for `version`: the engine's weights with a sharper final norm, and the
    model that holds exactly those weights (the reference)."""
    model = copy.deepcopy(engine.model)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    manifest, chunks = build_manifest(
        engine.model_name, state_dict_to_raw(model.state_dict()), version=version
    )
    fetched = FetchResult(manifest, {h: bytes(v) for h, v in chunks.items()}, 0)
    return fetched, model


@pytest.fixture
async def engine(tiny_model):
    e = HFEngine(tiny_model, "tiny")
    yield e
    await e.close()


async def test_requests_join_between_decode_steps_with_exact_logprobs(engine):
    tok = engine.tokenizer
    prompts = [tok(f"{i}+{i * 7}= what " * (1 + i % 3))["input_ids"] for i in range(6)]

    async def one(i: int):
        await asyncio.sleep(0.02 * i)  # later requests join a batch that is mid-decode
        return await engine.generate(prompts[i], Sampling(0.7, 1.0, 12 + i, seed=i))

    gens = await asyncio.gather(*(one(i) for i in range(6)))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.tokens) == len(gen.logprobs) == len(gen.versions) > 0
        reference = teacher_forced_logprobs(engine.model, prompt, gen.tokens, temperature=0.7)
        assert gen.logprobs == pytest.approx(reference, abs=1e-4)
    alone = await engine.generate(prompts[2], Sampling(0.7, 1.0, 14, seed=2))
    assert alone.tokens == gens[2].tokens  # the seed decides, not the batch


async def test_prompt_longer_than_context_is_refused(tiny_model):
    engine = HFEngine(tiny_model, "tiny", max_context=32)
    with pytest.raises(ContextOverflow):
        await engine.generate(list(range(5, 40)), Sampling(max_new_tokens=4))
    engine.eos_id = -1  # the random tiny model may sample end-of-text; only the context ends it
    gen = await engine.generate(list(range(5, 25)), Sampling(max_new_tokens=50))
    assert gen.finish_reason == "length" and 20 + len(gen.tokens) <= 32
    await engine.close()


async def test_trajectory_carries_two_versions_after_a_mid_episode_swap(engine):
    base_model = copy.deepcopy(engine.model)
    fetched, new_model = new_weights(engine, version=1)

    class SwapAfterFirstTurn(ScriptedEnv):
        async def step(self, session_id, text, close_when_done=False):
            if not self.steps:
                assert await engine.swap(fetched) >= 0
            return await super().step(session_id, text)

    runner = EpisodeRunner(engine, engine.tokenizer, SwapAfterFirstTurn(), ScriptedReward(), "r")
    t = task()
    t.sampling.max_new_tokens = 6
    traj = await runner.run(t, 0)
    assert traj.num_turns == 2
    tokens, mask, versions = list(traj.tokens), list(traj.loss_mask), list(traj.token_versions)
    assert {v for v, m in zip(versions, mask, strict=True) if m} == {0, 1}
    for version, model in {0: base_model, 1: new_model}.items():
        turn = [i for i, v in enumerate(versions) if v == version and mask[i]]
        assert turn == list(range(turn[0], turn[0] + len(turn)))  # one whole turn per version
        reference = teacher_forced_logprobs(
            model, tokens[: turn[0]], tokens[turn[0] : turn[-1] + 1]
        )
        assert [traj.logprobs[i] for i in turn] == pytest.approx(reference, abs=1e-4)


async def generate_with_swap_midway(engine: HFEngine):
    fetched, _ = new_weights(engine, version=5)
    prompt = engine.tokenizer("1+2= what is the answer")["input_ids"]
    eos = engine.eos_id
    engine.eos_id = -1  # never stop early: the swap must land mid-turn
    job = asyncio.create_task(engine.generate(prompt, Sampling(1.0, 1.0, 40, seed=3)))
    while not engine._batch.seqs or len(engine._batch.seqs[0].tokens) < 5:
        await asyncio.sleep(0.001)
    pause_s = await engine.swap(fetched)
    gen = await job
    engine.eos_id = eos
    return gen, pause_s


async def test_continue_policy_keeps_the_turn_across_versions(engine):
    gen, pause_s = await generate_with_swap_midway(engine)
    assert pause_s >= 0 and len(gen.tokens) == 40
    assert gen.versions[0] == 0 and gen.versions[-1] == 5
    assert gen.versions == sorted(gen.versions)  # old tokens first, then new ones


async def test_abort_policy_regenerates_the_turn(tiny_model):
    engine = HFEngine(tiny_model, "tiny", swap_policy="abort")
    gen, _ = await generate_with_swap_midway(engine)
    assert set(gen.versions) == {5} and len(gen.tokens) == 40
    assert engine.restarted_turns == 1
    await engine.close()


async def test_next_turn_reuses_the_cached_prefix_with_exact_logprobs(engine):
    tok = engine.tokenizer
    prompt = tok("I am thinking of a number from 1 to 100. Guess it; answer with one number.")[
        "input_ids"
    ]
    first = await engine.generate(prompt, Sampling(1.0, 1.0, 8, seed=1))
    reply = tok(" Lower. Guess again.", add_special_tokens=False)["input_ids"]
    second_prompt = prompt + first.tokens + reply
    hits_before = engine.prefixes.hit_tokens
    second = await engine.generate(second_prompt, Sampling(1.0, 1.0, 8, seed=2))
    # everything the first turn fed to the model is reused: its prompt and all generated
    # tokens but the last one (sampled, never fed)
    assert engine.prefixes.hit_tokens - hits_before == len(prompt) + len(first.tokens) - 1
    reference = teacher_forced_logprobs(engine.model, second_prompt, second.tokens)
    assert second.logprobs == pytest.approx(reference, abs=1e-4)
    assert len(engine.prefixes) == 1  # the second turn's entry replaced the first's


async def test_a_prompt_the_prefix_cache_holds_joins_a_decode_step_with_no_prefill(engine):
    """A prompt whose KV is cached but for its last token joins the running batch with that
    KV and feeds the token in the next decode step, beside rows mid-decode and a fresh
    prompt that does need a prefill."""
    tok = engine.tokenizer
    prompts = [tok(f"say {i} again and again " * (1 + i))["input_ids"] for i in range(3)]
    fresh = tok("a prompt nobody has seen")["input_ids"]
    first = await asyncio.gather(
        *(engine.generate(p, Sampling(1.0, 1.0, 6, seed=i)) for i, p in enumerate(prompts))
    )
    before = engine.stats()

    async def later(prompt: list[int], seed: int):
        await asyncio.sleep(0.02)  # the long generation below is mid-decode by then
        return await engine.generate(prompt, Sampling(1.0, 1.0, 6, seed=seed))

    long, fresh_gen, *gens = await asyncio.gather(
        engine.generate(fresh + fresh, Sampling(1.0, 1.0, 40, seed=7)),
        later(fresh, 8),
        *(later(p, i) for i, p in enumerate(prompts)),
    )
    after = engine.stats()
    assert after["folded_joins"] - before["folded_joins"] == 3
    # the long request's and the fresh prompt's prefills: none for the cached ones
    assert after["prefill_forwards"] - before["prefill_forwards"] <= 2
    for prompt, gen, earlier in zip(prompts, gens, first, strict=True):
        assert gen.tokens == earlier.tokens  # the seed decides, not where the KV came from
        reference = teacher_forced_logprobs(engine.model, prompt, gen.tokens, temperature=1.0)
        assert gen.logprobs == pytest.approx(reference, abs=1e-4)
    for prompt, gen in ((fresh + fresh, long), (fresh, fresh_gen)):
        reference = teacher_forced_logprobs(engine.model, prompt, gen.tokens, temperature=1.0)
        assert gen.logprobs == pytest.approx(reference, abs=1e-4)


async def test_a_streams_interval_starts_once_its_tokens_form_text(engine):
    """A first token that is part of a character shows the client nothing: the engine
    reports every step until the tokens form some text, and only then waits its interval
    (60 s here: nothing more until the end)."""
    tok = engine.tokenizer
    prompt = tok("stream me something")["input_ids"]

    def forms_text(tokens: list[int]) -> bool:
        return bool(tok.decode(tokens, skip_special_tokens=True).rstrip("\ufffd"))

    waited = 0
    for seed in range(12):
        sampling = Sampling(1.0, 1.0, 10, seed=seed, stream_interval_s=60.0)
        pieces = [p async for p in engine.stream(prompt, sampling)]
        assert pieces[-1].finish_reason and not any(p.finish_reason for p in pieces[:-1])
        early, tokens = pieces[:-1], []
        for k, piece in enumerate(early):
            tokens += piece.tokens
            assert forms_text(tokens) == (k == len(early) - 1), (seed, k, tokens)
        waited += len(early) > 1
    assert waited  # some first tokens did not form text on their own


async def test_siblings_and_batch_mates_share_a_prompt_prefix(engine):
    tok = engine.tokenizer
    shared = tok("Solve: 12 + 30 = ? Think, then answer with one number only please.")["input_ids"]
    await engine.generate(shared, Sampling(1.0, 1.0, 4, seed=0))
    prompts = [shared + tok(f" try {i}", add_special_tokens=False)["input_ids"] for i in range(3)]
    prompts.append(tok("a prompt that shares nothing with the others")["input_ids"])
    hits_before = engine.prefixes.hit_tokens
    gens = await asyncio.gather(
        *(engine.generate(p, Sampling(0.8, 1.0, 6, seed=i)) for i, p in enumerate(prompts))
    )
    assert engine.prefixes.hit_tokens - hits_before == 3 * len(shared)
    for prompt, gen in zip(prompts, gens, strict=True):  # reused and fresh rows in one prefill
        reference = teacher_forced_logprobs(engine.model, prompt, gen.tokens, temperature=0.8)
        assert gen.logprobs == pytest.approx(reference, abs=1e-4)


async def test_a_groups_shared_prompt_is_prefilled_once_and_each_samples_on_its_own(engine):
    from treadle_rollout import metrics

    tok = engine.tokenizer
    group = tok("Solve: 17 + 25 = ? Answer with one number.")["input_ids"]
    other = tok("something else entirely")["input_ids"]
    prefilled = metrics.PREFILL_TOKENS._value.get()
    requests = [(group, seed) for seed in range(1, 6)] + [(other, 9)]
    gens = await asyncio.gather(
        *(engine.generate(p, Sampling(1.0, 1.0, 6, seed=s, last_turn=True)) for p, s in requests)
    )
    assert metrics.PREFILL_TOKENS._value.get() - prefilled == len(group) + len(other)
    assert len(engine.prefixes) == 0  # last turns: nothing kept for reuse
    assert len({tuple(g.tokens) for g in gens[:5]}) > 1  # one prefill, five samples
    for (prompt, seed), gen in zip(requests, gens, strict=True):
        reference = teacher_forced_logprobs(engine.model, prompt, gen.tokens, temperature=1.0)
        assert gen.logprobs == pytest.approx(reference, abs=1e-4)
        alone = await engine.generate(prompt, Sampling(1.0, 1.0, 6, seed=seed, last_turn=True))
        assert alone.tokens == gen.tokens  # the seed decides, not the batch


@pytest.mark.parametrize("policy", ["continue", "abort"])
async def test_a_swap_clears_the_prefix_cache(tiny_model, policy):
    engine = HFEngine(tiny_model, "tiny", swap_policy=policy)
    prompt = engine.tokenizer("the prefix cache forgets KV of older weights")["input_ids"]
    await engine.generate(prompt, Sampling(1.0, 1.0, 4, seed=0))
    assert len(engine.prefixes) == 1
    fetched, new_model = new_weights(engine, version=2)
    await engine.swap(fetched)
    assert len(engine.prefixes) == 0
    gen = await engine.generate(prompt, Sampling(1.0, 1.0, 4, seed=0))
    reference = teacher_forced_logprobs(new_model, prompt, gen.tokens)
    assert gen.logprobs == pytest.approx(reference, abs=1e-4)
    await engine.close()


async def test_a_turn_that_spans_a_swap_is_not_cached(engine):
    gen, _ = await generate_with_swap_midway(engine)
    assert set(gen.versions) == {0, 5}
    assert len(engine.prefixes) == 0  # its KV mixes two policies


def test_sampling_follows_the_tempered_nucleus_and_reports_its_logprobs():
    from treadle_rollout.engines.hf import sample

    torch.manual_seed(0)
    logits_V = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    params = [Sampling(1.0, 0.7, 1)] * n + [Sampling(1.0, 1.0, 1)] * n + [Sampling(0.0, 1.0, 1)]
    tokens, logprobs, tops = sample(logits_V.expand(len(params), -1), params)
    assert tops == [None] * len(params)  # nobody asked for them
    nucleus, full, greedy = tokens[:n], tokens[n : 2 * n], tokens[-1]
    # top_p 0.7: tokens 0 and 1 (0.5 + 0.3 reach it), renormalized to 0.625 / 0.375
    assert set(nucleus) == {0, 1}
    assert nucleus.count(0) / n == pytest.approx(0.625, abs=0.03)
    expected = {0: torch.tensor(0.625).log().item(), 1: torch.tensor(0.375).log().item()}
    assert [round(x, 4) for x in logprobs[:n]] == [round(expected[t], 4) for t in nucleus]
    for token, share in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert full.count(token) / n == pytest.approx(share, abs=0.03)
    assert logprobs[n] == pytest.approx(logits_V.log_softmax(-1)[full[0]].item(), abs=1e-6)
    assert greedy == 0 and logprobs[-1] == pytest.approx(torch.tensor(0.5).log().item())


def test_top_logprobs_come_from_the_distribution_the_token_was_sampled_from():
    from treadle_rollout.engines.hf import sample

    logits_V = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = [Sampling(1.0, 0.7, 1, top_logprobs=3), Sampling(1.0, 1.0, 1, top_logprobs=2)]
    params.append(Sampling(1.0, 1.0, 1))
    tokens, logprobs, tops = sample(logits_V.expand(3, -1), params)
    nucleus, full, none = tops
    assert none is None
    assert [t for t, _ in full] == [0, 1]
    assert [round(lp, 4) for _, lp in full] == [
        round(torch.tensor(p).log().item(), 4) for p in (0.5, 0.3)
    ]
    # top_p 0.7: the nucleus is renormalized, and what lies outside it has logprob -inf
    assert [t for t, _ in nucleus][:2] == [0, 1] and nucleus[2][1] == float("-inf")
    assert nucleus[0][1] == pytest.approx(torch.tensor(0.625).log().item(), abs=1e-5)
    assert logprobs[0] == dict(nucleus)[tokens[0]]


def test_an_injected_logit_bias_changes_what_is_sampled_and_its_logprobs_not_greedy():
    """`rollout_fault_logit_noise`: sampled rows draw from softmax(logits / T + bias) and
    report that distribution's logprobs (an engine whose policy is not the trainer's); greedy
    rows stay on the clean argmax."""
    from treadle_rollout.engines.hf import logit_bias, sample

    assert logit_bias(4, 0.0, "cpu") is None
    bias_V = logit_bias(4, 1.0, "cpu")
    assert bias_V is not None and torch.equal(bias_V, logit_bias(4, 1.0, "cpu"))  # seeded
    torch.manual_seed(0)
    logits_V = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    params = [Sampling(1.0, 1.0, 1)] * n + [Sampling(0.0, 1.0, 1)]
    tokens, logprobs, _ = sample(logits_V.expand(len(params), -1), params, None, bias_V)
    biased = (logits_V + bias_V).softmax(-1)
    for token in range(4):
        assert tokens[:n].count(token) / n == pytest.approx(float(biased[token]), abs=0.03)
    assert logprobs[0] == pytest.approx(float(biased[tokens[0]].log()), abs=1e-5)
    assert tokens[-1] == 0 and logprobs[-1] == pytest.approx(float(torch.tensor(0.5).log()))


async def test_a_full_batch_admits_the_oldest_requests_first(tiny_model):
    engine = HFEngine(tiny_model, "tiny", max_batch=2)
    prompt = engine.tokenizer("who goes first")["input_ids"]
    order: list[float] = []

    async def one(priority: float):
        await engine.generate(prompt, Sampling(1.0, 1.0, 3, seed=1, priority=priority))
        order.append(priority)

    # all six wait before the first step: the two oldest run, then the next two
    await asyncio.gather(*(one(p) for p in (5.0, 3.0, 6.0, 1.0, 4.0, 2.0)))
    assert order[:2] == [1.0, 2.0] and sorted(order[2:4]) == [3.0, 4.0]
    await engine.close()


async def test_the_trainer_scores_sampled_tokens_under_the_sampling_temperature(engine):
    """On-policy, the trainer's logprobs equal rollout's behaviour logprobs (PPO ratio 1): it
    divides the logits by the temperature rollout sampled at, as the engine does."""
    from treadle_trainer.backends.logprobs import token_logprobs
    from treadle_trainer.batches import Datum, pack

    prompt = engine.tokenizer("12+34=")["input_ids"]
    gen = await engine.generate(prompt, Sampling(0.6, 1.0, 8, seed=5))
    tokens = prompt + gen.tokens
    n = len(prompt) - 1
    datum = Datum(
        input_ids=tokens[:-1],
        targets=tokens[1:],
        weights=[0.0] * n + [1.0] * len(gen.tokens),
        advantages=[0.0] * len(tokens[1:]),
        logprobs=[0.0] * n + gen.logprobs,
    )
    (mb,) = pack([datum], 4096, "token", engine.tokenizer.pad_token_id)
    with torch.no_grad():
        at_t, _ = token_logprobs(engine.model, mb, "cpu", temperature=0.6)
        plain, _ = token_logprobs(engine.model, mb, "cpu")
    assert at_t[0, n:].tolist() == pytest.approx(gen.logprobs, abs=1e-4)
    assert plain[0, n:].tolist() != pytest.approx(gen.logprobs, abs=1e-2)  # T=1 is another policy


async def test_requests_released_over_a_few_loop_turns_start_in_one_step(engine):
    """An idle engine gathers what arrives in the next few event-loop turns (the groups a
    weight swap un-gates) into one prefill, instead of stepping the first request alone."""
    joined: list[int] = []
    step = engine._step

    def recording(joiners):
        joined.append(len(joiners))
        return step(joiners)

    engine._step = recording
    prompt = engine.tokenizer("12+34=")["input_ids"]

    async def after(turns: int):
        for _ in range(turns):
            await asyncio.sleep(0)
        return await engine.generate(prompt, Sampling(1.0, 1.0, 4, seed=turns + 1))

    gens = await asyncio.gather(*(after(i) for i in range(6)))
    assert joined[0] == 6 and sum(joined) == 6
    assert all(len(g.tokens) > 0 for g in gens)


async def test_stop_strings_and_stop_tokens_end_a_generation(engine):
    tok = engine.tokenizer
    prompt = tok("1+2= what is")["input_ids"]
    free = await engine.generate(prompt, Sampling(0.0, 1.0, 16))
    assert len(free.tokens) >= 6, free.tokens
    text = tok.decode(free.tokens[:6])
    needle = text[-3:] if text[-3:].strip() else text[-4:]
    stopped = await engine.generate(prompt, Sampling(0.0, 1.0, 16, stop_strings=(needle,)))
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[: len(stopped.tokens)]  # greedy: the same prefix
    assert needle in tok.decode(stopped.tokens)  # the tokens that spell it are kept
    assert needle not in tok.decode(stopped.tokens[:-1])  # and nothing after them
    by_token = await engine.generate(
        prompt, Sampling(0.0, 1.0, 16, stop_token_ids=(free.tokens[2],))
    )
    first = free.tokens.index(free.tokens[2])
    assert by_token.finish_reason == "stop" and by_token.tokens == free.tokens[: first + 1]


async def test_a_stream_is_the_generation_in_pieces_and_closing_it_cancels_the_request(
    tiny_model,
):
    engine = HFEngine(tiny_model, "tiny")
    prompt = engine.tokenizer("stream me")["input_ids"]
    sampling = Sampling(1.0, 1.0, 12, seed=4, top_logprobs=2)
    whole = await engine.generate(prompt, sampling)
    pieces = [piece async for piece in engine.stream(prompt, sampling)]
    assert len(pieces) > 1 and all(not p.finish_reason for p in pieces[:-1])
    assert pieces[-1].finish_reason == whole.finish_reason
    assert [t for p in pieces for t in p.tokens] == whole.tokens
    assert [x for p in pieces for x in p.logprobs] == pytest.approx(whole.logprobs)
    assert [len(t) for p in pieces for t in p.top_logprobs] == [2] * len(whole.tokens)

    stream = engine.stream(prompt, Sampling(1.0, 1.0, 500, seed=4))
    await anext(stream)
    await stream.aclose()  # the client went away
    for _ in range(20):
        await asyncio.sleep(0.01)
        if engine.running == 0:
            break
    assert engine.running == 0
    await engine.close()


async def test_the_engine_steps_on_while_the_event_loop_is_busy(engine):
    """Steps run back to back in the worker thread: a busy event loop (HTTP and gRPC work
    under load) does not hold the engine between steps."""
    prompt = engine.tokenizer("busy loop")["input_ids"]
    task = asyncio.create_task(engine.generate(prompt, Sampling(1.0, 1.0, 200, seed=3)))
    while not engine._batch.seqs:
        await asyncio.sleep(0.001)
    seq = engine._batch.seqs[0]
    started_with = len(seq.tokens)
    deadline = time.monotonic() + 60
    while seq.finish is None and time.monotonic() < deadline:
        time.sleep(0.005)  # blocks the event loop: it takes no turn until the end
    assert started_with < 200 and seq.finish is not None, (started_with, len(seq.tokens))
    gen = await task
    assert gen.tokens == seq.tokens and gen.finish_reason == seq.finish


async def test_the_engine_passes_its_cache_under_the_name_transformers_expects(engine):
    """transformers renamed the forward's `past_key_values` to `cache` (the old name warns
    on every call, then goes away): the engine uses the name its transformers has."""
    import warnings

    prompt = engine.tokenizer("no deprecated names in the hot loop")["input_ids"]
    with warnings.catch_warnings():  # the forwards run in the engine's thread: filters are global
        warnings.simplefilter("error", FutureWarning)
        gen = await engine.generate(prompt, Sampling(1.0, 1.0, 4, seed=0))
        again = await engine.generate(prompt + gen.tokens, Sampling(1.0, 1.0, 4, seed=0))
    assert len(gen.tokens) == 4 and len(again.tokens) == 4


async def test_an_adapter_queued_while_another_applies_is_applied_on_an_idle_engine(
    engine, monkeypatch
):
    """Runs' adapters arrive at once on an idle engine (four LoRA runs starting): one queued
    while the engine's thread applies another is applied too, with no request to wake the
    engine (its run's tasks wait for it before they generate). It once slept on it for ever."""
    config = lora.AdapterConfig(rank=2, alpha=4.0, targets=lora.ATTENTION)
    donor = copy.deepcopy(engine.model)
    lora.inject(donor, config.targets)
    lora.add_adapter(donor, "donor", config)
    state = {k: v.detach().clone() for k, v in lora.adapter_state(donor, "donor").items()}
    applying, release = threading.Event(), threading.Event()
    original = lora.load_adapter

    def slow_first(model, name, tensors, cfg):
        if name == "tiny.first":  # holds the engine's thread until the second is queued
            applying.set()
            release.wait(10)
        original(model, name, tensors, cfg)

    monkeypatch.setattr(lora, "load_adapter", slow_first)
    first = asyncio.create_task(engine.load_adapter("tiny.first", state, config, version=1))
    while not applying.is_set():
        await asyncio.sleep(0.01)
    second = asyncio.create_task(engine.load_adapter("tiny.second", state, config, version=2))
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert engine.adapters() == ["tiny.first", "tiny.second"]
