"""Batches cut from a chunk converted once (deeprec/data/chunk_batches.py) and chunks parsed in blocks on
Arrow's threads (deeprec/data/csv.py): the same batches as converting each batch's rows alone, whatever
the chunk size, the thread budget or the batch boundaries; bad rows still located by file line."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import torch

from deeprec.data import CRITEO_SCHEMA, Column, CriteoReader, ParquetReader, Schema, write_parquet, write_synthetic
from deeprec.data.chunk_batches import ChunkBatches
from deeprec.data.csv import PARSE_BLOCK_BYTES
from deeprec.errors import DataError
from deeprec.ragged import Ragged

ROWS = 12_000  # ~2.7 MB: several of Arrow's 1 MiB parse blocks in one 4 MiB chunk


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunks") / "criteo.tsv"
    write_synthetic(str(path), ROWS, cardinalities="small", seed=3, progress=False)
    assert path.stat().st_size > 2 * PARSE_BLOCK_BYTES
    return str(path)


def whole_tsv(path: str) -> pa.Table:
    """The whole file in one one-thread read."""
    return pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=list(CRITEO_SCHEMA.file_names),
                                                                use_threads=False),
                          parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                          convert_options=pacsv.ConvertOptions(column_types=CRITEO_SCHEMA.arrow_types(strict=True),
                                                               strings_can_be_null=False))


def expected_batches(path: str, batch_size: int) -> list[dict]:
    """Each batch converted alone from a one-thread read of the whole file."""
    table = whole_tsv(path)
    return [CRITEO_SCHEMA.to_batch(table.slice(s, batch_size)) for s in range(0, table.num_rows, batch_size)]


def read_all(path: str, threads: int, batch_size: int = 512, **options) -> tuple[list[dict], object]:
    """Every batch of a CriteoReader and its stats, read with a torch budget of `threads`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reader = CriteoReader(path, batch_size, **options)
        return list(reader), reader.stats
    finally:
        torch.set_num_threads(saved)


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        if isinstance(value, Ragged):
            g = got[name]
            assert int(g.offsets[0]) == 0 and g.values.numel() == int(g.offsets[-1]), name
            assert torch.equal(g.offsets, value.offsets) and torch.equal(g.values, value.values), name
        else:
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, equal_nan=True, msg=name)  # NaN: missing


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk_bytes,batch_size", [(4 << 20, 512), (50_000, 333), (50_000, 5_000)])
def test_batches_equal_each_converted_alone(tsv, threads, chunk_bytes, batch_size):
    # 50 kB chunks: batches spanning two or several chunks; 4 MiB: several parse blocks on 2 threads
    want = expected_batches(tsv, batch_size)
    got, _ = read_all(tsv, threads, batch_size, chunk_bytes=chunk_bytes)
    assert len(got) == len(want) and sum(int(b["label"].numel()) for b in got) == ROWS
    for g, w in zip(got, want):
        assert_same(g, w)


def test_a_resumed_reader_continues_with_the_same_batches(tsv):
    reader = CriteoReader(tsv, 500, chunk_bytes=60_000)
    it = iter(reader)
    [next(it) for _ in range(7)]
    state = reader.state_dict()
    rest = list(it)
    again = CriteoReader(tsv, 500, chunk_bytes=60_000)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest)
    for g, w in zip(resumed, rest):
        assert_same(g, w)


def test_a_chunk_cut_into_batches_is_its_rows(tsv):
    table = whole_tsv(tsv).slice(0, 1000)
    chunk = ChunkBatches(CRITEO_SCHEMA, table)
    for start, stop in [(0, 1), (0, 1000), (17, 400), (999, 1000), (500, 500)]:
        assert_same(chunk.rows(start, stop), CRITEO_SCHEMA.to_batch(table.slice(start, stop - start)))


@pytest.mark.parametrize("threads", [1, 2])
def test_bad_rows_in_a_later_parse_block_are_named_by_their_line(tsv, tmp_path, threads):
    lines = open(tsv, "rb").read().splitlines(keepends=True)
    late = ROWS - 100  # in the file's last parse block
    lines[late] = b"1\t2\n"  # 2 fields of 40
    lines[40] = lines[40].replace(b"\t", b"\tx", 1)  # I1 = "x...": not a number
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"".join(lines))
    with pytest.raises(DataError) as raised:
        read_all(str(bad), threads)
    batches, stats = read_all(str(bad), threads, on_bad_row="skip")
    rows = sum(int(b["label"].numel()) for b in batches)
    assert f"{bad}:41" in str(raised.value)  # the first bad row in the file: line 41
    assert rows == ROWS - 2 and stats.bad_rows == 2
    examples = "\n".join(stats.bad_row_examples)
    assert f"{bad}:41:" in examples and f"{bad}:{late + 1}:" in examples and "expected 40 fields, found 2" in examples


def test_parquet_batches_equal_the_tsvs(tsv, tmp_path):
    path = str(tmp_path / "criteo.parquet")
    write_parquet(CriteoReader(tsv, 4096), path, row_group_rows=5000)
    got, want = list(ParquetReader(path, 700)), expected_batches(tsv, 700)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_every_column_kind_cut_from_a_chunk_is_its_rows():
    schema = Schema((Column("score", "label", positive_at=3.5), Column("w", "weight"), Column("d", "dense"),
                     Column("cat", "categorical", dtype="int"), Column("s", "categorical"),
                     Column("ids", "sequence", dtype="int", max_length=3), Column("words", "sequence")))
    rng = np.random.default_rng(0)
    n = 3000
    table = pa.table({
        "score": pa.array(rng.uniform(0, 5, n), pa.float32()),
        "w": pa.array([None if k % 7 == 0 else 0.5 for k in range(n)], pa.float32()),
        "d": pa.array([None if k % 5 == 0 else float(k) for k in range(n)], pa.float32()),
        "cat": pa.array([None if k % 3 == 0 else k for k in range(n)], pa.int64()),
        "s": pa.array([b"" if k % 4 == 0 else b"v%d" % k for k in range(n)], pa.binary()),
        "ids": pa.array(["|".join(str(k + j) for j in range(k % 6)) for k in range(n)]),
        "words": pa.array(["|".join(f"w{j}" for j in range(k % 4)) for k in range(n)]),
    })
    chunk = ChunkBatches(schema, table)
    for start, stop in [(0, 1), (0, n), (5, 700), (2999, 3000), (100, 100)]:
        got, want = chunk.rows(start, stop), schema.to_batch(table.slice(start, stop - start))
        for name in ("ids", "words"):  # nested and flat sequences: offsets from 0, every item of the rows
            assert got[name].tolist() == want[name].tolist() and int(got[name].offsets[0]) == 0
        assert_same({k: v for k, v in got.items() if k != "words"}, {k: v for k, v in want.items() if k != "words"})


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_the_wrong_width_in_several_parse_blocks_are_named_in_file_order(tsv, tmp_path, threads):
    lines = open(tsv, "rb").read().splitlines(keepends=True)
    at = [200, 6000, 11900]  # 0-based: one in each of the file's first, middle and last parse blocks
    for k in at:
        lines[k] = b"0\t1\t2\n"
    bad = tmp_path / "widths.tsv"
    bad.write_bytes(b"".join(lines))
    with pytest.raises(DataError, match=rf"{bad}:201"):
        read_all(str(bad), threads)
    batches, stats = read_all(str(bad), threads, on_bad_row="skip")
    assert sum(int(b["label"].numel()) for b in batches) == ROWS - 3 and stats.bad_rows == 3
    named = [int(e.split(f"{bad}:")[1].split(":")[0]) for e in stats.bad_row_examples]
    assert named == [k + 1 for k in at]


def _quoted_csv(path, rows: int, broken_at: int | None = None) -> None:
    """A CSV with a header whose C1 values are quoted and hold newlines (a field over six lines: most newlines
    of the file are inside quotes, where a block cut at a newline would cut a row)."""
    names = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    out = [",".join(names)]
    for k in range(rows):
        c1 = f'"a{k}\n\n\n\n\nb"' if k != broken_at else f'"open{k}'  # an unclosed quote swallows the lines after it
        out.append(",".join([str(k % 2), *(str(k % 9) for _ in range(13)), c1, *(f"x{k % 50}" for _ in range(25))]))
    path.write_text("\n".join(out) + "\n")


@pytest.mark.parametrize("threads", [1, 2])
def test_quoted_fields_holding_newlines_across_parse_blocks(tmp_path, threads):
    path = tmp_path / "quoted.csv"
    _quoted_csv(path, 20_000)
    assert path.stat().st_size > 2 * PARSE_BLOCK_BYTES
    batches, stats = read_all(str(path), threads)
    c1 = [v for b in batches for v in b["C1"].tolist()]
    assert stats.bad_rows == 0 and c1 == [b"a%d\n\n\n\n\nb" % k for k in range(20_000)]


def test_an_unclosed_quote_is_refused_the_same_on_one_thread_or_two(tmp_path):
    path = tmp_path / "unclosed.csv"
    _quoted_csv(path, 20_000, broken_at=15_000)  # in the file's last parse block
    read = {}
    for threads in (1, 2):
        with pytest.raises(DataError, match="unbalanced quote"):
            read_all(str(path), threads)
        batches, stats = read_all(str(path), threads, on_bad_row="skip")
        read[threads] = (sum(int(b["label"].numel()) for b in batches), stats.bad_rows)
    # the open quote runs on into the next row's quoted field: those two rows are lost, and counted
    assert read[2] == read[1] and read[1][0] == 20_000 - 2 and read[1][1] > 0
