"""Identifiers: shards, writers, readers and parts, all ``<prefix><uuid>`` strings."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from persist_pipeline.exceptions import InvalidShardId


@dataclass(frozen=True, slots=True, order=True)
class ShardId:
    """The id of a shard: prints as ``s`` followed by a UUID.

    Use :meth:`new` to mint one and :meth:`parse` to validate user input.
    """

    uuid: uuid.UUID

    @classmethod
    def new(cls) -> ShardId:
        """Return a fresh random shard id."""
        return cls(uuid.uuid4())

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


def new_writer_id() -> str:
    """A fresh writer id (``w<uuid>``)."""
    return f"w{uuid.uuid4()}"


def new_reader_id() -> str:
    """A fresh leased reader id (``r<uuid>``)."""
    return f"r{uuid.uuid4()}"


def new_critical_reader_id() -> str:
    """A fresh critical reader id (``c<uuid>``); callers usually persist and reuse it."""
    return f"c{uuid.uuid4()}"


def new_token() -> str:
    """A fresh idempotency token or part id."""
    return uuid.uuid4().hex
