"""The generated protobuf code is reproducible from persist.proto."""

from __future__ import annotations

from persist_pipeline.proto import generate


def test_generated_code_is_not_stale():
    assert generate.main(["--check"]) == 0, "run `make proto` and commit the result"
