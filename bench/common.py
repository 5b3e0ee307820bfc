"""Shared pieces of the benchmark cases: timing, result tables, targets and scales."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Timing:
    """Percentiles of a list of durations, in seconds."""

    n: int
    p50: float
    p90: float
    p99: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """Nearest-rank percentiles of ``samples`` (at least one)."""
        if not samples:
            raise ValueError("no samples")
        s = sorted(samples)
        return cls(len(s), percentile(s, 50), percentile(s, 90), percentile(s, 99),
                   sum(s) / len(s), s[0], s[-1])


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of already sorted samples."""
    rank = max(1, math.ceil(q / 100 * len(sorted_samples)))
    return sorted_samples[min(rank, len(sorted_samples)) - 1]


def measure(fn: Callable[[int], object], *, warmup: int, iters: int,
            before: Callable[[int], object] | None = None) -> list[float]:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``iters`` times timed.

    ``i`` counts on across warm-up and timed calls (so callers can derive timestamps);
    ``before(i)``, if given, runs untimed before each call (e.g. to rotate a shard). A
    full garbage collection runs before the timed calls, so that one case does not pay
    for another's garbage; the collector stays on while timing (its pauses are part of
    what a caller sees). Returns the timed durations in seconds.
    """
    for i in range(warmup):
        if before is not None:
            before(i)
        fn(i)
    gc.collect()
    samples = []
    for i in range(warmup, warmup + iters):
        if before is not None:
            before(i)
        started = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - started)
    return samples


def ms(seconds: float) -> str:
    """Seconds as milliseconds with sensible precision."""
    value = seconds * 1000
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ratio(value: float, base: float) -> str:
    """``value / base`` as ``1.23x``."""
    if base <= 0:
        return "n/a"
    r = value / base
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def si(value: float) -> str:
    """A count with a k/M suffix."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


@dataclass
class Table:
    """One result table: printed to the terminal and written to the report."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def _widths(self) -> list[int]:
        return [max(len(str(c)) for c in col) for col in zip(self.columns, *self.rows,
                                                                strict=False)]

    def to_text(self) -> str:
        """A fixed-width table for the terminal."""
        widths = self._widths()
        line = "  ".join("-" * w for w in widths)
        out = [self.title, line,
               "  ".join(str(c).ljust(w) for c, w in zip(self.columns, widths, strict=True)),
               line]
        for row in self.rows:
            out.append("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        out.append(line)
        out.extend(f"  {n}" for n in self.notes)
        return "\n".join(out)

    def to_markdown(self) -> str:
        """A GitHub-flavoured Markdown table (title as a bold line, notes below)."""
        out = [f"**{self.title}**", "",
               "| " + " | ".join(self.columns) + " |",
               "| " + " | ".join(["---"] + ["---:"] * (len(self.columns) - 1)) + " |"]
        for row in self.rows:
            out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
        if self.notes:
            out.append("")
            out.extend(f"- {n}" for n in self.notes)
        return "\n".join(out)


@dataclass
class Target:
    """A target of the issue and whether this run met it."""

    case: str
    name: str
    goal: str
    measured: str
    met: bool
    detail: str = ""


@dataclass
class CaseResult:
    """What one case produced."""

    key: str
    title: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Scale:
    """How much work each case does; ``full``, ``quick`` and ``smoke`` below."""

    name: str
    # case 1
    append_warmup: int
    append_iters: int
    shard_rotate: int
    delta_local_iters: int
    s3_iters: int
    iceberg_iters: int
    ducklake_iters: int
    # case 2
    fill_max_bytes: int
    fill_reps: int
    fill_window: int
    fill_curve_reps: int
    # case 3
    tp_appends: int
    tp_reps: int
    tp_writers: tuple[int, ...]
    # case 4
    snap_parts: int
    snap_iters: int
    # case 5
    compaction_sizes: tuple[int, ...]
    compaction_rows_per_part: int
    compaction_reps: int
    spark: bool
    # case 9: (updates, runs) merged beside DuckDB; the run-count curve (updates, runs...)
    merge_cases: tuple[tuple[int, int], ...]
    merge_curve: tuple[int, tuple[int, ...]]
    scale_spark_size: int
    # case 13
    read_size: int
    # case 6
    sensor_shards: tuple[int, ...]
    sensor_iters: int
    # case 7
    cost_appends: int
    # case 8
    sim_iters: int
    # profiling
    profile_appends: int


FULL = Scale(
    name="full", append_warmup=200, append_iters=3000, shard_rotate=256,
    delta_local_iters=400, s3_iters=150, iceberg_iters=100, ducklake_iters=300,
    fill_max_bytes=1 << 20, fill_reps=12, fill_window=25, fill_curve_reps=3,
    tp_appends=900, tp_reps=3, tp_writers=(1, 2, 4, 8),
    snap_parts=1000, snap_iters=50,
    compaction_sizes=(1_000_000, 5_000_000), compaction_rows_per_part=5_000,
    compaction_reps=3, spark=True,
    merge_cases=((10_000_000, 4), (10_000_000, 32), (40_000_000, 32)),
    merge_curve=(10_000_000, (4, 8, 16, 32, 64, 128)), scale_spark_size=20_000_000,
    read_size=10_000_000,
    sensor_shards=(100, 1_000, 10_000), sensor_iters=20,
    cost_appends=300, sim_iters=40, profile_appends=600,
)

QUICK = Scale(
    name="quick", append_warmup=150, append_iters=1000, shard_rotate=256,
    delta_local_iters=150, s3_iters=50, iceberg_iters=40, ducklake_iters=100,
    fill_max_bytes=1 << 20, fill_reps=4, fill_window=25, fill_curve_reps=1,
    tp_appends=400, tp_reps=1, tp_writers=(1, 2, 4, 8),
    snap_parts=300, snap_iters=20,
    compaction_sizes=(250_000,), compaction_rows_per_part=2_500,
    compaction_reps=1, spark=True,
    merge_cases=((2_000_000, 4), (2_000_000, 32)), merge_curve=(2_000_000, (4, 32, 128)),
    scale_spark_size=2_000_000, read_size=2_000_000,
    sensor_shards=(100, 1_000), sensor_iters=10,
    cost_appends=100, sim_iters=15, profile_appends=300,
)

SMOKE = Scale(
    name="smoke", append_warmup=2, append_iters=5, shard_rotate=4,
    delta_local_iters=3, s3_iters=3, iceberg_iters=2, ducklake_iters=3,
    fill_max_bytes=128 << 10, fill_reps=1, fill_window=3, fill_curve_reps=1,
    tp_appends=8, tp_reps=1, tp_writers=(1, 2),
    snap_parts=6, snap_iters=2,
    compaction_sizes=(2_000,), compaction_rows_per_part=250,
    compaction_reps=1, spark=True,
    merge_cases=((20_000, 4), (20_000, 32)), merge_curve=(20_000, (4, 32)),
    scale_spark_size=20_000, read_size=20_000,
    sensor_shards=(3,), sensor_iters=2,
    cost_appends=4, sim_iters=2, profile_appends=5,
)

SCALES = {s.name: s for s in (FULL, QUICK, SMOKE)}
