"""The Dagster UI, end to end, in a real headless browser (Debian's Chromium + Playwright).

A module fixture runs the pipeline on a throwaway instance of the embedded default
(``python -m assets.run_demo`` with its own ``DAGSTER_HOME`` and data dir: ingestion runs,
a bad landing file, sensor-requested Spark compactions, the schedules' runs), lands one
more file with a long name (a partner's export in dated folders) and ingests it through
the landing sensor, then starts ``dg dev`` on that instance exactly as ``make ui``
does, on a free port of 127.0.0.1. Headless Chromium (``/usr/bin/chromium`` or
``$PERSIST_CHROMIUM``; ``make browser`` installs it), in a 1920x1080 window, then checks
what a user sees:

* the ingestion asset ``ingest/clicks``: its materializations (as many as the instance
  recorded), their metadata (``Placement`` ``inline``, every label as named), and the
  plots, the first of which is ``Inline bytes``, drawn on its canvas, with no duplicate
  entries;
* ``ingest/orders``: its latest write, the long-named file, placed in ``blob``; its
  bounded partition key beside (not over) the check results badge, and whole in the
  partitions list, with the full path in the ``File`` metadata;
* the demo's file malformed on purpose: a failed partition whose run's failure names the
  file (``...-malformed-on-purpose.csv``) and its bad line;
* the snapshot check of a shard the automation's compaction run had nothing to do for:
  passed, saying it was skipped and why;
* ``report/shard_health``, stored by ``PersistIOManager``: its column schema and row count;
* the automation page lists every sensor and schedule of the code location, running;
* the runs list names the landing sensor's job (no anonymous asset job), and the
  compaction run that ``inline_pressure_sensor`` requested succeeded, in the runs list
  and on the run's page, with none of the Spark driver JVM's own output in its stderr,
  event log or the demo's terminal (it is in ``$DAGSTER_HOME/spark/spark-driver.log``,
  still there after ``dg dev`` ran).

Screenshots go to ``results/ui/`` (linked from the README). Without Chromium the tests
fail with a message saying how to install it; they never skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.asset_keys import MAX_FILE_PARTITION_KEY, TAG_FILE, file_partition_key
from assets.pipeline_config import CONFIG_ENV, REPO_ROOT
from assets.run_demo import BAD_FILE
from tests.pipeline_support import PIPELINE_ENV

CHROMIUM = Path(os.environ.get("PERSIST_CHROMIUM", "/usr/bin/chromium"))
#: Flags for a closed network (without them Chromium hangs on background connections).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
SHOTS = REPO_ROOT / "results" / "ui"
ROUNDS = 12          # enough for inline_pressure_sensor to request compaction of clicks
INGESTED = "clicks"  # the ingestion asset whose page is checked: ingest/clicks
TIMEOUT_MS = 30_000
#: The commonest desktop size, and the one landed-file partition keys are bounded for
#: (see assets.asset_keys.MAX_FILE_PARTITION_KEY).
VIEWPORT = {"width": 1920, "height": 1080}
#: A landed file with a long name, ingested last so that it is ingest/orders' latest
#: materialization (whose partition key the asset page's status row shows). Large, so
#: its write goes to blob storage.
LONG_FILE = ("partner-acme-logistics/exports/2024-11-25/orders-export-full-refresh-region-"
             "eu-west-1-warehouse-rotterdam-batch-000017-of-000032.parquet")
#: Text only the Spark driver JVM writes (its notice of the jdk.incubator modules).
JVM_NOTICE = "incubator"
pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(420)]


@dataclass
class Facts:
    """What the instance recorded (the ground truth the UI must show)."""

    materializations: int           # of ingest/clicks
    latest_run_id: str              # the run of ingest/clicks' latest materialization
    compaction_run_id: str          # the first compaction run inline_pressure_sensor asked for
    compaction_inline_before: int   # its inline_bytes_before for clicks
    sensors: list[str]
    schedules: list[str]
    long_partition: str             # the partition of LONG_FILE
    bad_partition: str              # the partition of the demo's file malformed on purpose
    bad_run_id: str                 # its failed run
    skipped_check_shard: str        # a shard whose snapshot check the automation skipped


@dataclass
class DagsterUI:
    """``dg dev`` serving the throwaway instance."""

    url: str
    facts: Facts
    log: Path
    home: Path                      # its DAGSTER_HOME


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _default_signals() -> None:
    """In a child process: SIGINT and SIGTERM back to their defaults. A shell that runs
    pytest in the background makes children ignore SIGINT, and Dagster's processes handle
    SIGTERM as they handle SIGINT, so they would ignore both."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _require_browser() -> None:
    """Fail (never skip) when the browser or Playwright is missing, saying what to do."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"headless Chromium not found at {CHROMIUM}: run `make browser` (installs "
                    "Debian's chromium package with apt-get, as root) or set PERSIST_CHROMIUM "
                    "to a Chromium binary", pytrace=False)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"Playwright is not installed ({exc}): pip install -e '.[dev]'",
                    pytrace=False)


def _land_long_file(defs: dg.Definitions, instance: dg.DagsterInstance, data: Path) -> str:
    """Land LONG_FILE in the orders landing folder and run the landing sensor's request
    for it, as the daemon would; returns its partition."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assets.runner import SensorTicker, launch_sensor_requests

    path = data / "landing" / "orders" / LONG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 4000  # above the inline threshold, as the demo's Parquet file
    pq.write_table(pa.table({"k": [f"order-{i}".encode() for i in range(50_000, 50_000 + n)],
                             "v": [f"{{\"qty\": {i % 9}}}".encode() for i in range(n)],
                             "t": pa.array([0] * n, pa.int64())}), path)
    ticker = SensorTicker(defs, instance, "orders_landing_sensor")
    tick = ticker.tick()  # a new cursor: the demo's files are ingested or their keys used
    partition = file_partition_key("orders", LONG_FILE)
    assert [(r.partition_key, (r.tags or {}).get(TAG_FILE)) for r in tick.run_requests
            if (r.tags or {}).get(TAG_FILE) != BAD_FILE] == [(partition, LONG_FILE)]
    quiet = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
    [result] = launch_sensor_requests(ticker, tick, run_config=quiet)
    assert result.success
    return partition


def _skipped_check_shard(instance: dg.DagsterInstance) -> str:
    """A shard whose snapshot check the automation's compaction run passed as skipped."""
    runs = instance.get_runs(filters=dg.RunsFilter(
        job_name="compaction_job", tags={"dagster/sensor_name": "persist_automation_sensor"}))
    assert runs, "the demo's automation launched no compaction run"
    for record in instance.get_records_for_run(
            runs[0].run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records:
        event = record.event_log_entry.dagster_event
        data: Any = event.event_specific_data if event else None
        if data is not None and "skipped" in data.metadata:
            return str(data.asset_key.path[-1])
    raise AssertionError("the automation's compaction run skipped no shard's check")


def _facts(home: Path, env: dict[str, str]) -> Facts:
    """Land the long-named file, then read the ground truth from the instance and the
    code location's definitions."""
    from assets.workspace import load_workspace_definitions

    with pytest.MonkeyPatch.context() as mp:
        for name in (*PIPELINE_ENV, CONFIG_ENV):
            mp.delenv(name, raising=False)
        mp.setenv("PERSIST_PIPELINE_DATA_DIR", env["PERSIST_PIPELINE_DATA_DIR"])
        defs = load_workspace_definitions()
        instance = dg.DagsterInstance.from_config(str(home))
        try:
            long_partition = _land_long_file(defs, instance,
                                             Path(env["PERSIST_PIPELINE_DATA_DIR"]))
        finally:
            instance.dispose()
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        bad_runs = instance.get_runs(filters=dg.RunsFilter(
            tags={TAG_FILE: BAD_FILE}, statuses=[dg.DagsterRunStatus.FAILURE]))
        assert len(bad_runs) == 1, bad_runs
        key = dg.AssetKey(["ingest", INGESTED])
        records = instance.fetch_materializations(key, limit=1000).records
        runs = instance.get_runs(filters=dg.RunsFilter(
            tags={"dagster/sensor_name": "inline_pressure_sensor",
                  "persist/shards": INGESTED}))
        assert runs, f"inline_pressure_sensor requested no compaction of {INGESTED}"
        first = runs[-1]  # get_runs is newest first
        assert first.status == dg.DagsterRunStatus.SUCCESS, first.status
        compacted = instance.fetch_materializations(
            dg.AssetKey(["compact", INGESTED]), limit=1000).records
        before = [r.asset_materialization.metadata["inline_bytes_before"].value
                  for r in compacted if r.run_id == first.run_id
                  and r.asset_materialization is not None]
        assert before, "the compaction run materialized nothing"
        return Facts(
            materializations=len(records), latest_run_id=records[0].run_id,
            compaction_run_id=first.run_id, compaction_inline_before=int(before[0]),
            sensors=sorted(s.name for s in defs.sensors or []),
            schedules=sorted(s.name for s in defs.schedules or []),
            long_partition=long_partition,
            bad_partition=bad_runs[0].tags["dagster/partition"], bad_run_id=bad_runs[0].run_id,
            skipped_check_shard=_skipped_check_shard(instance))
    finally:
        instance.dispose()


def _graphql(url: str, query: str) -> Any:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterUI]:
    """The pipeline's runs on a throwaway instance, served by ``dg dev``."""
    _require_browser()
    root = tmp_path_factory.mktemp("ui")
    home, data = root / "dagster_home", root / "data"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in (*PIPELINE_ENV, CONFIG_ENV, "DAGSTER_HOME")}
    env |= {"DAGSTER_HOME": str(home), "PERSIST_PIPELINE_DATA_DIR": str(data),
            "PYTHONUNBUFFERED": "1"}

    demo = subprocess.run([sys.executable, "-m", "assets.run_demo", "--rounds", str(ROUNDS)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    (root / "run_demo.log").write_text(demo.stdout + demo.stderr)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "inline_pressure_sensor fired" in demo.stdout, demo.stdout[-3000:]
    # The Spark driver JVM's own output went to its log file, not to the terminal.
    assert JVM_NOTICE not in demo.stdout + demo.stderr, demo.stderr[-3000:]
    assert "log4j" not in demo.stdout + demo.stderr, demo.stderr[-3000:]
    assert "log4j" in (home / "spark" / "spark-driver.log").read_text()
    facts = _facts(home, env)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "dagster_dev.log"
    # The same command as `make ui`, on the throwaway instance.
    cmd = [str(Path(sys.executable).parent / "dg"), "dev", "-w", "workspace.yaml",
           "-h", "127.0.0.1", "-p", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 120
        query = ("{ workspaceOrError { ... on Workspace { locationEntries { name "
                 "locationOrLoadError { __typename } } } } }")
        while True:
            assert proc.poll() is None, f"dg dev exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"dg dev not ready:\n{log.read_text()[-3000:]}"
            try:
                entries = _graphql(url, query)["data"]["workspaceOrError"]["locationEntries"]
            except (OSError, KeyError, TypeError, ValueError):
                entries = []
            loaded = [e["locationOrLoadError"] for e in entries if e["locationOrLoadError"]]
            if loaded:
                assert loaded[0]["__typename"] == "RepositoryLocation", loaded
                break
            time.sleep(1)
        yield DagsterUI(url, facts, log, home)
    finally:  # dg dev and its children are their own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def page(dagster_ui: DagsterUI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium page (fresh profile, UTC, VIEWPORT) for the module."""
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT,
            timezone_id="UTC", locale="en-US", color_scheme="light")
        try:
            context.set_default_timeout(TIMEOUT_MS)
            p = context.pages[0] if context.pages else context.new_page()
            # Dagster's first-visit "Join the Dagster community" dialog: skip it whenever
            # it stands in the way of an action.
            p.add_locator_handler(p.get_by_role("button", name="Skip"),
                                  lambda skip: skip.click())
            yield p
        finally:
            context.close()


def _open(page: Any, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")


def _settle(page: Any, first_visit_wait_ms: int = 0) -> None:
    """Let requests finish and dismiss Dagster's community dialog before a screenshot."""
    with contextlib.suppress(Exception):  # the UI polls; the checks wait for elements
        page.wait_for_load_state("networkidle", timeout=10_000)
    page.mouse.move(0, 0)  # no hover effects in the screenshot
    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(state="visible", timeout=max(first_visit_wait_ms, 1))
        skip.click()
        skip.wait_for(state="hidden")
    except Exception:  # no dialog
        pass


def _metadata_value(page: Any, key: str) -> str:
    """The text of the metadata table row whose key cell is exactly ``key``."""
    row = page.locator("tr").filter(has=page.get_by_text(key, exact=True)).first
    row.wait_for()
    return str(row.inner_text())


def _colored_pixels(canvas: Any) -> int:
    """How many pixels of ``canvas`` are drawn in a saturated colour (the data series)."""
    return int(canvas.evaluate(
        """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let n = 0;
                 for (let i = 0; i < d.length; i += 4) {
                   const hi = Math.max(d[i], d[i + 1], d[i + 2]);
                   const lo = Math.min(d[i], d[i + 1], d[i + 2]);
                   if (d[i + 3] > 128 && hi - lo > 60) n++;
                 }
                 return n; }"""))


#: The numeric metadata of an ingestion materialization, each plotted by the UI.
PLOTTED = ("Inline bytes", "Inline encoding size (bytes)", "Inline limit (bytes)",
           "PUTs to blob storage", "Seqno", "Stored size (bytes)", "Stream deletes",
           "Stream inserts", "Stream updates", "Updates written", "Upper",
           "Write latency (ms)")


def test_ingestion_asset_page_shows_materializations_placement_and_inline_bytes_plot(
        dagster_ui: DagsterUI, page: Any) -> None:
    facts = dagster_ui.facts
    # Overview: the latest materialization's metadata, placement among it.
    _open(page, f"{dagster_ui.url}/assets/ingest/{INGESTED}")
    page.get_by_text("Latest materialization").first.wait_for()
    assert re.search(r"\binline\b", _metadata_value(page, "Placement"))
    for key in ("Inline bytes", "Stored size (bytes)", "Inline encoding size (bytes)",
                "Inline limit (bytes)", "Write latency (ms)", "Updates written", "Upper",
                "PUTs to blob storage", "Fell back to blob (inline budget full)", "Seqno",
                "Shard ID"):
        _metadata_value(page, key)
    for gone in ("updates_stored", "rows", "shard_inline_bytes"):  # the old duplicates
        assert page.get_by_text(gone, exact=True).count() == 0, gone
    _settle(page, first_visit_wait_ms=5_000)
    page.screenshot(path=str(SHOTS / "asset-clicks-overview.png"))

    # The metadata plotted over time: "Inline bytes" is the first plot, and it is drawn.
    page.get_by_role("button", name="Plots").click()
    title = page.get_by_text("Inline bytes", exact=True).first
    title.wait_for()
    boxes = {}
    for label in PLOTTED:
        heading = page.get_by_text(label, exact=True).first
        heading.wait_for()
        box = heading.bounding_box()
        assert box is not None, label
        boxes[label] = (round(box["y"]), box["x"])
    assert min(boxes, key=lambda k: boxes[k]) == "Inline bytes", boxes
    canvas = title.locator("xpath=ancestor::*[.//canvas][1]").locator("canvas").first
    canvas.scroll_into_view_if_needed()
    deadline = time.monotonic() + 15
    while (drawn := _colored_pixels(canvas)) < 100 and time.monotonic() < deadline:
        page.wait_for_timeout(250)  # the chart animates in
    assert drawn >= 100, f"the Inline bytes plot is blank ({drawn} coloured pixels)"
    box = canvas.bounding_box()
    assert box is not None and box["width"] > 200 and box["height"] > 100, box
    title.evaluate("e => e.scrollIntoView({block: 'start'})")  # the plots, from the first
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-clicks-plots.png"))

    # Events: every materialization is listed; the latest names its run and placement.
    _open(page, f"{dagster_ui.url}/assets/ingest/{INGESTED}?view=events")
    page.get_by_text("Materialized in run").first.wait_for()
    page.get_by_text(facts.latest_run_id[:8]).first.wait_for()
    # One timestamp per listed event (plus the selected event's heading).
    stamps = page.get_by_text(re.compile(r"^[A-Z][a-z]{2} \d{1,2}, \d{1,2}:\d\d [AP]M$"))
    deadline = time.monotonic() + 15
    while stamps.count() < facts.materializations and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert stamps.count() >= facts.materializations, (stamps.count(), facts.materializations)
    assert re.search(r"\binline\b", _metadata_value(page, "Placement"))
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-clicks-events.png"))


def _box(locator: Any) -> dict[str, float]:
    box = locator.bounding_box()
    assert box is not None, locator
    return dict(box)


def test_a_long_file_name_has_a_bounded_partition_key_clear_of_the_badges(
        dagster_ui: DagsterUI, page: Any) -> None:
    key = dagster_ui.facts.long_partition
    assert len(key) <= MAX_FILE_PARTITION_KEY and key.startswith("orders/"), key
    # ingest/orders' latest write is the long-named Parquet file, placed in blob storage.
    _open(page, f"{dagster_ui.url}/assets/ingest/orders")
    page.get_by_text("Latest materialization").first.wait_for()
    assert re.search(r"\bblob\b", _metadata_value(page, "Placement"))
    assert LONG_FILE in _metadata_value(page, "File")  # the full path, in the metadata
    # The status row: the partition key, untruncated after the materialization's age,
    # ends before the next column, where the check results badge is.
    shown = page.get_by_text(key, exact=True).first
    shown.wait_for()
    checks = page.get_by_text("Latest check results", exact=True).first.locator("xpath=..")
    checks.locator(":scope > *").nth(1).wait_for()  # the badge
    key_box, checks_box = _box(shown), _box(checks)
    assert abs(key_box["y"] - checks_box["y"]) < checks_box["height"], (key_box, checks_box)
    assert key_box["x"] + key_box["width"] <= checks_box["x"] - 4, (key_box, checks_box)
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-orders-overview.png"))

    # The partitions list shows the key whole (Dagster truncates longer ones in the
    # middle); the partition's panel has the full path.
    _open(page, f"{dagster_ui.url}/assets/ingest/orders?view=partitions&partition="
                f"{urllib.parse.quote(key, safe='')}")
    shown = page.get_by_title(key, exact=True)  # in the list, and as the panel's title
    shown.nth(1).wait_for()
    for i in range(shown.count()):  # not truncated in the middle
        assert shown.nth(i).locator("span").first.inner_text() == key
    assert LONG_FILE in _metadata_value(page, "File")
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-orders-long-partition-key.png"))


def test_the_file_malformed_on_purpose_is_a_failed_partition_saying_why(
        dagster_ui: DagsterUI, page: Any) -> None:
    facts = dagster_ui.facts
    _open(page, f"{dagster_ui.url}/assets/ingest/orders?view=partitions&partition="
                f"{urllib.parse.quote(facts.bad_partition, safe='')}")
    page.get_by_text("failed, and did not materialize this asset").first.wait_for()
    page.get_by_text(facts.bad_run_id[:8], exact=True).first.wait_for()
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-orders-failed-partition.png"))

    # Its run (the panel's "View logs"): the step failed saying which file, the line and
    # what is wrong with it; the file's name says it is malformed on purpose.
    _open(page, f"{dagster_ui.url}/runs/{facts.bad_run_id}?logs=type%3ASTEP_FAILURE")
    page.get_by_text("STEP_FAILURE", exact=True).first.wait_for()
    page.get_by_text(re.compile(rf"{re.escape(BAD_FILE)}: line 3: column t must be an "
                                r"integer")).first.wait_for()
    _settle(page)
    page.screenshot(path=str(SHOTS / "run-malformed-file-failure.png"))


def test_a_skipped_snapshot_check_says_why(dagster_ui: DagsterUI, page: Any) -> None:
    shard = dagster_ui.facts.skipped_check_shard
    _open(page, f"{dagster_ui.url}/assets/compact/{shard}?view=checks")
    page.get_by_text("snapshot_unchanged", exact=True).first.click()
    page.get_by_text(re.compile(r"^skipped: nothing to compact \(no pending merges or "
                                r"inline data\)")).first.wait_for()
    page.get_by_text("Passed", exact=True).first.wait_for()
    _settle(page)
    page.screenshot(path=str(SHOTS / "check-snapshot-skipped.png"))


def test_io_managed_asset_shows_its_schema_and_row_count(dagster_ui: DagsterUI,
                                                         page: Any) -> None:
    _open(page, f"{dagster_ui.url}/assets/report/shard_health")
    page.get_by_text("Latest materialization").first.wait_for()
    # dagster/column_schema, as the UI's column table: every column with its Arrow type.
    for column, arrow_type in (("shard", "string"), ("inline_bytes", "int64"),
                               ("inline_fill", "double"), ("pending_merges", "int32")):
        row = page.locator("tr").filter(has=page.get_by_text(column, exact=True)).first
        row.wait_for()
        assert arrow_type in row.inner_text(), (column, row.inner_text())
    # dagster/row_count, which the overview shows as "Row count": one row per shard.
    heading = page.get_by_text("Row count", exact=True).first
    heading.wait_for()
    assert re.search(r"\b3\b", heading.locator("xpath=..").inner_text())
    # The IO manager's write: the shard's upper after it, rows added.
    assert re.search(r"\b1\b", _metadata_value(page, "persist/upper"))
    assert re.search(r"\b3\b", _metadata_value(page, "persist/rows_added"))
    _settle(page)
    page.screenshot(path=str(SHOTS / "asset-report-overview.png"))


def test_automation_lists_the_sensor_and_schedules_running(dagster_ui: DagsterUI,
                                                           page: Any) -> None:
    from playwright.sync_api import expect

    facts = dagster_ui.facts
    assert "inline_pressure_sensor" in facts.sensors and "persist_automation_sensor" in \
        facts.sensors and "shard_checks_schedule" in facts.schedules
    _open(page, f"{dagster_ui.url}/automation")
    for name in facts.sensors + facts.schedules:
        # The link's accessible name is the name between its icon and its description.
        link = page.get_by_role("link", name=re.compile(rf"(^|\s){re.escape(name)}(\s|$)"))
        link = link.first
        link.wait_for()
        row = page.locator("[data-index]").filter(has=link).first
        # While the row loads its status it shows a "loading" progress bar and no switch
        # (its last checkbox is then the row's selection box): wait for the loaded row as
        # long as every other wait here, not expect()'s 5 s default, which a busy
        # machine overruns.
        expect(row.get_by_role("progressbar", name="loading")).to_have_count(
            0, timeout=TIMEOUT_MS)
        toggle = row.get_by_role("checkbox").last  # the running/stopped switch
        expect(toggle, f"{name} is not running").to_be_checked(timeout=TIMEOUT_MS)
    _settle(page)
    page.screenshot(path=str(SHOTS / "automation.png"))


def test_sensor_requested_compaction_run_succeeded(dagster_ui: DagsterUI, page: Any) -> None:
    facts = dagster_ui.facts
    short = facts.compaction_run_id[:8]
    # The runs list: launched by the sensor, succeeded.
    _open(page, f"{dagster_ui.url}/runs")
    link = page.get_by_role("link", name=short).first
    link.wait_for()
    row = link.locator("xpath=ancestor::*[contains(., 'inline_pressure_sensor')][1]")
    row.get_by_text("inline_pressure_sensor").first.wait_for()
    row.get_by_text("compaction_job").first.wait_for()
    row.get_by_text("Success", exact=True).first.wait_for()
    # The landing sensor's runs carry its named job, not an anonymous asset job.
    page.get_by_text("ingest_files_job").first.wait_for()
    assert page.get_by_text(re.compile("__anonymous_asset_job")).count() == 0
    _settle(page)
    page.screenshot(path=str(SHOTS / "runs.png"))

    # The run's page: success, its event log, the compaction's own log line.
    _open(page, f"{dagster_ui.url}/runs/{facts.compaction_run_id}")
    page.get_by_text("Success", exact=True).first.wait_for()
    page.get_by_text("RUN_SUCCESS").first.wait_for()
    page.get_by_text(f"inline bytes {facts.compaction_inline_before} -> 0").first.wait_for()
    assert page.get_by_text("RUN_FAILURE").count() == 0
    _settle(page)
    page.screenshot(path=str(SHOTS / "compaction-run.png"))

    # Spark started in this run: the driver JVM's own output is not in the run's stderr
    # (nor in its event log, read from the instance: the UI renders only what is seen).
    instance = dg.DagsterInstance.from_config(str(dagster_ui.home))
    try:
        messages = [r.event_log_entry.user_message or "" for r in
                    instance.get_records_for_run(facts.compaction_run_id, limit=10_000).records]
    finally:
        instance.dispose()
    assert messages and not [m for m in messages if JVM_NOTICE in m]
    page.get_by_role("button", name="stderr").click()
    page.get_by_placeholder("Select a step…").click()
    page.get_by_text("spark_compaction", exact=True).last.click()
    page.get_by_text("Download", exact=True).first.wait_for()  # the step's capture is shown
    page.wait_for_timeout(1000)  # and loaded ("No log file available" when empty)
    assert JVM_NOTICE not in page.locator("body").inner_text()
    _settle(page)
    page.screenshot(path=str(SHOTS / "compaction-run-stderr.png"))


def test_the_spark_driver_log_outlives_dagster_dev(dagster_ui: DagsterUI) -> None:
    """The driver log is not in $DAGSTER_HOME/logs, which dg dev's webserver and
    daemon upload to Dagster's telemetry server and empty as soon as they start."""
    driver_log = dagster_ui.home / "spark" / "spark-driver.log"
    assert driver_log.stat().st_size > 0
    assert not list((dagster_ui.home / "logs").glob("spark*")), "in the telemetry spool"
