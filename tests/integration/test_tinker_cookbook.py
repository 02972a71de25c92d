"""The Tinker Cookbook's RL training loop (`tinker_cookbook.rl.train`, pinned) runs unchanged
against a Treadle stack on a tiny arithmetic task, and its reward rises.

The task is the cookbook's own shape (a `ProblemEnv`, groups of 8 by `ProblemGroupBuilder`,
the `role_colon` renderer, whose stop sequence is a string): `x+y=` with x, y in 0..2,
reward 1 when the first integer of the answer is right. The tiny random model starts near 0
(digits are rare among its tokens); the loop's LoRA (rank 8) importance-sampling updates
raise it. Measured over 5 runs of this test's settings: the mean reward of the first 10
iterations 0.009-0.028, of the last 10 0.098-0.27.

tinker-cookbook 0.6.1 (the newest) needs tml-renderers >= 0.4.1, which the index this
project installs from does not carry; 0.5.8 is the newest that installs, against the same
pinned `tinker` SDK.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
from functools import partial

import numpy as np
import pytest

tinker_cookbook = pytest.importorskip("tinker_cookbook")
import chz  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

from tests.conftest import TOKENS, start_service  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
COOKBOOK_VERSION = "0.5.8"
ITERATIONS = 40


class TinyAddition(ProblemEnv):
    def __init__(self, x: int, y: int, renderer: renderers.Renderer):
        super().__init__(renderer, format_coef=0.0)
        self.x, self.y = x, y

    def get_question(self) -> str:
        return f"{self.x}+{self.y}="

    def check_answer(self, sample_str: str) -> bool:
        numbers = re.findall(r"\d+", sample_str)
        return bool(numbers) and int(numbers[0]) == self.x + self.y

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return str(self.x + self.y)


class TinyAdditionDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batches: int):
        self.renderer, self.batches = renderer, batches

    def get_batch(self, index: int) -> list[ProblemGroupBuilder]:
        rng = np.random.RandomState(index)
        return [
            ProblemGroupBuilder(
                env_thunk=partial(
                    TinyAddition, int(rng.randint(0, 3)), int(rng.randint(0, 3)), self.renderer
                ),
                num_envs=8,
            )
            for _ in range(8)
        ]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class TinyAdditionBuilder(RLDatasetBuilder):
    model: str
    batches: int

    async def __call__(self) -> tuple[TinyAdditionDataset, None]:
        renderer = renderers.get_renderer("role_colon", tokenizer=get_tokenizer(self.model))
        return TinyAdditionDataset(renderer, self.batches), None


def test_cookbook_version_is_the_pinned_one():
    from importlib.metadata import version

    assert version("tinker-cookbook") == COOKBOOK_VERSION


def test_the_cookbook_rl_loop_raises_the_reward(infra, tmp_path, tiny_model, monkeypatch):
    # the Tinker name of the base model is its directory: the cookbook loads the tokenizer
    # by model name (`get_tokenizer`), which finds a local directory without a hub
    model = str(tiny_model)
    procs = []
    try:
        (tmp_path / "ws").mkdir()
        store = start_service("weight-store", infra, tmp_path / "ws")
        procs.append(store)
        gateway = start_service("env-gateway", infra, tmp_path)
        procs.append(gateway)
        addrs = {
            "TREADLE_WEIGHT_STORE_ADDR": store.grpc_addr or "",
            "TREADLE_ENV_GATEWAY_ADDR": gateway.grpc_addr or "",
        }
        rollout = start_service("rollout", infra, tmp_path, TREADLE_ROLLOUT_MODEL=model, **addrs)
        procs.append(rollout)
        trainer = start_service(
            "trainer",
            infra,
            tmp_path,
            TREADLE_TRAINER_TINKER_MODELS=json.dumps({model: model}),
            TREADLE_TRAINER_ROLLOUT_URL=rollout.http,
            **addrs,
        )
        procs.append(trainer)
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        monkeypatch.setenv("TINKER_API_KEY", "tml-" + TOKENS["trainer"])
        config = train.Config(
            learning_rate=5e-3,
            dataset_builder=TinyAdditionBuilder(model=model, batches=ITERATIONS),
            model_name=model,
            recipe_name="treadle_tiny_addition",
            max_tokens=4,
            log_path=str(tmp_path / "cookbook"),
            eval_every=0,
            save_every=0,
            renderer_name="role_colon",
            lora_rank=8,
            base_url=trainer.http,
            num_groups_to_log=0,
            rollout_json_export=False,
        )
        asyncio.run(train.main(config))
    finally:
        for proc in reversed(procs):
            proc.stop_checked()
    rows = [json.loads(line) for line in (tmp_path / "cookbook" / "metrics.jsonl").open()]
    rewards = [row["env/all/reward/total"] for row in rows if "env/all/reward/total" in row]
    assert len(rewards) == ITERATIONS
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last >= first + 0.04 and last >= 2 * first, rewards
    # the loop's final checkpoint: state and sampler weights, as tinker:// paths
    saved = [json.loads(line) for line in (tmp_path / "cookbook" / "checkpoints.jsonl").open()]
    assert saved and saved[-1]["name"] == "final"
    assert saved[-1]["state_path"].startswith("tinker://")
    assert saved[-1]["sampler_path"].startswith("tinker://")
