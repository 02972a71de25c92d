"""Grammar-constrained decoding in the hf engine, with llguidance (a Rust library with Python
bindings, the same that vLLM's `guidance` backend uses): per generation a matcher of its
`Sampling.grammar` (`treadle_rollout.structured` writes them), which masks the logits of each
step to the tokens the grammar allows and takes the token sampled. Each constrained row of a
batch is masked in place; unconstrained rows are untouched. A tool-call grammar's mask took
0.06 to 0.14 ms a step (median; the tiny test model's 328-token vocabulary and SmolLM2's
49,152) on the 2-core dev VM.
"""

from __future__ import annotations

from typing import Any

import torch


class Constraint:
    """One generation's grammar state (llguidance): which tokens may come next, advanced by
    each token sampled. `tokenizer` is the engine's llguidance tokenizer (`llg_tokenizer`)."""

    def __init__(self, tokenizer: Any, grammar: str):
        import llguidance

        self.matcher = llguidance.LLMatcher(
            tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar)
        )
        if self.matcher.is_error():
            raise ValueError(f"the output grammar does not compile: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, one bit each (int32 words, little-endian)."""
        return torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)

    def advance(self, token: int) -> None:
        """Take the sampled token. Once the grammar is complete, the next mask allows only
        the end-of-text tokens: the generation ends as any other does, with one."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"sampled a token the grammar forbids: {self.matcher.get_error()}")

    def reset(self) -> None:
        self.matcher.reset()


def llg_tokenizer(tokenizer: Any, vocab_size: int, end_ids: list[int]) -> Any:
    """llguidance's view of an HF tokenizer; `end_ids` end a generation whose grammar is
    complete (the model's end of text and of turn)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_ids)


def apply_masks(logits_B_V: torch.Tensor, constraints: list[tuple[int, Constraint]]) -> None:
    """Disallowed tokens of each constrained row to -inf, in place (rows without a
    constraint are untouched). Unpacked with plain tensor ops: `llguidance.torch` compiles
    its kernel with `torch.compile` (seconds at the first call, a C compiler at run time)."""
    vocab = logits_B_V.shape[1]
    bits = torch.arange(32, dtype=torch.int32)
    for row, constraint in constraints:
        allowed_V = ((constraint.allowed().unsqueeze(-1) >> bits) & 1).reshape(-1)
        allowed_V = torch.nn.functional.pad(allowed_V, (0, max(0, vocab - len(allowed_V))))
        logits_B_V[row].masked_fill_(allowed_V[:vocab].to(logits_B_V.device) == 0, float("-inf"))
