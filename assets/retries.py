"""Step retries of a landed file's run: bounded, with backoff, for transient failures only.

A landed file's run (``file_ingestion``) gets a Dagster :class:`~dagster.RetryPolicy`
from the ``ingestion`` section of the pipeline config (:func:`retry_policy`). Which
failures it retries is decided here (:func:`classified_failures`):

- *transient*, retried: a backend away for longer than the library's own retries
  (:class:`~persist_pipeline.exceptions.Unavailable`), a commit whose outcome could not
  be confirmed (:class:`~persist_pipeline.exceptions.Indeterminate`), parts uploaded too
  long ago to commit (:class:`~persist_pipeline.exceptions.CommitDeadlineExceeded`), a
  writer lease lost to a pause, an OS-level I/O or network error, and the shard's upper
  moving on every attempt (a ``dg.Failure`` raised with ``allow_retries=True``);
- *permanent*, failed once with their own message (``dg.Failure(allow_retries=False)``):
  a bad file, a row naming no shard of its route, a closed shard, a shard name
  registered for another shard, another run already ingesting the file, a write whose
  outcome GC made unknowable (:class:`~persist_pipeline.exceptions.UnsettledCommit`),
  every other library error (bad input, corrupt data, rejected credentials, a missing
  location) and any other exception (a bug is not fixed by running it again).

A retry cannot write a file twice: each attempt settles the writes earlier attempts (and
earlier runs) recorded before committing (:func:`assets.ingestion.settle_intents`), so a
retry after a commit that landed without its reply records that write instead of
repeating it.
"""

# No `from __future__ import annotations` here, like the other asset modules.

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from assets.pipeline_config import IngestionConfig
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    Indeterminate,
    LeaseExpired,
    PersistError,
    Unavailable,
    UnsettledCommit,
)

_BACKOFF = {"exponential": dg.Backoff.EXPONENTIAL, "linear": dg.Backoff.LINEAR,
            "constant": None}
_JITTER = {"plus_minus": dg.Jitter.PLUS_MINUS, "full": dg.Jitter.FULL, "none": None}

#: What the message of a failed run of a landed file tells the user to do.
RERUN = ("re-run this partition once the backend is back: the file is settled or "
         "written, never twice")


def retry_policy(config: IngestionConfig) -> dg.RetryPolicy | None:
    """The step retry policy of ``config`` (None: ``retries: 0``, one attempt)."""
    if config.retries == 0:
        return None
    return dg.RetryPolicy(max_retries=config.retries, delay=config.retry_delay_s,
                          backoff=_BACKOFF[config.retry_backoff],
                          jitter=_JITTER[config.retry_jitter])


def is_transient(error: BaseException) -> bool:
    """Whether running the step again may succeed where this attempt failed."""
    if isinstance(error, dg.Failure):
        return error.allow_retries
    if isinstance(error, UnsettledCommit):
        return False  # GC truncated what would tell: no later attempt can tell either
    if isinstance(error, Unavailable | Indeterminate | CommitDeadlineExceeded |
                  LeaseExpired):
        return True
    if isinstance(error, PersistError):
        return False
    return isinstance(error, OSError)


@contextmanager
def classified_failures(context: dg.AssetExecutionContext,
                        config: IngestionConfig) -> Iterator[None]:
    """Re-raise the step's failure as a ``dg.Failure`` the retry policy retries if and
    only if it is transient (:func:`is_transient`), saying which attempt it was."""
    try:
        yield
    except (dg.DagsterError, dg.RetryRequested):
        raise  # Dagster's own: it knows what they mean
    except dg.Failure as e:
        if not e.allow_retries:
            raise
        raise dg.Failure(description=_transient(context, config, e.description or str(e)),
                         metadata=e.metadata) from e
    except Exception as e:
        what = f"{type(e).__name__}: {e}"
        if is_transient(e):
            raise dg.Failure(description=_transient(context, config, what)) from e
        raise dg.Failure(description=what, allow_retries=False) from e


def _transient(context: dg.AssetExecutionContext, config: IngestionConfig,
               what: str) -> str:
    attempt, attempts = context.retry_number + 1, config.retries + 1
    then = (f"retried automatically ({attempts - attempt} more attempt(s))"
            if attempt < attempts else RERUN)
    return f"{what} (transient: attempt {attempt} of {attempts}; {then})"
