"""bench rollout's plain-transformers baseline counts what each row generated: its tokens up
to and including its end of sequence, never the padding generate appends after it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from treadle_bench.rollout import hf_generate_round

EOS, PAD = 2, 0


class ScriptedModel:
    """`generate` returns the prompts (left-padded, as given) followed by fixed rows."""

    def __init__(self, generated: list[list[int]]):
        self.generated = generated
        self.seen: dict = {}

    def generate(self, input_ids, attention_mask, **kwargs):
        self.seen = {"ids": input_ids.tolist(), "mask": attention_mask.tolist(), **kwargs}
        return torch.cat([input_ids, torch.tensor(self.generated)], dim=1)


def test_rows_count_up_to_their_end_of_sequence_and_prompts_are_left_padded():
    model = ScriptedModel([[5, 6, EOS, PAD], [7, 8, 9, 10], [EOS, PAD, PAD, PAD]])
    engine = SimpleNamespace(model=model, pad_id=PAD, eos_id=EOS, device="cpu")
    tokens, secs = hf_generate_round(engine, [[11, 12, 13], [14], [15, 16]], 4, seed=1)  # type: ignore[arg-type]
    assert tokens == 3 + 4 + 1 and secs >= 0
    assert model.seen["ids"] == [[11, 12, 13], [PAD, PAD, 14], [PAD, 15, 16]]
    assert model.seen["mask"] == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert model.seen["max_new_tokens"] == 4 and model.seen["do_sample"] is True
