"""``make nemesis``: a long nemesis run on real PostgreSQL and a real S3 endpoint, here.

Starts a throwaway PostgreSQL cluster (so restarting it mid-run disturbs nothing else)
and moto's S3 server on loopback, runs ``persist-pipeline nemesis`` against them, and
exits with its status. Needs the dev extra (moto) and PostgreSQL's server binaries.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.postgres import ThrowawayCluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--fault-rate", type=float, default=0.02)
    parser.add_argument("--s3-log", type=Path, default=Path(".nemesis/s3-server.log"),
                        help="where the S3 server's request log goes (not the terminal)")
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "nemesis", "AWS_SECRET_ACCESS_KEY": "nemesis",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    # The S3 server logs every request: to a file, so the terminal shows the progress.
    args.s3_log.parent.mkdir(parents=True, exist_ok=True)
    request_log = logging.getLogger("werkzeug")
    request_log.handlers[:] = [logging.FileHandler(args.s3_log)]
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
    print(f"nemesis: the S3 server's request log is in {args.s3_log}", flush=True)
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    s3.start()
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"nemesis-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    cluster = ThrowawayCluster()
    try:
        from persist_pipeline.cli import main as cli

        argv = ["--consensus", cluster.server.url("postgres"),
                "--blob", f"s3://{bucket}/persist?endpoint_url={endpoint}&region=us-east-1",
                "nemesis", "--seconds", str(args.seconds), "--writers", str(args.writers),
                "--fault-rate", str(args.fault_rate),
                "--pg-restart", " ".join(cluster.restart_command())]
        if args.seed is not None:
            argv += ["--seed", str(args.seed)]
        return cli(argv)
    finally:
        cluster.stop()
        s3.stop()


if __name__ == "__main__":
    raise SystemExit(main())
