"""Tables as teams store them (issue #27): ORC files and Hive-partitioned folders read with the
guarantees of the CSV and Parquet readers (same batches, sharding, exactly once, exact resume,
errors naming the file and the row)."""
import json
import math
import os

import pyarrow as pa
import pyarrow.orc as orc
import pyarrow.parquet as pq
import pytest
import torch

import deeprec as dr
from deeprec.cli import main
from deeprec.data import Column, CsvReader, OrcReader, ParquetReader, Schema, open_reader, resolve_schema, write_orc
from deeprec.data.reader import resolve_paths
from deeprec.errors import ConfigError, DataError

SCHEMA = Schema((Column("click", "label"), Column("price", "dense"), Column("user", "categorical"),
                 Column("item", "categorical", dtype="int"), Column("tags", "sequence", max_length=3)),
                delimiter=",", header=True, name="clicks")


def _rows(n, start=0):
    rows = []
    for k in range(start, start + n):
        rows.append({"click": float(k % 3 == 0), "price": None if k % 7 == 0 else k * 0.5,
                     "user": f"u{k:05d}", "item": None if k % 11 == 0 else k % 97,
                     "tags": "|".join(f"t{(k + j) % 13}" for j in range(k % 5))})
    return rows


def _table(rows):
    return pa.table({"click": pa.array([r["click"] for r in rows], pa.float64()),
                     "price": pa.array([r["price"] for r in rows], pa.float64()),
                     "user": pa.array([r["user"] for r in rows], pa.string()),
                     "item": pa.array([r["item"] for r in rows], pa.int64()),
                     "tags": pa.array([r["tags"] for r in rows], pa.string())})


def _write_csv(path, rows):
    def cell(v):
        return "" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
    with open(path, "w") as f:
        f.write("click,price,user,item,tags\n")
        for r in rows:
            f.write(",".join(cell(r[c]) for c in ("click", "price", "user", "item", "tags")) + "\n")
    return str(path)


def _write_orc(path, rows_or_table, stripe_rows=100):
    """ORC with stripes of `stripe_rows` rows (the writer closes a stripe per batch once past stripe_size)."""
    table = rows_or_table if isinstance(rows_or_table, pa.Table) else _table(rows_or_table)
    orc.write_table(table, str(path), stripe_size=1, batch_size=stripe_rows)
    return str(path)


def _plain(batch):
    """A batch as comparable Python values (NaN -> None)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, dr.Ragged):
            out[k] = v.tolist()
        else:
            out[k] = [None if isinstance(x, float) and math.isnan(x) else x for x in v.tolist()]
    return out


def _users(reader):
    return [u for b in reader for u in b["user"].tolist()]


@pytest.fixture
def orc_file(tmp_path):
    path = _write_orc(tmp_path / "clicks.orc", _rows(1000), stripe_rows=100)
    assert orc.ORCFile(path).nstripes == 10
    return path


# -- ORC ------------------------------------------------------------------------------------------
def test_orc_gives_the_batches_of_csv_and_parquet(tmp_path, orc_file):
    rows = _rows(1000)
    csv_path = _write_csv(tmp_path / "clicks.csv", rows)
    pq_path = tmp_path / "clicks.parquet"
    pq.write_table(_table(rows), pq_path, row_group_size=128)
    readers = [CsvReader(csv_path, SCHEMA, 64), ParquetReader(str(pq_path), 64, columns=SCHEMA),
               OrcReader(orc_file, 64, columns=SCHEMA), open_reader([orc_file], 64, schema=SCHEMA),
               open_reader("file://" + orc_file, 64, schema=SCHEMA)]  # a URL: through fsspec
    assert isinstance(readers[-1], OrcReader) and isinstance(readers[-2], OrcReader)
    streams = [[_plain(b) for b in r] for r in readers]
    assert len(streams[0]) == 16 and [len(b["user"]) for b in streams[0]][-1] == 1000 - 15 * 64
    for other in streams[1:]:
        assert other == streams[0]
    first = next(iter(OrcReader(orc_file, 8, columns=SCHEMA)))
    assert first["item"].dtype == torch.int64 and first["item"].tolist() == [-1, 1, 2, 3, 4, 5, 6, 7]  # None: -1
    assert first["tags"].tolist()[4] == [b"t5", b"t6", b"t7"]  # split, the last max_length kept
    assert math.isnan(first["price"][0]) and first["user"].tolist()[1] == b"u00001"
    written = str(tmp_path / "written.orc")  # what deeprec data convert writes: stripes of stripe_rows rows
    assert write_orc(CsvReader(csv_path, SCHEMA, 64), written, stripe_rows=300, compression="uncompressed") == 1000
    assert orc.ORCFile(written).nstripes == 4
    assert [_plain(b) for b in OrcReader(written, 64, columns=SCHEMA)] == streams[0]


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("shuffle_buffer", [0, 50])
def test_orc_shards_read_every_row_exactly_once(orc_file, num_shards, shuffle_buffer):
    seen = []
    for k in range(num_shards):
        users = _users(OrcReader(orc_file, 32, columns=SCHEMA, num_shards=num_shards, shard_index=k,
                                 shuffle_buffer=shuffle_buffer, seed=3))
        assert users  # every shard holds stripes
        seen += users
    assert sorted(seen) == [f"u{k:05d}".encode() for k in range(1000)]


def test_orc_shuffle_is_deterministic_and_resume_is_exact(orc_file):
    def reader():
        return OrcReader(orc_file, 48, columns=SCHEMA, shuffle_buffer=200, seed=7, num_epochs=2)

    full = [_plain(b) for b in reader()]
    assert full == [_plain(b) for b in reader()]
    assert [u for b in full[:21] for u in b["user"]] != sorted(u for b in full[:21] for u in b["user"])
    for stop in (5, 21, 25):  # mid-file, at the epoch's end, in the second epoch
        first = reader()
        it = iter(first)
        head = [_plain(next(it)) for _ in range(stop)]
        state = first.state_dict()
        resumed = reader()
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert head + [_plain(b) for b in resumed] == full


@pytest.mark.parametrize("fmt", ["orc", "hive"])
def test_resume_without_shuffle_is_exact(tmp_path, orc_file, fmt):
    root = orc_file if fmt == "orc" else _hive_table(tmp_path / "clicks", "orc")[0]
    schema = SCHEMA if fmt == "orc" else HIVE_SCHEMA

    def reader():
        return open_reader(root, 30, schema=schema, num_shards=2, shard_index=1, num_epochs=2)

    full = [_plain(b) for b in reader()]
    for stop in (1, 4, 7, len(full) // 2 + 1):  # mid-stripe, on a stripe's end, in the second epoch
        first = reader()
        it = iter(first)
        head = [_plain(next(it)) for _ in range(stop)]
        resumed = reader()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [_plain(b) for b in resumed] == full


def test_orc_errors_name_the_file_stripe_and_row(tmp_path, orc_file):
    lacking = _write_orc(tmp_path / "lacking.orc", _table(_rows(10)).drop_columns(["price", "tags"]))
    with pytest.raises(DataError, match=r"lacking\.orc: missing column\(s\) price, tags"):
        OrcReader(lacking, 8, columns=SCHEMA)
    rows = _rows(300)
    rows[234]["click"] = 2.0
    bad = _write_orc(tmp_path / "bad.orc", rows, stripe_rows=100)
    with pytest.raises(DataError, match=r"bad\.orc:stripe 2:row 34: click must be 0 or 1, found 2"):
        list(OrcReader(bad, 64, columns=SCHEMA))
    skipping = OrcReader(bad, 64, columns=SCHEMA, on_bad_row="skip")
    assert len(_users(skipping)) == 299 and skipping.stats.bad_rows == 1
    text = _table(_rows(10)).set_column(1, "price", pa.array(["1.5"] * 9 + ["cheap"]))
    with pytest.raises(DataError, match=r"text\.orc:stripe 0:row 9: column price: 'cheap' is not a number"):
        list(OrcReader(_write_orc(tmp_path / "text.orc", text), 8, columns=SCHEMA))
    not_orc = tmp_path / "x.orc"
    not_orc.write_text("click\n1\n")
    with pytest.raises(DataError, match="not a readable ORC file"):
        OrcReader(str(not_orc), 8, columns=SCHEMA)
    with pytest.raises(ConfigError, match="mixes Parquet .* and ORC"):
        pq.write_table(_table(_rows(3)), tmp_path / "y.parquet")
        resolve_paths([str(orc_file), str(tmp_path / "y.parquet")])


def test_orc_in_dataloader_workers_reads_every_row_once(orc_file):
    loader = torch.utils.data.DataLoader(OrcReader(orc_file, 64, columns=SCHEMA), batch_size=None, num_workers=2)
    assert sorted(u for b in loader for u in b["user"].tolist()) == [f"u{k:05d}".encode() for k in range(1000)]


def test_orc_more_shards_than_stripes_is_refused_early(tmp_path):
    one = _write_orc(tmp_path / "one.orc", _rows(50), stripe_rows=100)
    with pytest.raises(dr.errors.EmptyShardError, match="ORC is sharded by stripe .* 1 stripe"):
        OrcReader(one, 8, columns=SCHEMA, num_shards=2, shard_index=1)


# -- Hive-partitioned tables -------------------------------------------------------------------
PARTITIONS = [("2026-11-24", h) for h in (5, 10, 23)] + [("2026-11-25", h) for h in (0, 7)]
HIVE_SCHEMA = Schema(SCHEMA.columns + (Column("dt", "ignore"), Column("hour", "categorical")),
                     name="clicks_hourly")


def _hive_table(root, fmt="parquet", rows_each=40, padded=False):
    """root/dt=D/hour=H/part-0000{0,1}.<fmt> (two files a partition), Spark's _SUCCESS at the root;
    user ids count up in time order."""
    k = 0
    for dt, hour in PARTITIONS:
        folder = root / f"dt={dt}" / (f"hour={hour:02d}" if padded else f"hour={hour}")
        folder.mkdir(parents=True)
        for part in range(2):
            table = _table(_rows(rows_each // 2, start=k))
            k += rows_each // 2
            if fmt == "parquet":
                pq.write_table(table, folder / f"part-{part:05d}.parquet", row_group_size=10)
            else:  # as Hive writes ORC tables: no extension
                _write_orc(folder / f"{part:06d}_0", table, stripe_rows=10)
        (folder / ".part-00000.crc").write_bytes(b"crc")
    (root / "_SUCCESS").write_text("")
    return str(root), k


@pytest.mark.parametrize("fmt", ["parquet", "orc"])
def test_a_hive_table_reads_in_partition_order_with_partition_columns(tmp_path, fmt):
    root, n = _hive_table(tmp_path / "clicks", fmt)
    files = resolve_paths(root)
    assert len(files) == 10 and not any("_SUCCESS" in f or ".crc" in f for f in files)
    assert [os.path.relpath(f, root).split(os.sep)[1] for f in files[::2]] == \
        ["hour=5", "hour=10", "hour=23", "hour=0", "hour=7"]  # time order: hour=5 before hour=10
    reader = open_reader(root, 16, schema=HIVE_SCHEMA)
    assert isinstance(reader, OrcReader if fmt == "orc" else ParquetReader)
    batches = list(reader)
    assert "dt" not in batches[0]
    assert [u for b in batches for u in b["user"].tolist()] == [f"u{k:05d}".encode() for k in range(n)]
    hours = [h for b in batches for h in b["hour"].tolist()]
    assert hours == [str(h).encode() for _, h in PARTITIONS for _ in range(40)]
    # the same table through fsspec (as on S3): a glob of its files, extensionless ORC recognised by its bytes
    url = open_reader(f"file://{root}/dt=*/hour=*/[!.]*", 16, schema=HIVE_SCHEMA)  # (fsspec globs match .crc)
    def pairs(stream):  # (a glob lists in plain name order: hour=10 before hour=5)
        return sorted((u, h) for b in stream for u, h in zip(b["user"].tolist(), b["hour"].tolist()))
    assert type(url) is type(reader) and pairs(url) == pairs(batches) and len(pairs(batches)) == n
    remote_root = open_reader(f"file://{root}", 16, schema=HIVE_SCHEMA)  # a table root URL: walked, in order
    assert [_plain(b) for b in remote_root] == [_plain(b) for b in batches]
    # the hour as an int feature, and the day as one too (a column the files lack comes from the folders)
    as_int = Schema(SCHEMA.columns + (Column("hour", "categorical", dtype="int"), Column("dt", "categorical")))
    batch = next(iter(open_reader(root, 100, schema=as_int)))
    assert batch["hour"].tolist() == [5] * 40 + [10] * 40 + [23] * 20 and batch["dt"].tolist()[0] == b"2026-11-24"


def test_a_partition_folder_a_glob_and_shards_of_a_hive_table(tmp_path):
    root, n = _hive_table(tmp_path / "clicks", padded=True)
    day = _users(open_reader(os.path.join(root, "dt=2026-11-25") + os.sep, 16, schema=HIVE_SCHEMA))
    assert day == [f"u{k:05d}".encode() for k in range(120, 200)]
    hours = open_reader(os.path.join(root, "dt=2026-11-24", "hour=1*"), 16, schema=HIVE_SCHEMA)
    assert {h for b in hours for h in b["hour"].tolist()} == {b"10"}  # a partition filter is a glob
    for num_shards in (2, 3):
        seen = []
        for k in range(num_shards):
            seen += _users(open_reader(root, 16, schema=HIVE_SCHEMA, num_shards=num_shards, shard_index=k,
                                       shuffle_buffer=30, seed=1))
        assert sorted(seen) == [f"u{k:05d}".encode() for k in range(n)]


def test_hive_partition_values_missing_and_bad(tmp_path):
    root = tmp_path / "t"
    for hour in ("05", "__HIVE_DEFAULT_PARTITION__", "late"):
        (root / f"hour={hour}").mkdir(parents=True)
        pq.write_table(_table(_rows(3)), root / f"hour={hour}" / "p.parquet")
    batch = next(iter(open_reader(str(root), 9, schema=HIVE_SCHEMA)))
    assert batch["hour"].tolist() == [b"05"] * 3 + [b""] * 3 + [b"late"] * 3  # Hive's null: missing
    as_int = Schema(SCHEMA.columns + (Column("hour", "categorical", dtype="int"),))
    with pytest.raises(DataError, match=r"hour=late/p\.parquet:row group 0:row 0: column hour: 'late' is not an integer"):
        list(open_reader(str(root), 9, schema=as_int))
    with pytest.raises(DataError, match=r"p\.parquet: missing column\(s\) region"):
        open_reader(str(root), 9, schema=Schema(SCHEMA.columns + (Column("region", "categorical"),)))


def test_deeprec_train_on_a_hive_table_and_convert_to_orc(tmp_path, capsys):
    root, n = _hive_table(tmp_path / "clicks", rows_each=200)
    toml = tmp_path / "clicks.toml"
    toml.write_text('name = "clicks_hourly"\n'
                    '[[column]]\nname = "click"\nkind = "label"\n'
                    '[[column]]\nname = "price"\nkind = "dense"\n'
                    '[[column]]\nname = "user"\nkind = "categorical"\n'
                    '[[column]]\nname = "item"\nkind = "categorical"\ndtype = "int"\n'
                    '[[column]]\nname = "tags"\nkind = "sequence"\n'
                    '[[column]]\nname = "hour"\nkind = "categorical"\n')
    assert resolve_schema(root, str(toml)).names[-1] == "hour"
    out = tmp_path / "r.json"
    assert main(["train", "--data", root, "--schema", str(toml), "--steps", "6", "--batch-size", "64",
                 "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 6
    capsys.readouterr()
    csv_path = _write_csv(tmp_path / "c.csv", _rows(500))
    schema_toml = tmp_path / "c.toml"
    schema_toml.write_text(toml.read_text().rsplit("[[column]]", 1)[0])  # the CSV has no hour
    converted = tmp_path / "c.orc"
    assert main(["data", "convert", csv_path, "--schema", str(schema_toml), "--out", str(converted)]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 500 and orc.ORCFile(str(converted)).nrows == 500
    assert main(["train", "--data", str(converted), "--schema", str(schema_toml), "--steps", "3",
                 "--batch-size", "64", "--no-progress"]) == 0
    assert main(["data", "convert", str(converted), "--out", str(tmp_path / "again.orc")]) == 2
    assert "ORC files already" in capsys.readouterr().err
