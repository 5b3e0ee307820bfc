"""The simulated consensus and blob stores: in memory, with a yield point before and
after every call, injected failures, and the monitor told about every change.

A call fails *before* it takes effect (nothing happened) or *after* (it took effect and
the reply was lost); either way the caller sees the backend's "unavailable" error, as
it would from PostgreSQL or S3. A store can also be down for a while (an outage):
every call to it fails before it takes effect until it is back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from persist_pipeline.blob.base import Blob, BlobMeta
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.consensus.memory import MemoryConsensus
from persist_pipeline.exceptions import BlobUnavailable, ConsensusUnavailable
from persist_pipeline.internal.paths import is_rollup_key
from persist_pipeline.sim.scheduler import Scheduler

if TYPE_CHECKING:
    from persist_pipeline.sim.monitor import Monitors

T = TypeVar("T")


def _call(s: Scheduler, what: str, op: Callable[[], T], error: type[Exception],
          mutates: bool, at_cas: bool = False) -> T:
    s.yield_point(at_cas)
    store = what.split(" ", 1)[0]
    if s.store_down(store):
        s.stats.failed_calls += 1
        raise error(f"simulated: {store} is down ({what} did not take effect)")
    if s.roll(s.nemesis.fail_before):
        s.stats.failed_calls += 1
        raise error(f"simulated: {what} failed before it took effect")
    result = op()
    if at_cas and mutates and result and s.roll(s.nemesis.pause_then_lose):
        s.stats.lost_replies += 1
        s.pause_process(s.rng.choice(s.nemesis.pause_then_lose_s))
        raise error(f"simulated: {what} took effect, its process paused, and its reply was "
                    f"lost")
    s.yield_point(at_cas)  # the reply is on its way: others run now
    if s.roll(s.nemesis.fail_after):
        if mutates:
            s.stats.lost_replies += 1
        else:
            s.stats.failed_calls += 1
        raise error(f"simulated: {what} took effect but its reply was lost")
    return result


class SimConsensus(Consensus):
    """:class:`MemoryConsensus` with yield points, faults and a monitor."""

    def __init__(self, scheduler: Scheduler, monitor: Monitors) -> None:
        self._s = scheduler
        self._inner = MemoryConsensus()
        self._monitor = monitor

    def head(self, shard: str) -> VersionedData | None:
        return _call(self._s, "consensus head", lambda: self._inner.head(shard),
                     ConsensusUnavailable, False)

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        def op() -> bool:
            ok = self._inner.compare_and_set(shard, expected, new)
            if ok:
                self._monitor.on_commit(shard, new)
            return ok

        return _call(self._s, "consensus compare_and_set", op, ConsensusUnavailable, True,
                     at_cas=True)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        def op() -> bool:
            ok = self._inner.compare_and_set_many(writes)
            if ok:
                for write in writes:
                    self._monitor.on_commit(write.shard, write.new)
            return ok

        return _call(self._s, "consensus compare_and_set_many", op, ConsensusUnavailable, True,
                     at_cas=True)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return _call(self._s, "consensus scan",
                     lambda: self._inner.scan(shard, from_seqno, limit),
                     ConsensusUnavailable, False)

    def truncate(self, shard: str, seqno: int) -> int:
        def op() -> int:
            self._monitor.on_truncate(shard, seqno)
            return self._inner.truncate(shard, seqno)

        return _call(self._s, "consensus truncate", op, ConsensusUnavailable, True)

    def list_shards(self) -> list[str]:
        return _call(self._s, "consensus list_shards", self._inner.list_shards,
                     ConsensusUnavailable, False)

    def list_heads(self) -> Mapping[str, VersionedData]:
        return _call(self._s, "consensus list_heads", self._inner.list_heads,
                     ConsensusUnavailable, False)

    # The driver's view, no faults and no yields.
    def records(self, shard: str) -> list[VersionedData]:
        return self._inner.scan(shard, 0)


class SimBlob(Blob):
    """An in-memory object store whose modification times are simulated."""

    kind = "sim"

    def __init__(self, name: str, scheduler: Scheduler, monitor: Monitors,
                 skew_s: float = 0.0) -> None:
        self.name = name
        self._s = scheduler
        self._monitor = monitor
        #: The store's own clock is this far from true time (it stamps objects with it).
        self.skew_s = skew_s
        self.objects: dict[str, tuple[bytes, float]] = {}
        self._went_bad: set[str] = set()

    def get(self, key: str) -> bytes | None:
        def op() -> bytes | None:
            entry = self.objects.get(key)
            return None if entry is None else entry[0]

        return self._bad_read(key, _call(self._s, f"{self.name} get", op, BlobUnavailable,
                                         False))

    def _bad_read(self, key: str, value: bytes | None) -> bytes | None:
        """``value`` as read, now and then with a bit flipped (see ``Nemesis.bad_read``;
        no draw at all when it is off, so other profiles' seeds are unchanged)."""
        s = self._s
        if value is None or not value or s.nemesis.bad_read == 0.0 or key in self._went_bad \
                or not (key.endswith(".parquet") or is_rollup_key(key)):
            return value
        if not s.roll(s.nemesis.bad_read):
            return value
        self._went_bad.add(key)
        s.stats.bad_reads += 1
        flipped = bytearray(value)
        flipped[s.rng.randrange(len(flipped))] ^= 1 << s.rng.randrange(8)
        return bytes(flipped)

    def set(self, key: str, value: bytes) -> None:
        def op() -> None:
            self.objects[key] = (bytes(value), self._s.now + self.skew_s)

        _call(self._s, f"{self.name} set", op, BlobUnavailable, True)

    def delete(self, key: str) -> int | None:
        def op() -> int | None:
            entry = self.objects.pop(key, None)
            if entry is None:
                return None
            self._monitor.on_delete(self.name, key)
            return len(entry[0])

        return _call(self._s, f"{self.name} delete", op, BlobUnavailable, True)

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        def op() -> list[BlobMeta]:
            return [BlobMeta(k, len(v[0]), v[1]) for k, v in sorted(self.objects.items())
                    if k.startswith(prefix)]

        return iter(_call(self._s, f"{self.name} list", op, BlobUnavailable, False))

    def describe(self) -> str:
        return f"sim://{self.name}"
