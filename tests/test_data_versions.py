"""Sources read as one version (issue 42): an S3 object overwritten while it is read is an error naming
the URL, never a line spliced from two versions; a local file renamed over or truncated likewise;
--follow reports files that change after they were taken. The S3 cases run against moto's server on
loopback (tests/s3_server.py)."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_server import s3  # noqa: F401  (the fixture)

from deeprec.data import CsvReader, Column, ParquetReader, Schema, fs, ranged, stores
from deeprec.data.parquet import _raise_if_changed
from deeprec.data.ranged import ChangedError

SCHEMA = Schema((Column("label", "label"), Column("row", "categorical", dtype="int"), Column("text", "categorical")),
                delimiter=",", header=True)


def _csv(rows: int, shift: int = 0) -> bytes:
    """A header and `rows` rows (row k: label k%2, row k, 40 bytes of text); `shift` moves every line."""
    pad = b"#" * shift
    return b"label,row,text\n" + b"".join(b"%d,%d,%s%s\n" % (k % 2, k, pad, b"t" * 40) for k in range(rows))


def _rows(reader) -> list[int]:
    return [r for batch in reader for r in batch["row"].tolist()]


def test_an_s3_object_overwritten_while_it_is_read_is_an_error_naming_the_url(s3):
    url = s3.put("versions/day.csv", _csv(40_000))  # 2.1 MB: 33 blocks of 64 KB, a few of them read ahead
    for policy in ("raise", "skip"):  # a change is no bad row: skip does not count it away
        s3.put("versions/day.csv", _csv(40_000))
        reader = CsvReader(url, SCHEMA, 1000, chunk_bytes=64 << 10, on_bad_row=policy)
        batches = iter(reader)
        first = next(batches)["row"].tolist()
        assert first == list(range(1000))
        s3.put("versions/day.csv", _csv(40_000, shift=7))  # overwritten: the same rows, each 7 bytes later
        with pytest.raises(ChangedError) as caught:
            for batch in batches:
                rows = batch["row"].tolist()
                assert rows == list(range(rows[0], rows[0] + len(rows)))  # never a row of the other version
        assert str(caught.value).startswith(f"{url}: changed while being read: ")
        assert caught.value.path == url and reader.stats.bad_rows == 0


def test_a_parquet_object_overwritten_after_its_footer_was_read_is_an_error(s3, tmp_path, monkeypatch):
    table = pa.table({"label": [k % 2 for k in range(300)], "row": list(range(300)),
                      "text": [os.urandom(200).hex() for _ in range(300)]})  # 120 KB: past the footer's read
    local = tmp_path / "day.parquet"
    pq.write_table(table, local, row_group_size=100)
    url = s3.put("versions-pq/day.parquet", local.read_bytes())
    assert _rows(ParquetReader(url, 64, columns=SCHEMA)) == list(range(300))
    reader = ParquetReader(url, 64, columns=SCHEMA)  # footer and row groups of this version
    pq.write_table(table.slice(0, 250), local, row_group_size=50)
    s3.put("versions-pq/day.parquet", local.read_bytes())
    with pytest.raises(ChangedError, match=rf"^{url}: changed while being read"):
        _rows(reader)
    monkeypatch.setattr(stores, "BLOCK_BYTES", 1024)  # the footer's reads leave row group 0 unread
    opened = ParquetReader(url, 64, columns=SCHEMA)  # overwritten between the reads of one open file:
    handle = fs.open_parquet(url, opened._versions[url])  # its GETs carry If-Match, refused by the store
    pq.write_table(table, local, row_group_size=100)
    s3.put("versions-pq/day.parquet", local.read_bytes())
    with pytest.raises(OSError) as refused:
        handle.read_row_group(0)
    assert ranged.is_expired(refused.value)
    with pytest.raises(ChangedError, match=rf"^{url}: changed while being read"):
        _raise_if_changed(refused.value, url, opened._versions[url])


def test_an_s3_objects_version_names_its_change(s3):
    url = s3.put("versions-tag/v.csv", _csv(10))
    first = ranged.version(url, fresh=True)
    assert first.tag and first.same(ranged.version(url, fresh=True))
    s3.put("versions-tag/v.csv", _csv(12))
    now = ranged.version(url, fresh=True)
    assert not first.same(now) and first.change(now).startswith("was replaced by another file or object")


def test_a_local_file_renamed_over_or_truncated_before_its_read_is_an_error(tmp_path):
    path = tmp_path / "day.csv"
    path.write_bytes(_csv(100))
    reader = CsvReader(str(path), SCHEMA, 10)
    new = tmp_path / "_new.csv"
    new.write_bytes(_csv(100, shift=3))
    new.replace(path)  # another file (inode) under the name the reader took
    with pytest.raises(ChangedError, match=rf"^{path}: changed while being read: it was replaced"):
        _rows(reader)
    reader = CsvReader(str(path), SCHEMA, 10)
    with open(path, "r+b") as f:
        f.truncate(500)
    with pytest.raises(ChangedError, match=rf"^{path}: changed while being read"):
        _rows(reader)
    path.write_bytes(_csv(100))
    reader = CsvReader(str(path), SCHEMA, 10)  # appended to: read up to the size first seen
    with open(path, "ab") as f:
        f.write(b"1,999,appended\n")
    assert _rows(reader) == list(range(100))
