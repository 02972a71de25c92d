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

import httpx

from treadle_common.clients.env import EnvClient
from treadle_common.config import RunConfig
from treadle_common.evaluation import distinct_tasks, without_held_out

SFT_SPLIT = "sft"
VALIDATION_SPLIT = "sft_val"


async def demonstrations(
    env: EnvClient, config: RunConfig, held_out: list[dict[str, Any]]
) -> list[dict[str, list]]:
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
        session = await env.create(config.env.name, task, seed=0)
        await env.close_session(session.session_id)
        messages = [{"role": m.role, "content": m.content} for m in session.observation.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        reply = tokenizer(str(task[field]), add_special_tokens=False)["input_ids"]
        tokens = prompt + reply + [tokenizer.eos_token_id]
        data.append(
            {
                "model_input": tokens[:-1],
                "target_tokens": tokens[1:],
                "weights": [0.0] * (len(prompt) - 1) + [1.0] * (len(reply) + 1),
            }
        )
    return data


async def validation_tasks(
    env: EnvClient, config: RunConfig, held_out: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Distinct tasks of split `sft_val` outside the held-out set: what decides when the
    warm-up stops (`sft.target_reward`) without looking at the held-out set."""
    rows = await distinct_tasks(env, config, VALIDATION_SPLIT, config.sft.check_tasks)
    return without_held_out(rows, held_out)


class TrainingSession:
    """A session on the trainer's training API, opened on the recipe's model."""

    def __init__(self, trainer_url: str, config: RunConfig):
        self.config = config
        self.http = httpx.AsyncClient(base_url=trainer_url, timeout=300)
        self.sid: str | None = None
        self.losses: list[float] = []

    async def __aenter__(self) -> TrainingSession:
        cfg = self.config
        response = await self.http.post(
            "/v1/training/sessions",
            json={
                "model_path": str(cfg.model.path),
                "model_name": cfg.model.name,
                "seed": cfg.trainer.seed,
            },
        )
        response.raise_for_status()
        self.sid = response.json()["session_id"]
        return self

    async def __aexit__(self, *exc_info) -> None:
        try:
            if self.sid is not None:
                await self.http.delete(f"/v1/training/sessions/{self.sid}")
        finally:
            await self.http.aclose()

    async def _post(self, op: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.http.post(f"/v1/training/sessions/{self.sid}/{op}", json=body)
        if response.is_error:
            raise RuntimeError(f"training API {op}: {response.status_code} {response.text}")
        return response.json()

    async def save_weights(self) -> int:
        """Publish the session's current weights; rollout swaps to the returned version."""
        return int((await self._post("save_weights"))["version"])

    async def sft(
        self,
        data: list[dict[str, list]],
        on_step: Callable[[dict[str, Any]], None] | None = None,
        validate: Callable[[int, int], Awaitable[float]] | None = None,
    ) -> dict[str, Any]:
        """`sft.steps` cross-entropy steps on random batches of `data`, then save_weights.

        With `sft.target_reward`, every `sft.check_every` steps the weights are saved and
        `validate(step, version)` scores them; the warm-up stops at the first score that
        reaches the target."""
        sft = self.config.sft
        rng = random.Random(self.config.trainer.seed)
        started = time.perf_counter()
        step = 0
        for step in range(1, sft.steps + 1):
            batch = [rng.choice(data) for _ in range(sft.batch_size)]
            fb = await self._post(
                "forward_backward",
                {"loss_fn": "cross_entropy", "aggregation": "token", "data": batch},
            )
            opt = await self._post(
                "optim_step",
                {"learning_rate": sft.lr, "max_grad_norm": self.config.trainer.max_grad_norm},
            )
            self.losses.append(fb["loss"])
            if on_step is not None:
                on_step({"sft_step": step, "loss": fb["loss"], **opt})
            target = sft.target_reward
            if target is None or validate is None or step % sft.check_every or step == sft.steps:
                continue
            if await validate(step, await self.save_weights()) >= target:
                break
        return {
            "version": await self.save_weights(),
            "steps": step,
            "examples": len(data),
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "seconds": round(time.perf_counter() - started, 2),
        }
