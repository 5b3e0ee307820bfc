"""Synthetic sorted runs for merge benchmarks and memory tests (no consensus needed).

``python -m persist_pipeline.examples.merge_data write DIR ROWS RUNS`` writes ``RUNS``
batches (the same updates whatever ``RUNS``) of 16-byte keys and 64-byte values as parts
in a local blob folder and a JSON manifest; ``... merge DIR BOUND_MIB`` merges them with
:func:`persist_pipeline.compaction.run_merge` and prints JSON with the peak RSS
(:func:`peak_rss_bytes`) of that process, which is what the memory tests and
``make bench`` measure (each in a fresh process, so the peak is the merge's own).

Runs overlap by half of their keys; a key's value is a function of the key and diffs are
+1 or -1, so a merge consolidates and cancels.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from persist_pipeline.blob.local import LocalBlob
from persist_pipeline.compaction import KeyRange, run_merge
from persist_pipeline.internal.blobs import PartWriter
from persist_pipeline.internal.state import Batch, Description, HollowPart
from persist_pipeline.internal.trace import MergeReq
from persist_pipeline.updates import SCHEMA, consolidate_sorted

SHARD = "s00000000-0000-0000-0000-000000000000"
#: Source runs of :func:`write_runs`: more runs deal the same updates out thinner.
SOURCES = 4
_LANES = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                   0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53,
                   0x2545F4914F6CDD1D, 0x94D049BB133111EB], dtype=np.uint64)


def write_runs(folder: Path, rows: int, runs: int, seed: int = 1,
               chunk_rows: int = 1_000_000) -> dict[str, object]:
    """Write ``runs`` sorted batches holding ``rows`` updates in all.

    The updates are those of :data:`SOURCES` (or fewer, if ``runs`` is smaller) source
    runs of ``rows / SOURCES`` updates: each holds each key of ``[0, 2 * rows /
    SOURCES)`` with probability one half, so sources overlap by half and a merge
    consolidates. Source ``s`` is dealt at random, row by row, to the batches ``r`` with
    ``r % SOURCES == s``: whatever ``runs``, the merge has the same output, and only the
    number of runs changes. Generated a slice at a time.
    """
    blob = LocalBlob(folder / "blobs", create=True)
    sources = max(1, min(SOURCES, runs))
    per_source = max(1, rows // sources)
    key_space = 2 * per_source
    step = 2 * chunk_rows
    batches: list[dict[str, object]] = [{} for _ in range(runs)]
    for s in range(sources):
        targets = list(range(s, runs, sources))
        writers = [PartWriter(SHARD, f"brun{r}", blob, "main", 64 << 20) for r in targets]
        written = [0] * len(targets)
        rng = np.random.default_rng(seed * 1000 + s)
        deal = np.random.default_rng(seed * 1000 + s + 500)
        for lo in range(0, key_space, step):
            width = min(step, key_space - lo)
            ids = (np.flatnonzero(rng.random(width) < 0.5) + lo).astype(np.uint64)
            diffs = np.where(rng.random(len(ids)) < 0.7, 1, -1)
            to = deal.integers(0, len(targets), len(ids)) if len(targets) > 1 else \
                np.zeros(len(ids), np.int64)
            for j, r in enumerate(targets):
                mine = to == j
                table = run_table_from_ids(ids[mine], diffs[mine], r)
                writers[j].write(table)
                written[j] += table.num_rows
        for j, r in enumerate(targets):
            parts = writers[j].finish()
            batches[r] = {"id": f"brun{r}", "rows": written[j],
                          "parts": [[p.key, p.encoded_size, p.num_updates, p.min_time,
                                     p.max_time, (p.min_key or b"").hex(),
                                     (p.max_key or b"").hex(), p.crc32, p.footer_crc32]
                                    for p in parts]}
    manifest = {"rows": sum(int(str(b["rows"])) for b in batches), "runs": runs,
                "batches": batches}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def run_table_from_ids(ids: np.ndarray, diffs: np.ndarray, t: int) -> pa.Table:
    """Updates at time ``t`` for sorted key ids: 16-byte keys (the id, big-endian, then
    a mix of it), 64-byte values (a function of the id), consolidated."""
    n = len(ids)
    with np.errstate(over="ignore"):
        mixed = ids * np.uint64(0x9E3779B97F4A7C15)
        key = np.empty((n, 2), dtype=">u8")  # big-endian: byte order is numeric order
        key[:, 0], key[:, 1] = ids, mixed
        val = (ids[:, None] * _LANES[None, :]).astype(">u8")
    keys = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n,
                                                [None, pa.py_buffer(key.tobytes())])
    vals = pa.FixedSizeBinaryArray.from_buffers(pa.binary(64), n,
                                                [None, pa.py_buffer(val.tobytes())])
    return consolidate_sorted(pa.table(
        [keys.cast(pa.binary()), vals.cast(pa.binary()), pa.array(np.full(n, t, np.int64)),
         pa.array(diffs.astype(np.int64))], schema=SCHEMA))


def load_request(folder: Path) -> MergeReq:
    """The merge request over every run of the manifest, since advanced past them all."""
    manifest = json.loads((folder / "manifest.json").read_text())
    inputs = []
    for t, b in enumerate(manifest["batches"]):
        # With the parts' CRC-32s (absent from manifests written before they were kept),
        # so that a benchmark merges through the checks compaction runs.
        parts = tuple(HollowPart(key, "main", size, n, lo, hi, bytes.fromhex(kmin) or None,
                                 bytes.fromhex(kmax) or None, *checksums)
                      for key, size, n, lo, hi, kmin, kmax, *checksums in b["parts"])
        inputs.append(Batch(b["id"], Description(t, t + 1, 0), parts, b["rows"]))
    runs = len(inputs)
    return MergeReq(0, tuple(inputs), Description(0, runs, runs - 1))


def merge(folder: Path, bound_bytes: int, key_range: KeyRange | None = None) -> dict[str, float]:
    """Merge the manifest's runs; the result's numbers and this process's peak RSS."""
    blob = LocalBlob(folder / "blobs")
    req = load_request(folder)
    started, cpu = time.perf_counter(), time.process_time()
    res = run_merge(req, SHARD, blob, None, 64 << 20, bound_bytes, key_range=key_range)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    for part in res.output.hollow_parts():
        blob.delete(part.key)
    rss = peak_rss_bytes()
    return {"rows_in": req.num_updates, "rows_out": res.output.num_updates,
            "parts_out": len(res.output.parts), "seconds": seconds, "cpu_seconds": cpu,
            "rows_per_s": req.num_updates / seconds, "peak_rss_bytes": rss}


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` of ``/proc/self/status``, which
    starts afresh at ``exec``. (``ru_maxrss`` does not on Linux: a child started by a
    large parent reports the parent's peak.) Falls back to ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "write":
        print(json.dumps({k: v for k, v in write_runs(Path(argv[1]), int(argv[2]),
                                                      int(argv[3])).items()
                          if k != "batches"}))
        return 0
    if len(argv) == 3 and argv[0] == "merge":
        print(json.dumps(merge(Path(argv[1]), int(float(argv[2]) * (1 << 20)))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
