"""Which landed file a landed-file partition is (see :func:`assets.asset_keys.file_partition_key`).

A key ``SHARD/path`` names its file. A shortened key (a long path: ``SHARD/<head>~<digest>~
<tail>``) does not, so its file is found, cheapest first, in the run's ``persist/file``
tag (every run the landing sensor requests has it), in the tag of an earlier run of the
same partition, or by listing the landing location (a partition added and materialized
by hand). Each candidate is checked against the key, so a tag can never point a run at
another file.
"""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from assets.asset_keys import (
    MAX_FILE_PARTITION_KEY,
    TAG_FILE,
    file_partition_keys,
    is_shortened_file_partition,
    split_file_partition,
)
from assets.pipeline_config import FileSource
from assets.sources import describe, scan_landing
from persist_pipeline.exceptions import InvalidUpdates

PARTITION_TAG = "dagster/partition"
#: Earlier runs of a partition whose tags are read for its file.
_EARLIER_RUNS = 20


def landed_file_of(instance: dg.DagsterInstance, run_tags: Mapping[str, str],
                   partition: str, source: FileSource) -> str:
    """The path, in ``source``'s landing location, of the file of ``partition``.

    Raises:
        InvalidUpdates: a shortened key whose file no run names and no landed file has
            (moved or archived), or that two landed files share.
    """
    owner, rest = split_file_partition(partition)
    if not is_shortened_file_partition(partition):
        return rest  # the key names its file

    def of_partition(name: str | None) -> bool:
        return bool(name) and partition in file_partition_keys(owner, str(name))

    if of_partition(run_tags.get(TAG_FILE)):
        return run_tags[TAG_FILE]
    for run in instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition}),
                                 limit=_EARLIER_RUNS):
        if of_partition(run.tags.get(TAG_FILE)):
            return run.tags[TAG_FILE]
    found = [f.name for f in scan_landing(source).files if of_partition(f.name)]
    if len(found) == 1:
        return found[0]
    if found:
        raise InvalidUpdates(f"partition {partition}: the files {', '.join(found)} in "
                             f"{describe(source)} all have this key; land them under "
                             "other names")
    raise InvalidUpdates(
        f"partition {partition}: no file in {describe(source)} has this key, and no run "
        f"of it names one (was it moved or archived?). Keys longer than "
        f"{MAX_FILE_PARTITION_KEY} characters are shortened: find the file in the "
        f"persist/file tag of the partition's runs")
