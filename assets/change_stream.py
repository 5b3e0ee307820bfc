"""The built-in synthetic change stream: inserts, updates and deletes as +1/-1 diffs.

Step ``n`` of the stream is a pure function of ``n``: its events are global event
numbers ``n*E .. n*E+E-1``; event ``j`` touches key ``j % K`` for the ``j // K``-th time,
and the key's value after each touch (or its absence, for a delete) is derived from a
hash. So a write at upper ``n`` needs no memory of earlier writes, two writers racing for
the same upper produce identical updates, and the exact collection after any number of
steps can be computed for verification (:meth:`ChangeStream.collection`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa

from persist_pipeline.updates import SCHEMA


@dataclass(frozen=True)
class StepChanges:
    """The updates of one step and how many of each change they hold."""

    table: pa.Table
    inserts: int
    updates: int
    deletes: int


@dataclass(frozen=True)
class ChangeStream:
    """A deterministic stream of changes over ``keys`` keys.

    Attributes:
        keys: size of the key space.
        events_per_write: changes per step.
        seed: selects the stream.
        value_bytes: approximate size of a value.
        delete_one_in: a touch after the first deletes the key with probability 1/N.
    """

    keys: int = 200
    events_per_write: int = 25
    seed: int = 0
    value_bytes: int = 24
    delete_one_in: int = 5

    def key(self, index: int) -> bytes:
        return f"key-{index:06d}".encode()

    def value_after(self, key: int, touch: int) -> bytes | None:
        """The value of ``key`` after its ``touch``-th change (None: deleted)."""
        if touch < 0:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{key}:{touch}".encode(), digest_size=16)
        raw = digest.digest()
        if touch > 0 and raw[0] % self.delete_one_in == 0:
            return None
        text = f"v{touch}:{digest.hexdigest()}"
        return (text * (self.value_bytes // len(text) + 1))[: self.value_bytes].encode()

    def changes(self, step: int, t: int | None = None) -> StepChanges:
        """The updates of step ``step``, all at time ``t`` (default ``step``)."""
        t = step if t is None else t
        ks: list[bytes] = []
        vs: list[bytes] = []
        ds: list[int] = []
        counts = {"insert": 0, "update": 0, "delete": 0}
        first = step * self.events_per_write
        for j in range(first, first + self.events_per_write):
            key, touch = j % self.keys, j // self.keys
            before, after = self.value_after(key, touch - 1), self.value_after(key, touch)
            if before == after:
                continue
            if before is not None:
                ks.append(self.key(key))
                vs.append(before)
                ds.append(-1)
            if after is not None:
                ks.append(self.key(key))
                vs.append(after)
                ds.append(1)
            kind = "insert" if before is None else ("delete" if after is None else "update")
            counts[kind] += 1
        table = pa.Table.from_arrays(
            [pa.array(ks, pa.binary()), pa.array(vs, pa.binary()),
             pa.array([t] * len(ks), pa.int64()), pa.array(ds, pa.int64())], schema=SCHEMA)
        return StepChanges(table, counts["insert"], counts["update"], counts["delete"])

    def collection(self, steps: int) -> dict[bytes, bytes]:
        """The collection after steps ``0 .. steps-1``: ``{key: value}``."""
        events = steps * self.events_per_write
        out = {}
        for key in range(min(self.keys, events)):
            touches = (events - 1 - key) // self.keys  # the last touch's number
            value = self.value_after(key, touches)
            if value is not None:
                out[self.key(key)] = value
        return out
