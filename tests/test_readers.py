import math
import re

import pytest
import torch

from conftest import write_lines
from deeprec.data import CriteoReader, ParquetReader, detect_layout, write_parquet
from deeprec.errors import ConfigError, DataError
import deeprec as dr


def collect(reader):
    return [b for b in reader]


def c1_ids(reader) -> list[bytes]:
    return [v for b in reader for v in b["C1"].tolist()]


def test_sample_csv_with_header_matches_python_csv(sample, sample_rows):
    batches = collect(CriteoReader(sample, 64))
    assert [len(b["label"]) for b in batches] == [64, 64, 64, 8]
    b = batches[0]
    assert set(b) == {"label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))}
    assert b["label"].dtype == torch.float32 and b["I5"].dtype == torch.float32
    assert isinstance(b["C1"], dr.Ragged) and b["C1"].is_strings and isinstance(b["C1"].tolist()[0], bytes)
    for i, row in enumerate(sample_rows[:64]):
        assert b["label"][i].item() == float(row[0])
        for d in range(13):
            value = b[f"I{d + 1}"][i].item()
            assert math.isnan(value) if row[1 + d] == "" else value == pytest.approx(float(row[1 + d]))
        for c in range(26):
            assert b[f"C{c + 1}"].tolist()[i] == row[14 + c].encode()


def test_tsv_without_header_reads_the_same(tmp_path, sample, sample_rows):
    tsv = write_lines(tmp_path / "day.tsv", ["\t".join(r) for r in sample_rows])
    assert detect_layout(tsv).delimiter == "\t" and detect_layout(tsv).data_start == 0
    for a, b in zip(collect(CriteoReader(sample, 50)), collect(CriteoReader(tsv, 50)), strict=True):
        for key in a:
            if key.startswith("C"):
                assert a[key].tolist() == b[key].tolist()
            else:
                assert torch.equal(a[key].nan_to_num(-7), b[key].nan_to_num(-7))


def _bad_file(tmp_path, sample_rows, line_no, row):
    lines = ["\t".join(r) for r in sample_rows[:30]]
    lines[line_no - 1] = row
    return write_lines(tmp_path / "bad.tsv", lines)


@pytest.mark.parametrize("line_no,mutate,reason", [
    (7, lambda r: r[:-3], "expected 40 fields, found 37"),
    (12, lambda r: [r[0], "abc"] + r[2:], "column I1: 'abc' is not a number"),
    (19, lambda r: ["2"] + r[1:], "label must be 0 or 1, found 2"),
    (23, lambda r: [""] + r[1:], "label must be 0 or 1, found nothing"),
])
def test_bad_row_raises_with_file_and_line(tmp_path, sample_rows, line_no, mutate, reason):
    path = _bad_file(tmp_path, sample_rows, line_no, "\t".join(mutate(list(sample_rows[line_no - 1]))))
    with pytest.raises(DataError) as err:
        collect(CriteoReader(path, 8))
    assert err.value.line == line_no and err.value.path == path
    assert str(err.value) == f"{path}:{line_no}: {reason}"


def test_bad_rows_skipped_counted_and_logged(tmp_path, sample_rows, caplog):
    lines = ["\t".join(r) for r in sample_rows[:40]]
    lines[2] = "\t".join(sample_rows[2][:10])
    lines[9] = "\t".join(["0", "x"] + sample_rows[9][2:])
    lines[30] = "\t".join(["3"] + sample_rows[30][1:])
    path = write_lines(tmp_path / "bad.tsv", lines)
    reader = CriteoReader(path, 16, on_bad_row="skip")
    rows = sum(len(b["label"]) for b in reader)
    assert rows == 37 and reader.stats.bad_rows == 3 and reader.stats.rows == 37
    assert [e.split(": ")[0] for e in reader.stats.bad_row_examples] == [f"{path}:3", f"{path}:10", f"{path}:31"]
    assert sum("skipping bad row" in r.message for r in caplog.records) == 3


def test_unknown_bad_row_policy_lists_allowed(sample):
    with pytest.raises(ConfigError, match=r"on_bad_row='drop' is not allowed; choose one of 'raise', 'skip'"):
        CriteoReader(sample, 8, on_bad_row="drop")


def test_header_missing_columns_is_a_clear_error(tmp_path):
    path = write_lines(tmp_path / "x.csv", ["label,I1,C1", "0,1,a"])
    with pytest.raises(DataError, match=r"x.csv:1: header lacks column\(s\) I2, I3"):
        CriteoReader(path, 8)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_yield_every_row_exactly_once(unique_tsv, num_shards):
    seen = []
    for k in range(num_shards):
        seen += c1_ids(CriteoReader(unique_tsv, 333, num_shards=num_shards, shard_index=k, chunk_bytes=4096))
    assert len(seen) == 10_000 and len(set(seen)) == 10_000


def test_exactly_once_with_many_files_shuffle_and_bad_rows(tmp_path, unique_tsv):
    with open(unique_tsv) as f:
        lines = f.read().splitlines()
    files = []
    for part in range(3):  # three files, each with two malformed rows
        chunk = lines[part * 3000:(part + 1) * 3000]
        chunk[5] = "garbage"
        chunk[-1] = "1\tnot-a-number" + "\t" * 38
        files.append(write_lines(tmp_path / f"part{part}.tsv", chunk))
    expected = {ln.split("\t")[14] for f in files for ln in open(f).read().splitlines()[:-1] if ln != "garbage"}
    seen = []
    for k in range(4):
        reader = CriteoReader(files, 128, shuffle_buffer=500, seed=3, num_shards=4, shard_index=k,
                              on_bad_row="skip", chunk_bytes=8192, num_epochs=1)
        seen += [v.decode() for v in c1_ids(reader)]
    assert len(seen) == len(expected) == 9000 - 6 and set(seen) == expected


def test_deterministic_for_a_seed_and_shuffled(unique_tsv):
    plain = c1_ids(CriteoReader(unique_tsv, 1000))
    a = c1_ids(CriteoReader(unique_tsv, 1000, shuffle_buffer=2000, seed=5))
    b = c1_ids(CriteoReader(unique_tsv, 1000, shuffle_buffer=2000, seed=5))
    c = c1_ids(CriteoReader(unique_tsv, 1000, shuffle_buffer=2000, seed=6))
    assert a == b and a != c and a != plain and sorted(a) == sorted(plain)


def test_epochs_reshuffle_and_drop_remainder(unique_tsv):
    reader = CriteoReader(unique_tsv, 3000, num_epochs=2, shuffle_buffer=1000, drop_remainder=True)
    batches = collect(reader)
    assert [len(b["label"]) for b in batches] == [3000] * 6
    first = [v for b in batches[:3] for v in b["C1"].tolist()]
    second = [v for b in batches[3:] for v in b["C1"].tolist()]
    assert first != second


def test_resume_position_continues_the_same_stream(unique_tsv):
    kwargs = dict(batch_size=700, shuffle_buffer=1500, seed=9, num_epochs=2)
    full = [b["C1"].tolist() for b in CriteoReader(unique_tsv, **kwargs)]
    reader = CriteoReader(unique_tsv, **kwargs)
    it = iter(reader)
    head = [next(it)["C1"].tolist() for _ in range(17)]  # into the second epoch
    state = reader.state_dict()
    resumed = CriteoReader(unique_tsv, **kwargs)
    resumed.load_state_dict(state)
    assert head + [b["C1"].tolist() for b in resumed] == full
    with pytest.raises(ConfigError, match="other reader settings"):
        CriteoReader(unique_tsv, 100).load_state_dict(state)


def test_parquet_reader_same_batches_and_shards(tmp_path, sample, unique_tsv):
    path = str(tmp_path / "s.parquet")
    assert write_parquet(CriteoReader(sample, 64), path, row_group_rows=50) == 200
    for a, b in zip(collect(CriteoReader(sample, 32)), collect(ParquetReader(path, 32)), strict=True):
        assert torch.equal(a["label"], b["label"]) and torch.equal(a["I3"].nan_to_num(-1), b["I3"].nan_to_num(-1))
        assert a["C7"].tolist() == b["C7"].tolist()
    many = str(tmp_path / "u.parquet")
    write_parquet(CriteoReader(unique_tsv, 1000), many, row_group_rows=1000)
    seen = [v for k in range(3) for v in c1_ids(ParquetReader(many, 256, num_shards=3, shard_index=k))]
    assert len(seen) == 10_000 == len(set(seen))


def test_parquet_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"label": [0, 1, 5], **{f"I{i}": [1.0, 2.0, 3.0] for i in range(1, 14)},
            **{f"C{i}": ["a", "b", "c"] for i in range(1, 27)}}
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table(cols), path)
    with pytest.raises(DataError, match=r"bad.parquet:row group 0:row 2: label must be 0 or 1"):
        collect(ParquetReader(path, 2))
    reader = ParquetReader(path, 2, on_bad_row="skip")
    assert sum(len(b["label"]) for b in reader) == 2 and reader.stats.bad_rows == 1
    pq.write_table(pa.table({k: v for k, v in cols.items() if k != "C5"}), path)
    with pytest.raises(DataError, match="missing column.*C5"):
        ParquetReader(path, 2)
    with open(tmp_path / "junk.parquet", "w") as f:
        f.write("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        ParquetReader(str(tmp_path / "junk.parquet"), 2)


def test_missing_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="no such file"):
        CriteoReader("/nonexistent/day_0.tsv", 8)


def test_gzip_without_its_suffix_is_a_clear_error(tmp_path, sample):
    import gzip

    path = tmp_path / "day_0"  # a .gz is read as a stream (tests/test_remote_data.py); unnamed, it is named
    path.write_bytes(gzip.compress(open(sample, "rb").read()))
    with pytest.raises(DataError, match="day_0: gzip-compressed data in a file whose name does not end .gz"):
        CriteoReader(str(path), 8)


def test_a_device_file_and_mixed_formats_are_refused_before_reading(tmp_path, sample):
    import shutil

    from deeprec.data import open_reader
    from deeprec.errors import ConfigError

    with pytest.raises(ConfigError, match="'/dev/zero' is not a regular file"):
        open_reader(["/dev/zero"], 32)
    shutil.copy(sample, tmp_path / "a.txt")
    (tmp_path / "b.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="mixes Parquet .*b.parquet.* and text files .*a.txt"):
        open_reader([str(tmp_path)], 32)


# -- errors point at the right place (issue 42) ------------------------------------------------
PLACES = dr.data.Schema((dr.data.Column("label", "label"), dr.data.Column("row", "categorical", dtype="int"),
                         dr.data.Column("price", "dense")))


@pytest.mark.parametrize("kind", ["parquet", "orc"])
def test_bad_rows_are_named_and_warned_in_row_order(tmp_path, caplog, kind):
    import pyarrow as pa
    import pyarrow.orc as orc
    import pyarrow.parquet as pq

    labels = [0.0 if k not in (7, 57, 107, 157) else 2.0 for k in range(200)]
    table = pa.table({"label": labels, "row": list(range(200)), "price": [0.5] * 200})
    path = tmp_path / f"bad.{kind}"
    (pq.write_table if kind == "parquet" else orc.write_table)(table, path)
    where = "row group 0" if kind == "parquet" else "stripe 0"
    with pytest.raises(DataError, match=rf"bad\.{kind}:{where}:row 7: label must be 0 or 1, found 2$"):
        collect(dr.data.open_reader(str(path), 64, schema=PLACES))
    skipping = dr.data.open_reader(str(path), 64, schema=PLACES, on_bad_row="skip")
    with caplog.at_level("WARNING", logger="deeprec.data"):
        assert sum(len(b["label"]) for b in skipping) == 196
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping bad row")]
    assert [re.search(r":row (\d+):", s).group(1) for s in said] == ["7", "57", "107", "157"]


def test_a_utf8_bom_before_the_header_or_the_first_row_is_not_data(tmp_path):
    body = "label,row,price\n" + "".join(f"{k % 2},{k},{k}.5\n" for k in range(30))
    with_header = tmp_path / "excel.csv"
    with_header.write_bytes(b"\xef\xbb\xbf" + body.encode())
    rows = [r for b in dr.data.open_reader(str(with_header), 8, schema=PLACES) for r in b["row"].tolist()]
    assert rows == list(range(30))
    headless = tmp_path / "headless.csv"
    headless.write_bytes(b"\xef\xbb\xbf" + body.split("\n", 1)[1].encode())
    schema = dr.data.Schema(PLACES.columns, header=False)
    batch = next(iter(dr.data.open_reader(str(headless), 30, schema=schema)))
    assert batch["row"].tolist() == list(range(30)) and batch["label"].tolist()[:2] == [0.0, 1.0]
    preset = tmp_path / "criteo.tsv"  # a preset is still found from a header after a BOM
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    preset.write_bytes(b"\xef\xbb\xbf" + ("\t".join(names) + "\n" + "\t".join(["1"] + ["2"] * 13 + ["a"] * 26)
                                         + "\n").encode())
    assert dr.data.open_reader(str(preset), 4).schema.name == "Criteo"


def test_a_partition_value_beyond_int64_is_a_bad_row_and_a_signed_one_reads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = dr.data.Schema(PLACES.columns + (dr.data.Column("hour", "categorical", dtype="int"),))
    table = pa.table({"label": [0.0, 1.0, 0.0], "row": [0, 1, 2], "price": [0.5] * 3})
    for hour in ("05", "+7", "99999999999999999999"):
        (tmp_path / f"hour={hour}").mkdir()
        pq.write_table(table, tmp_path / f"hour={hour}" / "p.parquet")
    with pytest.raises(DataError, match=r"hour=99999999999999999999/p\.parquet:row group 0:row 0: column hour: "
                                        r"'99999999999999999999' is beyond the int64 range$"):
        collect(dr.data.open_reader(str(tmp_path), 9, schema=schema))
    skipping = dr.data.open_reader(str(tmp_path), 9, schema=schema, on_bad_row="skip")
    assert [h for b in skipping for h in b["hour"].tolist()] == [5, 5, 5, 7, 7, 7] and skipping.stats.bad_rows == 3
    text = tmp_path / "hours.csv"  # the same values in a text column
    text.write_text("label,row,price,hour\n0,0,0.5,+7\n1,1,0.5,99999999999999999999\n0,2,0.5,-3\n")
    skipping = dr.data.CsvReader(str(text), schema, 8, on_bad_row="skip")
    assert [h for b in skipping for h in b["hour"].tolist()] == [7, -3] and skipping.stats.bad_rows == 1
