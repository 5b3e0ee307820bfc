"""PNG plots of the cases' results (matplotlib, Agg backend)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.common import CaseResult, Timing

_OURS = "#1f77b4"
_PEER = "#ff7f0e"
_REF = "#7f7f7f"


def _color(label: str) -> str:
    if label.startswith("ours"):
        return _OURS
    if label.startswith(("bare", "8 KiB")):
        return _REF
    return _PEER


def _latency_bars(rows: dict[str, Any], title: str, path: str) -> None:
    labels = [r["label"] for r in rows.values()]
    timings = [Timing.of(r["samples"]) for r in rows.values()]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    y = range(len(labels))
    ax.barh(y, [t.p50 * 1000 for t in timings], color=[_color(lbl) for lbl in labels],
            label="p50")
    ax.scatter([t.p99 * 1000 for t in timings], y, marker="|", s=200, color="black",
               label="p99", zorder=3)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case1(result: CaseResult, path: str) -> None:
    _latency_bars(result.data, "Case 1: small append latency, p50 bars and p99 ticks\n"
                  "(blue: ours, orange: peers, grey: references)", path)


def case2(result: CaseResult, path: str) -> None:
    bound = result.data["bound"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for n, curve in enumerate(result.data["curves"]):
        xs = [held / bound * 100 for held, _, _ in curve]
        ys = [s * 1000 for _, s, _ in curve]
        window = 15
        smooth = [statistics.median(ys[max(0, i - window):i + window + 1])
                  for i in range(len(ys))]
        inline = [i for i, (_, _, p) in enumerate(curve) if p == "inline"]
        blob = [i for i, (_, _, p) in enumerate(curve) if p != "inline"]
        ax.scatter([xs[i] for i in inline], [ys[i] for i in inline], s=3, alpha=0.25,
                   color=_OURS, label="each inline append" if n == 0 else None)
        ax.scatter([xs[i] + 1 for i in blob], [ys[i] for i in blob], s=6, alpha=0.6,
                   color=_PEER, label="fell through to blob (plotted at 100%+)"
                   if n == 0 else None)
        ax.plot(xs[:len(inline)], smooth[:len(inline)], color="black", linewidth=1,
                label="running median" if n == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("inline bytes held before the append (% of persist_inline_update_max_bytes)")
    ax.set_ylabel("append latency, ms (log)")
    ax.set_title("Case 2: inline append latency as the shard fills (the periodic spikes "
                 "are the state rollups, one per 128 appends)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case3(result: CaseResult, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for layout, color in (("shared", _PEER), ("separate", _OURS)):
        rows = result.data[layout]
        ax.plot([r["writers"] for r in rows], [r["per_s"] for r in rows], marker="o",
                color=color, label=f"{layout} shard(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("writer processes")
    ax.set_ylabel("inline appends / s (all writers)")
    ax.set_title("Case 3: write throughput (2-core machine)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case4(result: CaseResult, path: str) -> None:
    _latency_bars(result.data, "Case 4: snapshot read latency, p50 bars and p99 ticks", path)


def case5(result: CaseResult, path: str) -> None:
    rows = result.data["rows"]
    sizes = sorted({r["n"] for r in rows})
    engines = ["ours_spark", "ours_local", "spark_groupby", "pyarrow", "delta"]
    names = {"ours_spark": "ours on Spark", "ours_local": "ours, local executor",
             "spark_groupby": "bare Spark groupBy", "pyarrow": "pyarrow, 1 process",
             "delta": "deltalake optimize"}
    colors = {"ours_spark": _OURS, "ours_local": "#aec7e8", "spark_groupby": "#ffbb78",
              "pyarrow": _REF, "delta": _PEER}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        values = [next((r["rows_per_s"] for r in rows if r["n"] == n and r["engine"] == engine),
                       0) / 1e6 for n in sizes]
        ax.bar([i + j * width for i in range(len(sizes))], values, width,
               label=names[engine], color=colors[engine])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))],
                  [f"{n / 1e6:g}M updates" for n in sizes])
    ax.set_ylabel("million rows / s")
    ax.set_title("Case 5: compaction throughput", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case6(result: CaseResult, path: str) -> None:
    rows = result.data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for what, label, color in (("summaries", "client.shard_summaries() (warm)", _OURS),
                               ("sensor", "Dagster sensor tick (fresh client)", _PEER)):
        pts = [r for r in rows if r["what"] == what]
        ax.plot([r["shards"] for r in pts], [r["p50"] * 1000 for r in pts], marker="o",
                color=color, label=f"{label}, p50")
        ax.plot([r["shards"] for r in pts], [r["p99"] * 1000 for r in pts], marker="x",
                linestyle="--", color=color, label=f"{label}, p99")
    ax.axhline(1000, color="red", linewidth=0.8, label="target: 1 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shards")
    ax.set_ylabel("ms per tick (log)")
    ax.set_title("Case 6: sensor tick cost", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case7(result: CaseResult, path: str) -> None:
    names = list(result.data)
    appends = [result.data[n][0]["puts_per_1k"] for n in names]
    after = [result.data[n][1]["puts_per_1k"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    y = range(len(names))
    ax.barh([i - 0.2 for i in y], appends, 0.4, label="PUT+POST while appending",
            color=[_color(n) for n in names])
    ax.barh([i + 0.2 for i in y], after, 0.4, label="PUT+POST of compaction / maintenance",
            color=_REF)
    for i, (a, b) in enumerate(zip(appends, after, strict=True)):
        ax.text(a, i - 0.2, f" {a:.0f}", va="center", fontsize=8)
        ax.text(b, i + 0.2, f" {b:.0f}", va="center", fontsize=8)
    ax.set_yticks(list(y), [n.split(" (")[0] + ("\n(files, local)" if "files" in n else "")
                            for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("requests per 1,000 small appends")
    ax.set_title("Case 7: object-store writes per 1,000 small appends", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case8(result: CaseResult, path: str) -> None:
    _latency_bars(result.data, "Case 8: small append latency with SIMULATED S3 latency\n"
                  "(a simulation, not AWS)", path)


def case9(result: CaseResult, path: str) -> None:
    curve = result.data["curve"]
    spark = result.data.get("spark")
    fig, (speed, mem, bars) = plt.subplots(1, 3, figsize=(15, 4.4))
    runs = [p["runs"] for p in curve]
    for key, label, color in (("ours", "ours (1 core, bound 256 MiB)", _OURS),
                              ("duckdb", "DuckDB (2 threads, memory_limit 2 GB)", _PEER)):
        speed.plot(runs, [p[key] / 1e6 for p in curve], "o-", color=color, label=label)
    speed.set_xscale("log", base=2)
    speed.set_xticks(runs, [str(r) for r in runs])
    speed.set_ylim(bottom=0)
    speed.set_xlabel("sorted runs in the merge")
    speed.set_ylabel("million input rows / s")
    speed.set_title(f"One merge of {result.data['curve_n'] / 1e6:g}M updates vs run count",
                    fontsize=10)
    mem.plot(runs, [p["ours_rss"] / (1 << 30) for p in curve], "o-", color=_OURS,
             label="ours, peak RSS")
    mem.axhline(1.0, color=_REF, linestyle="--", linewidth=1, label="target: 1 GiB")
    mem.set_xscale("log", base=2)
    mem.set_xticks(runs, [str(r) for r in runs])
    mem.set_ylim(0, 1.2)
    mem.set_xlabel("sorted runs in the merge")
    mem.set_ylabel("GiB")
    mem.set_title("Peak RSS of the same merges (fresh process)", fontsize=10)
    if spark:
        labels = ["one process", "cluster: first job\n(no prestart)",
                  "cluster: first job\n(prestarted)", "cluster: second job"]
        seconds = [spark["one_process_s"], spark["jobs"]["nostart"], spark["jobs"]["first"],
                   spark["jobs"]["second"]]
        colors = [_REF, _PEER, _OURS, _OURS]
        bars.bar(range(4), seconds, color=colors)
        for i, sec in enumerate(seconds):
            bars.text(i, sec, f"{sec:.1f} s\n{seconds[0] / sec:.2f}x", ha="center",
                      va="bottom", fontsize=8)
        bars.set_xticks(range(4), labels, fontsize=8)
        bars.set_ylabel("seconds (lower is better)")
        bars.set_ylim(0, max(seconds) * 1.25)
        bars.set_title(f"A {spark['n'] / 1e6:.0f}M-update merge: cluster (2 x 1 core) vs one "
                       "process", fontsize=10)
    for ax in (speed, mem, bars):
        ax.grid(alpha=0.3, axis="y" if ax is bars else "both")
    for ax in (speed, mem):
        ax.legend(fontsize=8)
    fig.suptitle("Case 9: one large merge at any run count, and split over Spark", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case12(result: CaseResult, path: str) -> None:
    _latency_bars(result.data["appends"], "Small append latency: typed vs untyped (p50 bar, "
                  "p99 tick)", path)


def case14(result: CaseResult, path: str) -> None:
    _latency_bars(result.data, "Case 14: atomic multi-shard commits, p50 bars and p99 ticks\n"
                  "(blue: ours, orange: DuckLake)", path)


PLOTS: dict[str, tuple[str, Callable[[CaseResult, str], None]]] = {
    "case1": ("case1_append_latency.png", case1),
    "case2": ("case2_fill_curve.png", case2),
    "case3": ("case3_throughput.png", case3),
    "case4": ("case4_snapshot.png", case4),
    "case5": ("case5_compaction.png", case5),
    "case6": ("case6_sensor.png", case6),
    "case7": ("case7_cost.png", case7),
    "case8": ("case8_simulated.png", case8),
    "case9": ("case9_scale.png", case9),
    "case12": ("case12_typed.png", case12),
    "case14": ("case14_transactions.png", case14),
}


def draw(result: CaseResult, out_dir: str) -> None:
    """Draw the plot of ``result`` (if its case has one) into ``out_dir``."""
    entry = PLOTS.get(result.key)
    if entry is None:
        return
    name, fn = entry
    fn(result, os.path.join(out_dir, name))
    result.plots.append(name)
