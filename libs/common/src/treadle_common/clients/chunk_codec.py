"""Copy-free protobuf wire codec for the two messages that carry chunk bytes.

`PublishRequest{chunk = 1: Chunk{hash = 1, data = 2}}` and `FetchResponse{chunk = 1: Chunk}`
move every byte of every weight. Both encode a chunk identically, so the store keeps a
received publish message as the chunk's *frame* and serves it as the fetch message. The
bytes on the wire are the protobuf encoding of those messages (tests check it both ways
against the generated classes), so any protobuf client interoperates; the codec only avoids
protobuf's copies of multi-megabyte payloads: encoding joins a small header with the payload
once, decoding returns a `memoryview` into the received buffer. Every other message, and the
manifest variants, go through protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle_common.proto.treadle.v1 import weights_pb2 as pb

_LEN = 2  # wire type of length-delimited fields
CHUNK_FIELD = 1  # in both PublishRequest and FetchResponse


@dataclass(slots=True)
class ChunkView:
    """A chunk whose bytes live in a buffer owned by someone else (no copy)."""

    hash: str
    data: memoryview | bytes
    frame: bytes | None = None
    """The whole encoded message the chunk was decoded from (reusable as is)."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview) -> list[tuple[int, memoryview]] | None:
    """Length-delimited fields of a message, or None if it has any other wire type."""
    out, pos = [], 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        if tag & 7 != _LEN:
            return None
        size, pos = _read_varint(buf, pos)
        out.append((tag >> 3, buf[pos : pos + size]))
        pos += size
    return out


def chunk_header(field: int, digest: str, size: int) -> bytes:
    """Wire bytes that precede the payload in a message whose field `field` is a Chunk."""
    hash_bytes = digest.encode()
    inner = b"\x0a" + _varint(len(hash_bytes)) + hash_bytes + b"\x12" + _varint(size)
    return bytes([field << 3 | _LEN]) + _varint(len(inner) + size) + inner


def encode_chunk(field: int, digest: str, data: memoryview | bytes) -> bytes:
    """Wire bytes of a message whose field `field` is `Chunk{hash, data}`."""
    return b"".join((chunk_header(field, digest, len(data)), data))


def decode_chunk(raw: bytes, field: int) -> ChunkView | None:
    """The chunk in field `field`, viewed in place; None if the message is something else."""
    outer = _fields(memoryview(raw))
    if outer is None or len(outer) != 1 or outer[0][0] != field:
        return None
    inner = _fields(outer[0][1])
    if inner is None:
        return None
    parts = dict(inner)
    digest = bytes(parts.get(1, b"")).decode()
    return ChunkView(hash=digest, data=parts.get(2, memoryview(b"")), frame=raw)


def frame_header(digest: str, size: int) -> bytes:
    """A stored chunk is kept as its complete encoded message (a *frame*): this header, then
    the payload. Serving a chunk is then sending the stored bytes as they are."""
    return chunk_header(CHUNK_FIELD, digest, size)


def frame_payload(frame: bytes) -> ChunkView | None:
    """The chunk inside a stored frame, or None if the frame is malformed."""
    try:
        return decode_chunk(frame, CHUNK_FIELD)
    except (IndexError, UnicodeDecodeError):  # truncated varint, garbage hash
        return None


# -- gRPC (de)serializers ----------------------------------------------------------------------
def serialize_publish_request(item: ChunkView | pb.PublishRequest) -> bytes:
    if isinstance(item, ChunkView):
        return encode_chunk(CHUNK_FIELD, item.hash, item.data)
    return item.SerializeToString()


def deserialize_publish_request(raw: bytes) -> ChunkView | pb.PublishRequest:
    return decode_chunk(raw, CHUNK_FIELD) or pb.PublishRequest.FromString(raw)


def serialize_fetch_response(item: bytes | ChunkView | pb.FetchResponse) -> bytes:
    if isinstance(item, bytes):  # a stored frame: already the encoded message
        return item
    if isinstance(item, ChunkView):
        return encode_chunk(CHUNK_FIELD, item.hash, item.data)
    return item.SerializeToString()


def deserialize_fetch_response(raw: bytes) -> ChunkView | pb.FetchResponse:
    return decode_chunk(raw, CHUNK_FIELD) or pb.FetchResponse.FromString(raw)
