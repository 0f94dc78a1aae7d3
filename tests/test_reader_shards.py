"""Too many shards for the data is a ConfigError when the reader is built, not after training."""
import pytest

from deeprec.cli import main
from deeprec.data import CriteoReader, ParquetReader, open_reader, write_parquet
from deeprec.errors import ConfigError, DataError, EmptyShardError
from output import line_with


@pytest.fixture(scope="module")
def four_groups(tmp_path_factory, sample):
    """The 200-row sample as Parquet in 4 row groups of 50 rows."""
    path = str(tmp_path_factory.mktemp("pq") / "data.parquet")
    assert write_parquet(CriteoReader(sample, 50), path, row_group_rows=50) == 200
    return path


def _rows(reader) -> int:
    return sum(len(b["label"]) for b in reader)


def test_parquet_shard_beyond_its_row_groups_is_named_at_construction(four_groups):
    with pytest.raises(EmptyShardError) as caught:
        ParquetReader(four_groups, 8, num_shards=10, shard_index=9)
    err = caught.value
    assert isinstance(err, ConfigError)
    assert (err.paths, err.shard_index, err.num_shards, err.max_shards) == ([four_groups], 9, 10, 4)
    assert "data.parquet: shard 9 of 10 holds no rows" in str(err) and "4 row group(s)" in str(err)
    assert "use num_shards <= 4" in str(err)


def test_parquet_shards_within_its_row_groups_read_every_row(four_groups):
    assert [_rows(ParquetReader(four_groups, 8, num_shards=4, shard_index=k)) for k in range(4)] == [50] * 4
    # a list of shards with rows among them is fine: the held-out training side of --eval-fraction
    assert _rows(open_reader(four_groups, 8, num_shards=10, shard_index=list(range(9)))) == 200


def test_tsv_byte_range_too_small_for_a_row_is_named(tmp_path, sample_rows):
    path = tmp_path / "three.tsv"
    path.write_text("".join("\t".join(r) + "\n" for r in sample_rows[:3]))
    outcome = []
    for k in range(10):  # every shard either refuses at construction or yields rows: none is silently empty
        try:
            outcome.append(_rows(CriteoReader(str(path), 8, num_shards=10, shard_index=k)))
        except EmptyShardError as err:
            assert f"three.tsv: shard {k} of 10 holds no rows" in str(err) and err.shard_index == k
            assert 1 <= err.max_shards <= 3
            outcome.append(None)
    assert sum(n for n in outcome if n) == 3 and outcome.count(None) == 7


def test_a_file_without_rows_is_still_left_to_iteration(tmp_path, sample):
    path = tmp_path / "header.csv"
    path.write_text(open(sample).readline())
    reader = open_reader([str(path)], 64, num_shards=2, shard_index=1)
    with pytest.raises(DataError, match="no data rows"):
        next(iter(reader))


def test_train_with_too_fine_an_eval_fraction_stops_before_training(four_groups, tmp_path, capsys):
    code = main(["train", "--data", four_groups, "--eval-fraction", "0.1", "--steps", "5", "--batch-size", "8",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"])
    assert code == 2 and line_with(capsys.readouterr().err, "data.parquet", "row group")
    assert not (tmp_path / "ckpt").exists()  # nothing trained, nothing saved
