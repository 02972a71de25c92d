"""The Tinker Cookbook's RL loop (`tinker_cookbook.rl.train.main`) on a tiny arithmetic task,
pointed at a Treadle stack. Runs in .venv-cookbook (scripts/setup_cookbook.sh): a client of
the stack, as a researcher's script is.

    .venv-cookbook/bin/python tests/support/cookbook_rl_loop.py \
        --base-url URL --model DIR --log-path DIR

The task is the cookbook's own shape: a `ProblemEnv` asking `x+y=` (x, y in 0..2), groups of
8 by `ProblemGroupBuilder`, the `role_colon` renderer (its stop sequence is a string); reward
1 when the first integer of the answer is right. The API key comes from TINKER_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
from functools import partial

import chz
import numpy as np
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer


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


def seed_sampling(base: int) -> None:
    """Seed every sample request the loop makes (the cookbook leaves `seed` unset): the n-th
    request gets `base + n`. Within an iteration the loop starts its requests in a fixed
    order (one per environment, groups in order), so the run's samples, and with them its
    rewards and updates, are the same run after run."""
    calls = itertools.count()
    unseeded = tinker.SamplingClient.sample_async

    async def sample_async(self, prompt, num_samples, sampling_params, *args, **kwargs):
        if sampling_params.seed is None:
            sampling_params = sampling_params.model_copy(update={"seed": base + next(calls)})
        return await unseeded(self, prompt, num_samples, sampling_params, *args, **kwargs)

    tinker.SamplingClient.sample_async = sample_async  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the Tinker base-model name: its dir")
    parser.add_argument("--log-path", required=True)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=None, help="seed every sample request")
    args = parser.parse_args()
    if args.seed is not None:
        seed_sampling(args.seed)
    config = train.Config(
        learning_rate=args.lr,
        dataset_builder=TinyAdditionBuilder(model=args.model, batches=args.iterations),
        model_name=args.model,
        recipe_name="treadle_tiny_addition",
        max_tokens=4,
        log_path=args.log_path,
        eval_every=0,
        save_every=0,
        renderer_name="role_colon",
        lora_rank=8,
        base_url=args.base_url,
        num_groups_to_log=0,
        rollout_json_export=False,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
