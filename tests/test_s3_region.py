"""One rule for the S3 signing region, shared by the blob store's boto3 client and the
read plan's pyarrow filesystem: the URI's ``region``, else the AWS configuration's, else
us-east-1."""

from __future__ import annotations

import pytest

from persist_pipeline.blob import open_blob
from persist_pipeline.plan import blob_filesystem


@pytest.mark.parametrize(("uri_region", "env_region", "expected"), [
    ("eu-central-1", "ap-south-1", "eu-central-1"),
    (None, "ap-south-1", "ap-south-1"),
    (None, None, "us-east-1"),
])
def test_blob_store_and_plan_filesystem_sign_for_the_same_region(
        monkeypatch: pytest.MonkeyPatch, tmp_path, uri_region: str | None,
        env_region: str | None, expected: str):
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    if env_region:
        monkeypatch.setenv("AWS_DEFAULT_REGION", env_region)
    query = f"?endpoint_url=http://127.0.0.1:9&region={uri_region}" if uri_region else \
        "?endpoint_url=http://127.0.0.1:9"
    blob = open_blob(f"s3://bucket/prefix{query}")
    assert blob.signing_region == expected  # type: ignore[attr-defined]
    assert blob_filesystem(blob).region == expected
