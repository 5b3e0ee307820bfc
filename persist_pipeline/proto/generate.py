"""Regenerate ``persist_pb2.py`` / ``.pyi`` from ``persist.proto`` (``make proto``).

``python -m persist_pipeline.proto.generate --check`` exits 1 if the committed files
differ from what the current ``persist.proto`` generates.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
OUTPUTS = ("persist_pb2.py", "persist_pb2.pyi")


def generate(out_root: Path) -> dict[str, bytes]:
    """Run protoc into ``out_root`` and return the generated files' bytes by name."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        str(PROTO_DIR / "persist.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = out_root / "persist_pipeline" / "proto"
    return {name: (generated / name).read_bytes() for name in OUTPUTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    stale = [n for n, data in fresh.items()
             if not (PROTO_DIR / n).exists() or (PROTO_DIR / n).read_bytes() != data]
    if args.check:
        if stale:
            print(f"stale generated protobuf code: {', '.join(stale)}; run `make proto`")
            return 1
        return 0
    for name, data in fresh.items():
        (PROTO_DIR / name).write_bytes(data)
    print(f"wrote {', '.join(OUTPUTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
