"""The SFT warm-up `treadle run` does before RL, through the trainer's training API.

Demonstrations are env tasks (split `sft`, held-out eval tasks removed): the prompt is the
env's first observation rendered with the model's chat template, exactly as rollout renders
it, and the reply is the task's `answer_field` followed by the end-of-turn token. The loop is
the caller-owned one of the Tinker-style API: `forward_backward` (cross-entropy on the reply
tokens) and `optim_step` per batch, then `save_weights`, whose weight-store version the RL
run starts from. The session also publishes the untrained weights first, so the start
evaluation scores exactly the policy the run begins from.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from treadle_cli.report import SftRow
from treadle_common.api.training import AdamParams, CreateSession, DatumIn, ForwardBackward
from treadle_common.clients.env import EnvClient
from treadle_common.clients.trainer import TrainingClient
from treadle_common.config.recipe import RunConfig
from treadle_common.tasks.evaluation import distinct_tasks, without_held_out

SFT_SPLIT = "sft"
VALIDATION_SPLIT = "sft_val"


async def demonstrations(
    env: EnvClient, config: RunConfig, held_out: list[dict[str, Any]]
) -> list[DatumIn]:
    """Training-API datums (`model_input`, `target_tokens`, `weights`) for the warm-up."""
    from transformers import AutoTokenizer

    sft, field = config.sft, config.sft.answer_field
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    tasks = await env.sample_tasks(
        config.env.name,
        sft.num_examples,
        seed=config.trainer.seed,
        split=SFT_SPLIT,
        options=config.env.options,
    )
    tasks = without_held_out(tasks, held_out)
    if not tasks or any(field not in t for t in tasks):
        raise ValueError(
            f"sft: env {config.env.name} gave {len(tasks)} non-held-out tasks, and each needs "
            f"the answer field {field!r}"
        )
    data = []
    for task in tasks:
        session = await env.create(config.env.name, task, seed=0, options=config.env.options)
        await env.close_session(session.session_id)
        messages = [{"role": m.role, "content": m.content} for m in session.observation.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        reply = tokenizer(str(task[field]), add_special_tokens=False).input_ids
        tokens = prompt + reply + [tokenizer.eos_token_id]
        data.append(
            DatumIn(
                model_input=tokens[:-1],
                target_tokens=tokens[1:],
                weights=[0.0] * (len(prompt) - 1) + [1.0] * (len(reply) + 1),
            )
        )
    return data


async def validation_tasks(
    env: EnvClient, config: RunConfig, held_out: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Distinct tasks of split `sft_val` outside the held-out set: what decides when the
    warm-up stops (`sft.target_reward`) without looking at the held-out set."""
    rows = await distinct_tasks(env, config, VALIDATION_SPLIT, config.sft.check_tasks)
    return without_held_out(rows, held_out)


class WarmUp(BaseModel):
    """What the warm-up did: the version the RL run starts from, and its loss curve's ends."""

    version: int
    steps: int
    examples: int
    first_loss: float
    last_loss: float
    seconds: float


class TrainingSession:
    """A session on the trainer's training API, opened on the recipe's model."""

    def __init__(self, trainer_url: str, config: RunConfig, token: str | None = None):
        """`token`: the bearer token it presents (default `TREADLE_TOKEN`)."""
        self.config = config
        self.client = TrainingClient(trainer_url, token=token)
        self.sid = ""
        self.losses: list[float] = []

    async def __aenter__(self) -> TrainingSession:
        cfg = self.config
        created = await self.client.create_session(
            CreateSession(
                model_path=str(cfg.model.path), model_name=cfg.model.name, seed=cfg.trainer.seed
            )
        )
        self.sid = created.session_id
        return self

    async def __aexit__(self, *exc_info) -> None:
        try:
            if self.sid:
                await self.client.delete_session(self.sid)
        finally:
            await self.client.close()

    async def save_weights(self) -> int:
        """Publish the session's current weights; rollout swaps to the returned version."""
        return (await self.client.save_weights(self.sid)).version

    async def sft(
        self,
        data: list[DatumIn],
        on_step: Callable[[SftRow], None] | None = None,
        validate: Callable[[int, int], Awaitable[float]] | None = None,
    ) -> WarmUp:
        """`sft.steps` cross-entropy steps on random batches of `data`, then save_weights.

        With `sft.target_reward`, every `sft.check_every` steps the weights are saved and
        `validate(step, version)` scores them; the warm-up stops at the first score that
        reaches the target."""
        sft = self.config.sft
        rng = random.Random(self.config.trainer.seed)
        adam = AdamParams(learning_rate=sft.lr, max_grad_norm=self.config.trainer.max_grad_norm)
        started = time.perf_counter()
        step = 0
        for step in range(1, sft.steps + 1):
            batch = [rng.choice(data) for _ in range(sft.batch_size)]
            fb = await self.client.forward_backward(
                self.sid, ForwardBackward(loss_fn="cross_entropy", aggregation="token", data=batch)
            )
            opt = await self.client.optim_step(self.sid, adam)
            self.losses.append(fb.loss)
            if on_step is not None:
                on_step(SftRow(sft_step=step, loss=fb.loss, grad_norm=opt.grad_norm))
            target = sft.target_reward
            if target is None or validate is None or step % sft.check_every or step == sft.steps:
                continue
            if await validate(step, await self.save_weights()) >= target:
                break
        return WarmUp(
            version=await self.save_weights(),
            steps=step,
            examples=len(data),
            first_loss=self.losses[0] if self.losses else float("nan"),
            last_loss=self.losses[-1] if self.losses else float("nan"),
            seconds=round(time.perf_counter() - started, 2),
        )
