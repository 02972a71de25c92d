"""Run ownership: feed tasks, assemble groups, train, publish, checkpoint, ack exactly once.

    owner.py       RunOwner: the step loop, restore, checkpoints
    feeder.py      tasks into Redis (cursor, seeds, min policy version), cancelled at the end
    collector.py   trajectories out of Redis into complete groups, or counted drops
    step.py        a step's batch (drops, advantages), its record, spans, metrics, eval holds
    publishing.py  the run's weight versions, published in the background
    ledger.py      every entry acked and ledgered exactly once, with its checkpoint
    lease.py       the run's fenced lease: only its owner's writes land
    claims.py      what a run claims of the fleet: its model (conflicts), its tenant's quota

    dataset / env generator --cursor--> fenced MULTI: XADD treadle:{run}:tasks + cursor + fed ids
        (fed up to (step + max_staleness) * tasks_per_step; rollout admission does the rest;
        a sync run feeds the next step's tasks, demanding the version this step publishes,
        while it publishes it, so rollout has read them and waits in the store for that
        version when it commits; with `feed_ahead`, before it trains this step)
    treadle:{run}:trajectories --fenced XREADGROUP (group `trainer`, consumer `owner`)-->
        validate (a trajectory id is "{task_id}/{sample}": a task played twice is trained once)
        --> GroupBuffer (complete groups) --> staleness / status drops --> advantages
        --> micro-batches by token budget --> backend.forward_backward + optim_step
        --> a copy of the new weights to the background publisher (`publisher.py`): it
            publishes them (delta) to the weight-store, which announces on NATS; version
            V0 + step, every `publish_every` steps, newest first. Sync runs wait for it
            (the next batch is generated with it); async runs go on at once
    every `checkpoint_every` steps: checkpoint (model, optimizer, RNG, cursor, run state) -->
        fenced MULTI: XACK every entry those steps used or dropped + one ledger entry per step
    sync mode, every `eval.every` steps: wait until the client has evaluated this step's
        weights (POST /v1/runs/{id}/evaluations), so nothing trains beside the evaluation
    after the last step: close admission, cancel unstarted tasks, let groups in flight land,
        drop the unused trajectories as `run_ended`; the final checkpoint acks and ledgers them

A crash loses only uncommitted steps: the restarted owner loads the last committed checkpoint,
re-publishes its weights, and replays its still-pending entries, so the ledger holds every
trajectory exactly once (trained, or dropped with its reason). A trainer that stalls past its
lease while another resumes the run has every later write refused and stops (`lost`); one
shut down with SIGTERM checkpoints at its next step boundary and releases the lease
(`handed_off`).
"""

from treadle_trainer.run.feeder import task_seed
from treadle_trainer.run.ledger import SERVICE
from treadle_trainer.run.owner import RunOwner

__all__ = ["SERVICE", "RunOwner", "task_seed"]
