"""Batches cut from a chunk converted once (deeprec/data/chunk_batches.py) and chunks parsed in blocks on
Arrow's threads (deeprec/data/csv.py): the same batches as converting each batch's rows alone, whatever
the chunk size, the thread budget or the batch boundaries; bad rows still located by file line."""
from __future__ import annotations

import pyarrow.csv as pacsv
import pytest
import torch

from deeprec.data import CRITEO_SCHEMA, CriteoReader, ParquetReader, write_parquet, write_synthetic
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


def expected_batches(path: str, batch_size: int) -> list[dict]:
    """Each batch converted alone from a one-thread read of the whole file."""
    table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=list(CRITEO_SCHEMA.file_names),
                                                                 use_threads=False),
                           parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                           convert_options=pacsv.ConvertOptions(column_types=CRITEO_SCHEMA.arrow_types(strict=True),
                                                                strings_can_be_null=False))
    return [CRITEO_SCHEMA.to_batch(table.slice(s, batch_size)) for s in range(0, table.num_rows, batch_size)]


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
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = list(CriteoReader(tsv, batch_size, chunk_bytes=chunk_bytes))
    finally:
        torch.set_num_threads(saved)
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
    table = pacsv.read_csv(tsv, read_options=pacsv.ReadOptions(column_names=list(CRITEO_SCHEMA.file_names)),
                           parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                           convert_options=pacsv.ConvertOptions(column_types=CRITEO_SCHEMA.arrow_types(strict=True),
                                                                strings_can_be_null=False)).slice(0, 1000)
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
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(DataError) as raised:
            list(CriteoReader(str(bad), 512))
        skipping = CriteoReader(str(bad), 512, on_bad_row="skip")
        rows = sum(int(b["label"].numel()) for b in skipping)
    finally:
        torch.set_num_threads(saved)
    assert f"{bad}:41" in str(raised.value)  # the first bad row in the file: line 41
    assert rows == ROWS - 2 and skipping.stats.bad_rows == 2
    examples = "\n".join(skipping.stats.bad_row_examples)
    assert f"{bad}:41:" in examples and f"{bad}:{late + 1}:" in examples and "expected 40 fields, found 2" in examples


def test_parquet_batches_are_the_same_on_one_thread_or_two(tsv, tmp_path):
    path = str(tmp_path / "criteo.parquet")
    write_parquet(CriteoReader(tsv, 4096), path, row_group_rows=5000)
    saved, read = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            read[threads] = list(ParquetReader(path, 700))
    finally:
        torch.set_num_threads(saved)
    assert len(read[1]) == len(read[2]) == -(-ROWS // 700)
    for g, w in zip(read[2], read[1]):
        assert_same(g, w)
