"""`treadle model import SRC NAME`: a model from outside as one Treadle serves and trains.

SRC is an HF model directory (`config.json` and weights, safetensors or not), a
`.safetensors` file inside one, or a GGUF file, which transformers dequantises (the `gguf`
package reads it) to fp32. The model is written as an HF directory: `config.json`, the
tokenizer with its chat template, `model.safetensors`, and `treadle-import.json` (what it
came from: the source's digest, its parameters and vocabulary). Importing the same source
into the same directory again reuses the directory.

Then the model is published to the weight store under NAME, once: when the latest version
of NAME holds exactly these tensors and files, it is that version (nothing is sent); else a
new version sends only the chunks the store lacks (the store is content-addressed).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from treadle_common.clients.weights import (
    RawTensor,
    WeightStoreClient,
    build_manifest,
    chunk_positions,
)
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime import durable

RECORD = "treadle-import.json"


@dataclass(frozen=True)
class Imported:
    """What an import wrote (and what `treadle-import.json` records)."""

    directory: str
    source: str
    source_digest: str
    """xxh3-128 of each file that makes the model (`durable.digest`), joined by ';'."""
    kind: str
    """`gguf` (dequantised) or `hf`."""
    architecture: str
    parameters: int
    vocab_size: int
    chat_template: bool
    reused: bool = False
    """The directory already held this import: nothing was converted."""


def _source(src: Path) -> tuple[str, Path, list[Path]]:
    """(kind, HF directory, the files whose bytes identify the model)."""
    if src.is_file() and src.suffix == ".gguf":
        return "gguf", src.parent, [src]
    directory = src.parent if src.is_file() and src.suffix == ".safetensors" else src
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"{src}: not a GGUF file, nor an HF model directory (or a .safetensors file in "
            "one) with its config.json"
        )
    weights = sorted(
        p for p in directory.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    if not weights:
        raise ValueError(f"{directory} holds no weights (*.safetensors, *.bin)")
    return "hf", directory, [directory / "config.json", *weights]


def import_model(src: Path, out_dir: Path) -> Imported:
    """Write SRC as an fp32 HF directory at `out_dir` (reused if it holds this import)."""
    kind, directory, identity = _source(src)
    digest = ";".join(durable.digest(path) for path in identity)
    record = out_dir / RECORD
    if record.is_file():
        done = json.loads(record.read_text())
        if done.get("source_digest") == digest:
            return Imported(**{**done, "reused": True})
        raise ValueError(f"{out_dir} holds another import ({done.get('source')}); choose --out")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty and holds no import: choose --out")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = {"gguf_file": src.name} if kind == "gguf" else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **gguf)
    staging = out_dir.with_name(out_dir.name + ".part")
    shutil.rmtree(staging, ignore_errors=True)
    _save(model, staging)
    tokenizer.save_pretrained(staging)
    imported = Imported(
        directory=str(out_dir.resolve()),
        source=str(src.resolve()),
        source_digest=digest,
        kind=kind,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=int(model.config.vocab_size),
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    fields = {k: v for k, v in asdict(imported).items() if k != "reused"}
    (staging / RECORD).write_text(json.dumps(fields, indent=2) + "\n")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above)
    staging.rename(out_dir)
    return imported


def _save(model: Any, directory: Path) -> None:
    """The model as plain fp32 safetensors and its config. transformers will not save a model
    it loaded from GGUF (it marks it quantised), but its tensors are dequantised: saved as
    they are, with a weight tied to another (the head to the embedding) left to the config."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = model.config
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    tied = set(_tied_names(model)) if getattr(config, "tie_word_embeddings", False) else set()
    tensors = {k: v.detach().contiguous() for k, v in state.items() if k not in tied}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _tied_names(model: Any) -> list[str]:
    """The names of the weights tied to another (transformers 5: a dict target -> source)."""
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return list(keys)


async def publish_once(client: WeightStoreClient, name: str, directory: Path) -> tuple[int, bool]:
    """(version, whether it was already there): the latest version of `name` when it holds
    exactly this directory's tensors and files, else a new one (only missing chunks sent)."""
    raw, assets = await asyncio.to_thread(_read, directory)
    if await client.latest(name) is not None:  # hashed here only to compare (publish hashes)
        latest = await client.get_manifest(name)
        manifest, _ = await asyncio.to_thread(build_manifest, name, raw, assets=assets)
        if _layout(latest) == _layout(manifest):
            return latest.version, True
    response = await client.publish(name, raw, trainer_step=0, assets=assets)
    return response.version, False


def _read(directory: Path) -> tuple[dict[str, RawTensor], dict[str, bytes]]:
    from safetensors.torch import load_file

    from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw

    tensors = load_file(str(directory / "model.safetensors"))
    return state_dict_to_raw(tensors), model_assets(directory)


def _layout(manifest: pb.WeightManifest) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """A version's content: its tensors' and its files' chunk hashes, by name."""
    files = {a.name: [c.hash for c in a.chunks] for a in manifest.assets}
    return chunk_positions(manifest), files
