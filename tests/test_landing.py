"""Landing locations (persist_pipeline.landing): listing, identities and reads of a local
folder, and the typed errors of bad names and missing objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from persist_pipeline.exceptions import InvalidInput, InvalidUpdates
from persist_pipeline.landing import LandingLocation


def test_a_folder_is_listed_statted_and_read(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.csv").write_text("k,v,t,d\nx,y,0,1\n")
    landing = LandingLocation(str(tmp_path))
    [obj] = landing.list()
    assert obj.name == "sub/a.csv" and obj.size > 0
    assert landing.stat("sub/a.csv") == obj
    assert landing.stat("sub/missing.csv") is None
    assert landing.read_updates("sub/a.csv").to_pylist() == [
        {"k": b"x", "v": b"y", "t": 0, "d": 1}]


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../outside.csv", "a/../../b.csv"])
def test_names_outside_the_location_are_refused(tmp_path: Path, name: str) -> None:
    landing = LandingLocation(str(tmp_path))
    with pytest.raises(InvalidInput, match="relative to its landing location"):
        landing.stat(name)
    with pytest.raises(InvalidInput):
        landing.read_updates(name)


def test_missing_folders_and_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        LandingLocation(str(tmp_path / "nope")).list()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        LandingLocation(str(tmp_path / "file")).list()
    with pytest.raises(InvalidUpdates):
        LandingLocation(str(tmp_path)).read_updates("absent.csv")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
@pytest.mark.parametrize("route", [None, "table"])
def test_a_landed_column_besides_the_updates_is_refused_by_name(
        tmp_path: Path, suffix: str, route: str | None) -> None:
    """A landed file is ingested as the CLI's append reads one: a column the shard does
    not have (here ``note``, ``amount``) is refused, named, rather than dropped."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"k": "a", "v": "1", "t": 0, "note": "x", "amount": "3"}
    if route is not None:
        row[route] = "orders"
    path = tmp_path / f"extra{suffix}"
    if suffix == ".csv":
        path.write_text(",".join(row) + "\n" + ",".join(str(v) for v in row.values()) + "\n")
    elif suffix == ".jsonl":
        path.write_text(json.dumps(row) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(InvalidUpdates, match=rf"{path.name}.*column\(s\) note, amount"):
        LandingLocation(str(tmp_path)).read_updates(path.name, route=route)
