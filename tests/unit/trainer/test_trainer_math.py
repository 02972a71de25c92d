"""Losses, advantages, aggregation, validation and packing, each against a hand example."""

import asyncio
import math

import pytest
import torch

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_trainer.batches import (
    Datum,
    Entry,
    GroupBuffer,
    collate,
    drop_reason,
    group_advantages,
    invalid_reason,
    pack,
    staleness,
)
from treadle_trainer.losses import (
    LOSSES,
    LossParams,
    TokenInputs,
    aggregation_coefs,
    k3_kl,
    total_loss,
)

pytestmark = pytest.mark.unit
L = math.log


def traj(group="g", reward=0.0, versions=(3, 3), status=tpb.TRAJECTORY_STATUS_OK, tid="t"):
    return tpb.Trajectory(
        trajectory_id=tid,
        group_id=group,
        reward=reward,
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.7],
        token_versions=[-1, *versions],
        status=status,
    )


# --- advantages --------------------------------------------------------------------------------


def test_advantages_by_hand():
    g = [traj(reward=1.0), traj(reward=0.0), traj(reward=0.0), traj(reward=1.0)]
    # mean 0.5, population std 0.5
    assert group_advantages(g, "grpo") == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert group_advantages(g, "dr_grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # rloo: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    assert group_advantages(g, "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert group_advantages([traj(reward=0.5)] * 2, "grpo") == pytest.approx([0, 0])
    assert group_advantages([traj(reward=0.5)], "rloo") == [0.0]


# --- losses: one token with logp = ln 0.5, behaviour mu = ln 0.25 (ratio 2), A = +1 / -1 ---------


def one(logp=L(0.5), mu=L(0.25), adv=1.0, prox=None):
    t = lambda v: torch.tensor([[v]], dtype=torch.float64, requires_grad=False)  # noqa: E731
    return TokenInputs(t(logp), t(adv), t(mu), None if prox is None else t(prox))


P = LossParams(clip_low=0.2, clip_high=0.28, is_cap=2.0)


@pytest.mark.parametrize(
    ("name", "inputs", "expected"),
    [
        ("cross_entropy", one(), -L(0.5)),  # -logp = ln 2
        ("policy_gradient", one(adv=-1.0), L(0.5)),  # -A logp = logp
        ("importance_sampling", one(), -2.0),  # -r A
        # ppo, A>0, r=2: min(2, clip(2)=1.28) -> -1.28 (clip-higher bound)
        ("ppo", one(), -1.28),
        # ppo, A<0, r=2: min(-2, -1.28) = -2 -> loss 2 (no clipping on the pessimistic side)
        ("ppo", one(adv=-1.0), 2.0),
        # ppo, A<0, r=0.5: min(-0.5, -0.8) = -0.8 -> 0.8 (lower clip 1-0.2)
        ("ppo", one(logp=L(0.125), mu=L(0.25), adv=-1.0), 0.8),
        # cispo: -sg(clip(r)) A logp = -1.28 * ln 0.5
        ("cispo", one(), -1.28 * L(0.5)),
        # decoupled: prox = ln 0.4 -> behaviour weight min(2, 0.4/0.25=1.6) = 1.6,
        # r' = 0.5/0.4 = 1.25 (inside the clip) -> -1.6 * 1.25
        ("decoupled_ppo", one(prox=L(0.4)), -1.6 * 1.25),
        # prox = ln 1.0: weight 4 truncated to 2; r' = 0.5 clipped to 0.8 for A<0: min(-.5,-.8)
        ("decoupled_ppo", one(prox=0.0, adv=-1.0), 2.0 * 0.8),
    ],
)
def test_loss_values_by_hand(name, inputs, expected):
    per_token, _ = LOSSES[name](inputs, P)
    assert per_token.item() == pytest.approx(expected, abs=1e-9)


def test_gradients_follow_the_clip():
    # ppo, A>0, r=2 is clipped: no gradient; r=1.1 is not: d(-rA)/dlogp = -r
    for logp, grad in ((L(0.5), 0.0), (L(0.275), -1.1)):
        x = one(logp=logp)
        x.logprobs.requires_grad_(True)
        LOSSES["ppo"](x, P)[0].sum().backward()
        assert x.logprobs.grad.item() == pytest.approx(grad)
    # cispo keeps a gradient on clipped tokens: -w A = -1.28
    x = one()
    x.logprobs.requires_grad_(True)
    LOSSES["cispo"](x, P)[0].sum().backward()
    assert x.logprobs.grad.item() == pytest.approx(-1.28)


def test_clip_fraction_and_kl():
    _, stats = LOSSES["ppo"](one(), P)
    assert stats["clip_fraction"].item() == 1.0
    # k3: ref = ln 0.25, logp = ln 0.5 -> 0.5 - ln 0.5 - 1
    assert k3_kl(torch.tensor(L(0.5)), torch.tensor(L(0.25))).item() == pytest.approx(
        0.5 - L(0.5) - 1
    )
    assert k3_kl(torch.tensor(-1.0), torch.tensor(-1.0)).item() == 0.0


# --- aggregation ---------------------------------------------------------------------------------


def test_aggregation_coefs_by_hand():
    counts, groups = [1, 3, 2], ["a", "a", "b"]
    assert aggregation_coefs(counts, groups, "token") == pytest.approx([1 / 6] * 3)
    assert aggregation_coefs(counts, groups, "sequence") == pytest.approx([1 / 3, 1 / 9, 1 / 6])
    # groups a (4 tokens), b (2 tokens): each group's token mean, averaged over 2 groups
    assert aggregation_coefs(counts, groups, "group") == pytest.approx([1 / 8, 1 / 8, 1 / 4])
    assert aggregation_coefs(counts, groups, "sum") == [1.0] * 3
    with pytest.raises(ValueError, match="token, sequence, group, sum"):
        aggregation_coefs(counts, groups, "mean")


def test_total_loss_aggregates_with_mask_and_kl():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    x = TokenInputs(logp, adv, logp.clone())
    # policy gradient, token mean: -(1*-1 + 1*-2 + -2*-0.5) / 3 = 2/3
    coef = torch.tensor(aggregation_coefs([2, 1], ["a", "b"], "token"))
    value, _ = total_loss("policy_gradient", LossParams(), x, mask, coef)
    assert value.item() == pytest.approx(2 / 3)
    # sequence mean: seq0 mean = 1.5, seq1 = -1 -> 0.25
    coef = torch.tensor(aggregation_coefs([2, 1], ["a", "b"], "sequence"))
    value, _ = total_loss("policy_gradient", LossParams(), x, mask, coef)
    assert value.item() == pytest.approx(0.25)
    # kl at ref == logp adds nothing
    value, stats = total_loss("policy_gradient", LossParams(kl_coef=0.5), x, mask, coef, logp)
    assert value.item() == pytest.approx(0.25) and stats["kl"].abs().sum() == 0


# --- validation, groups, packing ------------------------------------------------------------------


def test_staleness_uses_the_oldest_generated_token():
    assert staleness(traj(versions=(2, 4)), trainer_version=5) == 3


def test_drop_and_invalid_reasons():
    assert drop_reason(traj(versions=(1, 1)), 3, max_staleness=1) == "stale"
    assert drop_reason(traj(status=tpb.TRAJECTORY_STATUS_REWARD_ERROR), 3, 1) == "reward_error"
    assert drop_reason(traj(), 3, 0) is None
    assert invalid_reason(traj(), vocab_size=100) is None
    bad = traj()
    bad.logprobs.append(0.0)
    assert invalid_reason(bad, 100) == "length_mismatch"
    assert invalid_reason(traj(), vocab_size=7) == "token_out_of_vocab"
    assert invalid_reason(tpb.Trajectory(group_id="g"), 100) == "missing_ids"
    nan = traj()
    nan.reward = float("nan")
    assert invalid_reason(nan, 100) == "bad_reward"


@pytest.mark.parametrize(
    ("field", "values", "reason"),
    [
        ("tokens", [5, -1, 7], "token_out_of_vocab"),
        ("tokens", [5, 6, 100], "token_out_of_vocab"),
        ("loss_mask", [0, 2, 1], "bad_loss_mask"),
        ("loss_mask", [0, -1, 1], "bad_loss_mask"),
        ("logprobs", [0.0, float("nan"), -0.7], "bad_logprobs"),
        ("logprobs", [0.0, -0.5, float("-inf")], "bad_logprobs"),
        ("logprobs", [0.0, 0.25, -0.7], "bad_logprobs"),
    ],
)
def test_a_malformed_token_anywhere_names_its_reason(field, values, reason):
    """Read as arrays (`batches.py`), every per-token check still sees every token."""
    bad = traj()
    getattr(bad, field)[:] = values
    assert invalid_reason(bad, vocab_size=100) == reason


def test_staleness_and_generated_tokens_of_a_prompt_only_trajectory():
    prompt_only = traj()
    prompt_only.token_versions[:] = [-1, -1, -1]
    prompt_only.loss_mask[:] = [1, 0, 0]  # the first token's mask is never a target's
    assert staleness(prompt_only, trainer_version=4) == 0
    assert drop_reason(prompt_only, 4, max_staleness=0) == "no_generated_tokens"
    d = Datum.from_trajectory(traj(), advantage=-1.5, stale=2)
    assert d.advantages == [-1.5, -1.5] and d.weights == [1.0, 1.0] and d.staleness == 2
    assert all(type(x) is int for x in d.input_ids + d.targets)


def test_group_buffer_releases_complete_groups_in_completion_order():
    buf = GroupBuffer(group_size=2)
    for i, g in enumerate(["a", "b", "b", "c", "a"]):
        buf.add(Entry(str(i), traj(group=g, tid=str(i))))
    assert [g.group_id for g in buf.take(5)] == ["b", "a"]
    assert list(buf.partial) == ["c"]
    buf.add(Entry("5", traj(group="d", tid="5")))
    buf.add(Entry("6", traj(group="d", tid="6")))
    assert [g.group_id for g in buf.take_all()] == ["d", "c"]  # complete first, then partial
    assert buf.take_all() == [] and not buf.partial


def test_datum_shifts_and_masks():
    d = Datum.from_trajectory(traj(), advantage=2.0)
    assert (d.input_ids, d.targets, d.weights) == ([5, 6], [6, 7], [1.0, 1.0])
    assert d.advantages == [2.0, 2.0] and d.logprobs == pytest.approx([-0.5, -0.7])
    mb = collate([d, Datum([1], [2], [1.0], [-1.0], [-0.1])], [0.5, 0.25], pad_id=0)
    assert mb.input_ids_B_T.tolist() == [[5, 6], [1, 0]]
    assert mb.mask_B_T.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.coef_B.tolist() == [0.5, 0.25]


def test_pack_respects_the_token_budget_and_keeps_the_batch_loss():
    data = [
        Datum([1] * n, [2] * n, [1.0] * n, [1.0] * n, [-1.0] * n, group=str(n))
        for n in (3, 1, 5, 2, 4)
    ]
    mbs = pack(data, token_budget=6, aggregation="sequence", pad_id=0)
    assert all(mb.input_ids_B_T.numel() <= 6 or mb.input_ids_B_T.shape[0] == 1 for mb in mbs)
    assert [mb.input_ids_B_T.shape[0] for mb in mbs] == [2, 1, 1, 1]  # (1,2) (3) (4) (5)
    assert sum(mb.input_ids_B_T.shape[0] for mb in mbs) == 5
    # sum over micro-batches of sum(coef * tokens) = 1 for a mean aggregation
    assert sum(float((mb.coef_B[:, None] * mb.mask_B_T).sum()) for mb in mbs) == pytest.approx(1)


def test_minibatches_keep_groups_whole_and_balanced():
    from treadle_trainer.batches import Datum, split_minibatches

    def datum(group: str) -> Datum:
        return Datum([1], [2], [1.0], [0.0], [0.0], group=group)

    data = [datum(g) for g in "aaabbcccdd"]  # 4 groups
    chunks = split_minibatches(data, 2)
    assert [[d.group for d in c] for c in chunks] == [list("aaabb"), list("cccdd")]
    assert [len(c) for c in split_minibatches(data, 3)] == [3, 5, 2]  # whole groups only
    assert len(split_minibatches(data, 10)) == 4  # at most one minibatch per group
    assert split_minibatches(data, 1) == [data]


def test_every_decoupled_ppo_batch_snapshots_its_proximal_policy():
    """With minibatches > 1, each batch freezes the weights it starts from, including a batch
    with a single group (one minibatch): it must not reuse an earlier batch's snapshot."""
    from types import SimpleNamespace

    from treadle_trainer.backends import AdamParams
    from treadle_trainer.batches import Datum
    from treadle_trainer.run.stepping import RunStepper

    calls: list[str] = []

    class ScriptedBackend:
        pad_id = 0

        def snapshot_proximal(self):
            calls.append("snapshot")

        def forward_backward(self, mbs, loss, params):
            calls.append("forward_backward")
            return {"loss": 1.0, "num_tokens": 1.0}

        def optim_step(self, adam):
            calls.append("optim_step")
            return {"grad_norm": 0.0}

    def owner(loss: str, minibatches: int, off_policy: str = "none"):
        trainer = SimpleNamespace(
            minibatches=minibatches,
            loss=loss,
            off_policy=off_policy,
            micro_batch_tokens=64,
            loss_aggregation="token",
            lr=1e-4,
            lr_warmup_steps=0,
            profile_steps=[],
        )
        return SimpleNamespace(
            config=SimpleNamespace(trainer=trainer),
            loss_params=None,
            adam=AdamParams(),
            status=SimpleNamespace(step=0),
        )

    def batch(groups: str) -> list[Datum]:
        return [Datum([1, 2], [2, 3], [1.0, 1.0], [0.5, 0.5], [0.0, 0.0], group=g) for g in groups]

    backend = ScriptedBackend()
    RunStepper._train(owner("decoupled_ppo", 2), backend, batch("ab"))
    assert calls == ["snapshot", *["forward_backward", "optim_step"] * 2]
    calls.clear()
    RunStepper._train(owner("decoupled_ppo", 2), backend, batch("a"))  # one group: one minibatch
    assert calls == ["snapshot", "forward_backward", "optim_step"]
    calls.clear()
    RunStepper._train(owner("ppo", 2), backend, batch("ab"))  # ppo's ratio: to the behaviour
    assert "snapshot" not in calls
    calls.clear()
    RunStepper._train(owner("ppo", 2, "tis"), backend, batch("ab"))  # corrected: to pi_prox
    assert calls[0] == "snapshot"


async def test_a_wholly_stale_group_does_not_take_a_batch_slot():
    """At trainer version 5 with staleness 1, a group generated at version 0 is taken along
    (the step drops it, counted) but the batch still gets its 2 trainable groups."""
    from types import SimpleNamespace

    from treadle_trainer.run.collector import Collector
    from treadle_trainer.run.feeder import EnvCircuitOpen

    def group(gid: str, version: int) -> list[Entry]:
        return [
            Entry(f"{gid}-{i}", traj(group=gid, versions=(version,), tid=f"{gid}/{i}"))
            for i in range(2)
        ]

    class Counts:  # the Redis calls collect makes: count an unusable group, read a breaker
        def __init__(self):
            self.counts: dict[str, int] = {}
            self.broken: dict[str, bytes] = {}

        async def hincrby(self, key, field, by):
            self.counts[field] = self.counts.get(field, 0) + by

        async def hget(self, key, field):
            return self.broken.get(field)

    class Scripted(Collector):
        def __init__(self, arrivals: list[list[Entry]]):  # no Redis: a scripted stream
            trainer = SimpleNamespace(batch_timeout_s=0.5)
            env = SimpleNamespace(name="e")
            self.config = SimpleNamespace(trainer=trainer, run_id="r", env=env)  # type: ignore[assignment]
            self.buffer = GroupBuffer(2)
            self.arrivals = arrivals
            self.stopping = False
            self.replayed: set[str] = set()
            self.r = Counts()  # type: ignore[assignment]

        async def read(self, block_ms):
            for entry in self.arrivals.pop(0) if self.arrivals else []:
                self.buffer.add(entry)
            return 1

    collector = Scripted(
        [group("old", 0), group("a", 4), group("older", 0), group("b", 5), group("c", 5)]
    )
    taken = await collector.collect(2, version=5, max_staleness=1)
    assert [g.group_id for g in taken] == ["old", "a", "older", "b"]
    assert [g.group_id for g in collector.buffer.take_all()] == []  # "c" is not read yet
    assert collector.r.counts == {"groups_unusable": 2}  # the feeder replaces both
    # a group whose members are all malformed (env failed before generating) is no better
    broken = [Entry(f"e-{i}", tpb.Trajectory(group_id="e"), "too_short") for i in range(2)]
    mixed = Scripted([broken, group("f", 5), group("g", 5)])
    assert [g.group_id for g in await mixed.collect(2, 5, 1)] == ["e", "f", "g"]
    assert mixed.r.counts == {"groups_unusable": 1}
    # a group with one failed member (the others played) is not trained either: replaced
    failed = group("h", 5)
    failed[1].traj.status = tpb.TRAJECTORY_STATUS_ENV_ERROR
    partial = Scripted([failed, group("i", 5), group("j", 5)])
    assert [g.group_id for g in await partial.collect(2, 5, 1)] == ["h", "i", "j"]
    assert partial.r.counts == {"groups_unusable": 1}
    # replacements are fed at once, but a step whose groups keep failing stops asking
    refills = []

    async def refill():
        refills.append(1)
        return 1

    storm = Scripted([group(f"s{i}", 0) for i in range(8)])
    with pytest.raises(TimeoutError):
        await storm.collect(2, version=5, max_staleness=1, refill=refill)
    assert storm.r.counts == {"groups_unusable": 8} and len(refills) == 4  # 2 x 2 groups
    with pytest.raises(TimeoutError, match="only 1/2"):
        await Scripted([group("x", 0), group("d", 5)]).collect(2, version=5, max_staleness=1)
    # a step that waits with nothing coming refills (the tasks rollout gave up on), boundedly
    refills.clear()
    quiet = Scripted([group("q", 5)])
    quiet.read = lambda block_ms: asyncio.sleep(0, 0)  # type: ignore[method-assign]
    with pytest.raises(TimeoutError, match="only 0/2"):
        await quiet.collect(2, version=5, max_staleness=1, refill=refill)
    assert len(refills) == 5  # 2 x 2 groups, and the one that went past the bound
    # and once rollout opened the breaker of the run's env, the step fails with why
    broken = Scripted([])
    broken.read = lambda block_ms: asyncio.sleep(0, 0)  # type: ignore[method-assign]
    broken.r.broken["broken:e"] = b"8 of its last 8 episodes failed"
    with pytest.raises(EnvCircuitOpen, match="env 'e' is circuit-broken for run r: 8 of"):
        await broken.collect(2, version=5, max_staleness=1, refill=refill)
    # a resume replays what the last owner read past its checkpoint: all stale at the version
    # the run goes back to, and every one is replaced, however many (not an env failing;
    # found by the compose smoke: a sync run stalled after a redis restart)
    refills.clear()
    replayed = [group(f"r{i}", 0) for i in range(6)]
    resumed = Scripted([*replayed, group("n1", 5), group("n2", 5)])
    resumed.replayed = {e.entry_id for g in replayed for e in g}
    taken = await resumed.collect(2, version=5, max_staleness=1, refill=refill)
    assert [g.group_id for g in taken] == [*(f"r{i}" for i in range(6)), "n1", "n2"]
    assert resumed.r.counts == {"groups_unusable": 6} and len(refills) == 6


def test_a_group_with_a_failed_member_completes_and_is_dropped_whole():
    """An episode that failed before generating (too short to train) still completes its
    group, and its step drops the group whole: the member with its reason, the others as
    `group_incomplete` (trained on its survivors only, the group's advantages would favour
    what survives a failure)."""
    from treadle_common.config.recipe import TrainerConfig
    from treadle_trainer.batches import Group
    from treadle_trainer.run.step import build_batch

    buf = GroupBuffer(group_size=3)
    buf.add(Entry("0", traj(tid="a", reward=1.0)))
    broken = tpb.Trajectory(trajectory_id="b", group_id="g", status=tpb.TRAJECTORY_STATUS_ENV_ERROR)
    buf.add(Entry("1", broken, invalid_reason(broken, vocab_size=8)))
    buf.add(Entry("2", traj(tid="c", reward=0.0)))
    [group] = buf.take(1)
    assert isinstance(group, Group) and len(group.entries) == 3
    batch = build_batch([group], version=3, max_staleness=0, t=TrainerConfig())
    assert batch.trained == [] and batch.data == []
    assert batch.dropped == {"b": "too_short", "a": "group_incomplete", "c": "group_incomplete"}
    assert batch.entries == ["0", "1", "2"]  # all acked with the step
    # an infrastructure status (not malformed) is dropped whole too
    failed = traj(tid="b", reward=0.0)
    failed.status = tpb.TRAJECTORY_STATUS_REWARD_ERROR
    entries = [Entry("3", traj(tid="a", reward=1.0)), Entry("4", failed)]
    whole = build_batch([Group("g", entries)], version=3, max_staleness=0, t=TrainerConfig())
    assert whole.trained == [] and whole.dropped == {"b": "reward_error", "a": "group_incomplete"}


def test_stale_trajectories_keep_trains_what_admission_let_start():
    """`drop` (the default) drops a trajectory whose oldest token lags past max_staleness;
    `keep` trains it and reports its lag (admission bounded its start, as AReaL's
    max_head_offpolicyness); failures are dropped either way."""
    from treadle_common.config.recipe import TrainerConfig
    from treadle_trainer.batches import Group
    from treadle_trainer.run.step import build_batch

    def group():
        late = traj(tid="late", reward=1.0, versions=(1, 5))  # started on 1, finished on 5
        return [Group("g", [Entry("0", late), Entry("1", traj(tid="fresh", versions=(5, 5)))])]

    dropped = build_batch(group(), version=6, max_staleness=2, t=TrainerConfig())
    assert dropped.dropped == {"late": "stale"} and dropped.trained == ["fresh"]
    keep = TrainerConfig(stale_trajectories="keep")
    kept = build_batch(group(), version=6, max_staleness=2, t=keep)
    assert kept.trained == ["late", "fresh"] and kept.stale == [5, 1] and not kept.dropped
    failed = traj(tid="late", versions=(1, 5), status=tpb.TRAJECTORY_STATUS_REWARD_ERROR)
    broken = build_batch([Group("g", [Entry("0", failed)])], 6, 2, keep)
    assert broken.dropped == {"late": "reward_error"}


def test_learning_rate_warms_up_linearly_then_holds():
    from treadle_trainer.train import warmup_lr

    assert [warmup_lr(1.0, 4, s) for s in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert warmup_lr(3e-5, 0, 1) == 3e-5


def test_task_seeds_give_every_episode_of_a_run_its_own_seed():
    from treadle_trainer.run import task_seed

    group_size = 8
    episode_seeds = [
        task_seed(3, index, group_size) + i for index in range(500) for i in range(group_size)
    ]
    assert len(set(episode_seeds)) == len(episode_seeds) and 0 not in episode_seeds
    assert task_seed(3, 0, group_size) != task_seed(4, 0, group_size)
    assert task_seed(2**31, 10**9, 64) < 2**63  # fits the proto's int64


def test_a_step_trains_groups_in_feed_order_whatever_order_they_finished_in():
    from treadle_trainer.batches import Entry, Group, in_feed_order

    def group(task_id: str, order: list[int]) -> Group:
        entries = [Entry(f"e{i}", tpb.Trajectory(group_id=task_id, sample_index=i)) for i in order]
        return Group(task_id, entries)

    arrived = [
        group("000000002-aa", [1, 0]),
        group("000000000-ff", [0, 1]),
        group("000000010-00", [1, 0]),
    ]
    ordered = in_feed_order(arrived)
    assert [g.group_id for g in ordered] == ["000000000-ff", "000000002-aa", "000000010-00"]
    assert all([e.traj.sample_index for e in g.entries] == [0, 1] for g in ordered)


async def test_a_sync_run_waits_at_each_evaluated_step_until_the_client_reports():
    import asyncio

    from treadle_common.config.recipe import RunConfig
    from treadle_trainer.run.step import EvaluationHold

    def owner(mode: str, hold_s: float = 600.0) -> EvaluationHold:
        config = RunConfig.model_validate(
            {
                "mode": mode,
                "model": {"path": "m"},
                "trainer": {"num_steps": 30},
                "eval": {"num_tasks": 10, "every": 10, "hold_s": hold_s},
            }
        )
        return EvaluationHold(config)

    sync = owner("sync")
    assert [s for s in range(1, 31) if sync.after(s)] == [10, 20]  # the end: no hold
    assert not any(owner("async").after(s) for s in range(1, 31))
    assert not owner("sync", hold_s=0).after(10)
    held = asyncio.create_task(sync.wait(10))
    await asyncio.sleep(0.05)
    assert not held.done()  # waits for the client
    await sync.mark_evaluated(9)
    await asyncio.sleep(0.05)
    assert not held.done()
    await sync.mark_evaluated(10)
    await asyncio.wait_for(held, 1)
    await asyncio.wait_for(owner("sync", hold_s=0.05).wait(10), 1)  # deadline


def test_every_loss_name_has_an_implementation_and_back():
    """A recipe or training-API request may name exactly the losses the trainer implements."""
    import typing

    from treadle_common.config.recipe import LossName
    from treadle_trainer.losses import LOSSES

    assert set(typing.get_args(LossName)) == set(LOSSES)
