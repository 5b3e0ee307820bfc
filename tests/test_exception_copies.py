"""Errors survive copy and pickle with their fields: the group-commit funnel gives each
waiting append its own copy of a group's error (copy.copy), and errors raised in worker
processes reach their caller pickled. An error whose copy raises TypeError would leave
the funnel's waiting appends unfinished and a worker's failure unreadable."""

from __future__ import annotations

import copy
import pickle

import pytest

from persist_pipeline import exceptions as ex

ERRORS: list[ex.PersistError] = [
    ex.UpperMismatch(3, 7, "s1"),
    ex.UpperMismatch(None, 2),
    ex.FencedOut(b"mine", b"theirs"),
    ex.DiffOverflow(b"k", b"v", 5, 2**63, "s2"),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("how", ["copy", "pickle"])
def test_error_copies_keep_type_message_and_fields(err: ex.PersistError, how: str) -> None:
    got = copy.copy(err) if how == "copy" else pickle.loads(pickle.dumps(err))
    assert type(got) is type(err)
    assert str(got) == str(err)
    assert vars(got) == vars(err)
