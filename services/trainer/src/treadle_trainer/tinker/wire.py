"""The Tinker SDK's protobuf bodies, read and written with the SDK's own generated messages
(`tinker.proto.tinker_public_pb2`, pinned with the SDK): `forward_backward` requests come in
as protobuf (optionally zstd, `Content-Encoding: zstd`), and the SDK only accepts
`ForwardBackwardOutput` and `SampleResponse` results as protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from treadle_trainer.errors import InvalidInput
from treadle_trainer.tinker.adapters import TinkerDatum

MAX_DECOMPRESSED = 256 * 1024 * 1024
"""A zstd body may not inflate past this (a decompression bomb is refused)."""

_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[TinkerDatum]


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise InvalidInput(f"Content-Encoding {encoding!r} is not supported (zstd is)")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED)
    except zstandard.ZstdError as exc:
        raise InvalidInput(f"the zstd body does not decompress: {exc}") from exc


def _tensor(msg: pb.Tensor, what: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise InvalidInput(f"{what}: tensor dtype {msg.dtype} is not supported")
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        size = int(np.prod(list(msg.shape))) if msg.shape else 0
        if len(msg.shape) != 1 or len(cols) != len(values) or (len(cols) and cols.max() >= size):
            raise InvalidInput(f"{what}: only 1-d sparse tensors with in-range columns are read")
        dense = np.zeros(size, dtype=dtype)
        dense[cols] = values
        return dense
    array = np.frombuffer(msg.dense, dtype=dtype)
    if msg.shape and int(np.prod(list(msg.shape))) != array.size:
        raise InvalidInput(f"{what}: shape {list(msg.shape)} does not match {array.size} values")
    if len(msg.shape) > 1:
        raise InvalidInput(f"{what}: only 1-d loss inputs are read")
    return array


def _datum(msg: pb.Datum, i: int) -> TinkerDatum:
    parts: list[np.ndarray] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidInput(
                f"data[{i}]: model_input chunk {kind!r} is not supported (text only)"
            )
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    inputs = {
        k: _tensor(v, f"data[{i}].loss_fn_inputs[{k!r}]") for k, v in msg.loss_fn_inputs.items()
    }
    return TinkerDatum(tokens=tokens, inputs=inputs)


def read_forward_backward(body: bytes) -> ForwardBackward:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidInput(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise InvalidInput(f"loss_fn_config[{key!r}] must be a number")
        config[key] = float(value.number)
    return ForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=[_datum(d, i) for i, d in enumerate(msg.data)],
    )


def _batched_float32(per_datum: list[np.ndarray]) -> pb.BatchedTensor:
    arrays = [np.ascontiguousarray(x, dtype=np.float32) for x in per_datum]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    data = b"".join(a.tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """One `ArrayRecord` with a float32 field per output name, one entry per datum."""
    names = list(outputs[0]) if outputs else []
    record = pb.ArrayRecord(
        type_tag="ArrayRecord",
        num_datums=len(outputs),
        fields={n: _batched_float32([o[n] for o in outputs]) for n in names},
    )
    msg = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics
    )
    return msg.SerializeToString()


def sample_response(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None
) -> bytes:
    """Sequences as (tokens, logprobs, stop reason `stop` | `length`)."""
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse(
        sequences=[
            pb.SampledSequence(
                tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
                stop_reason=reasons[reason],
            )
            for tokens, logprobs, reason in sequences
        ]
    )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
