#!/bin/sh
# One-shot setup of the MinIO server (service minio-setup, image minio/mc): the bucket
# persist writes to, and a user that may use only that bucket. Idempotent: safe on every
# `docker compose up`. Credentials come from the environment (.env), never from this file.
set -eu

mc alias set local "${MINIO_URL:-http://minio:9000}" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
mc mb --ignore-existing "local/$PERSIST_BUCKET"

cat > /tmp/persist-policy.json <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
     "Resource": ["arn:aws:s3:::$PERSIST_BUCKET"]},
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
     "Resource": ["arn:aws:s3:::$PERSIST_BUCKET/*"]}
  ]
}
JSON
mc admin policy create local persist-readwrite /tmp/persist-policy.json
mc admin user add local "$PERSIST_S3_ACCESS_KEY_ID" "$PERSIST_S3_SECRET_ACCESS_KEY"
mc admin policy attach local persist-readwrite --user "$PERSIST_S3_ACCESS_KEY_ID" \
    || echo "policy persist-readwrite already attached to $PERSIST_S3_ACCESS_KEY_ID"
echo "create-bucket.sh: bucket $PERSIST_BUCKET ready for user $PERSIST_S3_ACCESS_KEY_ID"
