"""Identifiers: shards, writers, readers and parts, all ``<prefix><uuid>`` strings."""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from persist_pipeline.exceptions import InvalidInput, InvalidShardId

#: The namespace of the ids :meth:`ShardId.for_pipeline_name` derives.
PIPELINE_SHARD_NAMESPACE = uuid.UUID("6f1d3c52-2b4e-4d0a-9a51-7d0c8e2f4b11")


@dataclass(frozen=True, slots=True, order=True)
class ShardId:
    """The id of a shard: prints as ``s`` followed by a UUID.

    Use :meth:`new` to mint one and :meth:`parse` to validate user input.
    """

    uuid: uuid.UUID

    @classmethod
    def new(cls) -> ShardId:
        """Return a fresh random shard id."""
        return cls(random_uuid())

    @classmethod
    def for_pipeline_name(cls, name: str) -> ShardId:
        """The id a pipeline config's shard ``name`` gets when the config gives none:
        the same for every reader of the config, forever."""
        return cls(uuid.uuid5(PIPELINE_SHARD_NAMESPACE, name))

    @classmethod
    def parse(cls, text: str | ShardId) -> ShardId:
        """Parse ``s<uuid>``; raises :class:`InvalidShardId` on anything else."""
        if isinstance(text, ShardId):
            return text
        if not isinstance(text, str):
            raise InvalidShardId("shard id must be a string like 's<uuid>', "
                                 f"got {type(text).__name__}")
        if len(text) != 37 or not text.startswith("s"):
            raise InvalidShardId(f"malformed shard id {text[:80]!r}: expected 's' + a 36-char UUID")
        try:
            parsed = uuid.UUID(text[1:])
        except ValueError:
            raise InvalidShardId(f"malformed shard id {text!r}: not a UUID after 's'") from None
        if str(parsed) != text[1:].lower():
            raise InvalidShardId(f"malformed shard id {text!r}: expected the canonical UUID form")
        return cls(parsed)

    def __str__(self) -> str:
        return f"s{self.uuid}"

    def __repr__(self) -> str:
        return f"ShardId({str(self)!r})"


_SEEDED: random.Random | None = None


def random_uuid() -> uuid.UUID:
    """A random UUID: ``uuid4``, or drawn from a seeded generator inside :func:`seeded_ids`."""
    if _SEEDED is None:
        return uuid.uuid4()
    return uuid.UUID(int=_SEEDED.getrandbits(128), version=4)


@contextmanager
def seeded_ids(rng: random.Random) -> Iterator[None]:
    """Draw every id from ``rng`` (the deterministic simulation replays runs by seed)."""
    global _SEEDED
    previous, _SEEDED = _SEEDED, rng
    try:
        yield
    finally:
        _SEEDED = previous


def new_writer_id() -> str:
    """A fresh writer id (``w<uuid>``)."""
    return f"w{random_uuid()}"


def new_reader_id() -> str:
    """A fresh leased reader id (``r<uuid>``)."""
    return f"r{random_uuid()}"


def new_critical_reader_id() -> str:
    """A fresh critical reader id (``c<uuid>``); callers usually persist and reuse it."""
    return f"c{random_uuid()}"


#: uuid4's version and variant bits: what :func:`new_token` clears and sets.
_UUID4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_UUID4_SET = (0x8000 << 48) | (4 << 76)


#: Random 16-byte draws not handed out yet (see :func:`_random16`).
_POOL: list[bytes] = []
#: Draws taken from the OS at once: one system call per this many tokens.
_POOL_DRAWS = 256


def _random16() -> bytes:
    """16 bytes from the OS's random source, drawn in bulk.

    ``os.urandom`` lets go of the interpreter lock for its system call: once per write,
    each of a busy process's threads handed the lock to another and queued to get it
    back (in a group commit, most of a write's wait). Drawn 256 at a time, every token
    is still its own OS randomness, never shared: ``list.pop`` hands each draw to one
    caller (it is atomic under the interpreter lock), and a forked child drops the
    parent's undrawn ones (see ``register_at_fork`` below) rather than repeat them."""
    while True:
        try:
            return _POOL.pop()
        except IndexError:
            data = os.urandom(16 * _POOL_DRAWS)
            _POOL.extend([data[i:i + 16] for i in range(0, len(data), 16)])


# A child must never hand out the draws its parent holds (their tokens would collide).
os.register_at_fork(after_in_child=_POOL.clear)


def new_token() -> str:
    """A fresh idempotency token or part id: ``random_uuid().hex``, made without the
    UUID object when not seeded (every write takes one)."""
    if _SEEDED is not None:
        return random_uuid().hex
    bits = int.from_bytes(_random16(), "big") & _UUID4_CLEAR | _UUID4_SET
    return f"{bits:032x}"


#: What an idempotency token may be: it names a batch in the state and a blob folder
#: (``<shard>/p/b<token>/``), so it must be a single path segment that the state codec
#: stores as text and every blob store accepts as a key.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_token(token: object) -> str:
    """``token`` if it is a valid idempotency token, else :class:`InvalidInput`.

    A token is 1 to 128 characters of ``A-Z a-z 0-9 _ -`` (:func:`new_token` makes
    one). An empty token is refused rather than read as "no token": a retry that
    silently took a fresh token would lose its exactly-once protection."""
    if not isinstance(token, str):
        raise InvalidInput(f"idempotency_token must be a str of 1-128 characters "
                           f"[A-Za-z0-9_-] (e.g. new_token()), got {type(token).__name__}")
    if _TOKEN.fullmatch(token) is None:
        shown = token if len(token) <= 40 else f"{token[:40]}... ({len(token)} chars)"
        raise InvalidInput(f"idempotency_token must be 1-128 characters [A-Za-z0-9_-] "
                           f"(e.g. new_token()), got {shown!r}")
    return token


def batch_id(token: str) -> str:
    """The id of the batch a write with idempotency token ``token`` commits: derived from
    the token, so a write whose reply was lost finds its own batch in the state."""
    return f"b{token}"
