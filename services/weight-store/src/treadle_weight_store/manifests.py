"""What the store reads out of a manifest: the chunks it names and its tensors' bytes."""

from __future__ import annotations

from collections import OrderedDict

from treadle_common.proto.treadle.v1 import weights_pb2 as pb


def manifest_chunks(manifest: pb.WeightManifest) -> set[str]:
    refs = {c.hash for t in manifest.tensors for c in t.chunks}
    return refs | {c.hash for a in manifest.assets for c in a.chunks}


class ChunkSets:
    """`manifest_chunks` and the tensors' byte count, read once per manifest object (the
    most recent `max_entries`).

    Reading a manifest's chunk list back out of protobuf costs about 1.7 us a chunk (0.5 ms
    for SmolLM2's 298): the garbage collection after each publish did it for every version
    it keeps, the write-behind for every pending version after each batch it wrote, and
    `ListVersions` for every version, all on the event loop. A hit needs the very object the
    figures were read from (held here, so its id stays its own): a manifest parsed again, or
    another one under the same name and version, is read anew. A manifest's chunks must not
    change once it is looked up here (committed ones do not)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._read: OrderedDict[tuple[str, int], tuple[pb.WeightManifest, frozenset[str], int]] = (
            OrderedDict()
        )

    def __call__(self, manifest: pb.WeightManifest) -> frozenset[str]:
        return self._facts(manifest)[1]

    def num_bytes(self, manifest: pb.WeightManifest) -> int:
        """The bytes of the manifest's tensors."""
        return self._facts(manifest)[2]

    def _facts(self, manifest: pb.WeightManifest) -> tuple[pb.WeightManifest, frozenset[str], int]:
        key = (manifest.model, manifest.version)
        held = self._read.get(key)
        if held is not None and held[0] is manifest:
            self._read.move_to_end(key)
            return held
        size = sum(c.size for t in manifest.tensors for c in t.chunks)
        facts = (manifest, frozenset(manifest_chunks(manifest)), size)
        self._read[key] = facts
        self._read.move_to_end(key)
        while len(self._read) > self.max_entries:
            self._read.popitem(last=False)
        return facts
