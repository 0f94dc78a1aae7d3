"""Dataset schemas, the generic CSV reader, presets on the real samples, ragged sequences."""
import numpy as np
import pytest
import torch

from deeprec import ops
from deeprec.cli import sample_path
from deeprec.data import (PRESETS, Column, CsvReader, ParquetReader, Schema, detect_preset, load_schema,
                          schema_for, write_parquet)
from deeprec.errors import ConfigError, DataError
from deeprec.nn import Ragged
from tests.conftest import write_lines

SAMPLES = {"criteo": ("criteo_sample.txt", 200), "avazu": ("avazu_sample.txt", 100),
           "movielens": ("movielens_sample.txt", 200), "byterec": ("byterec_sample.txt", 200)}


@pytest.mark.parametrize("preset", sorted(SAMPLES))
def test_each_preset_reads_its_real_sample(preset):
    name, rows = SAMPLES[preset]
    path = sample_path(name)
    assert detect_preset(path) == preset
    schema = schema_for(path)
    batches = list(CsvReader(path, schema, batch_size=64))
    assert sum(len(b[schema.labels[0]]) for b in batches) == rows
    batch = batches[0]
    assert set(batch) == set(schema.names)
    for label in schema.labels:
        assert set(batch[label].unique().tolist()) <= {0.0, 1.0}


def test_movielens_values_match_the_file():
    path = sample_path("movielens_sample.txt")
    batch = next(iter(CsvReader(path, schema_for(path), batch_size=3)))
    # first rows: 3299,235,4,...,Comedy|Drama,F,25,4,19119 / 3630,3256,3,...,Action|Thriller
    assert batch["rating"].tolist() == [1.0, 0.0, 1.0]  # rating >= 4
    assert batch["user_id"].tolist()[0] == b"3299" and batch["gender"].tolist()[0] == b"F"
    genres = batch["genres"]
    assert isinstance(genres, Ragged) and genres.offsets.tolist()[:3] == [0, 2, 4]
    assert genres.values.tolist()[:4] == [b"Comedy", b"Drama", b"Action", b"Thriller"]


def test_byterec_has_two_labels_and_no_header():
    path = sample_path("byterec_sample.txt")
    schema = schema_for(path)
    assert schema.labels == ("finish", "like") and schema.header is False
    batch = next(iter(CsvReader(path, schema, batch_size=2)))
    assert batch["uid"].tolist() == [b"37448", b"8623"] and batch["duration_time"].tolist() == [9.0, 8.0]


def test_a_users_csv_with_a_toml_schema(tmp_path):
    data = write_lines(tmp_path / "mine.csv", ["clicked,price,shop,tags,w",
                                               "1,3.5,a,x|y|z,2", "0,,b,,", "1,1,7,y,0.5"])
    toml = tmp_path / "mine.toml"
    toml.write_text('name = "shop"\ndelimiter = ","\nheader = true\n'
                    '[[column]]\nname = "clicked"\nkind = "label"\n'
                    '[[column]]\nname = "price"\nkind = "dense"\n'
                    '[[column]]\nname = "shop"\nkind = "categorical"\n'
                    '[[column]]\nname = "tags"\nkind = "sequence"\nmax_length = 2\n'
                    '[[column]]\nname = "w"\nkind = "weight"\n')
    schema = load_schema(str(toml))
    batch = next(iter(CsvReader(data, schema, batch_size=8)))
    assert batch["clicked"].tolist() == [1.0, 0.0, 1.0]
    assert torch.isnan(batch["price"][1]) and batch["price"][0] == 3.5
    assert batch["shop"].tolist() == [b"a", b"b", b"7"]
    assert batch["tags"].values.tolist() == [b"y", b"z", b"y"] and batch["tags"].offsets.tolist() == [0, 2, 2, 3]
    assert batch["w"].tolist() == [2.0, 1.0, 0.5]  # missing weight = 1


def test_schema_errors_name_the_column(tmp_path):
    data = write_lines(tmp_path / "a.csv", ["click,price", "1,2"])
    schema = Schema((Column("click", "label"), Column("price", "dense"), Column("shop", "categorical")))
    with pytest.raises(DataError, match="header lacks column\\(s\\) shop") as err:
        CsvReader(data, schema, batch_size=2)
    assert "a.csv:1" in str(err.value)
    bad = write_lines(tmp_path / "b.csv", ["click,price", "1,2", "0,cheap"])
    with pytest.raises(DataError, match="column price: 'cheap' is not a number") as err:
        list(CsvReader(bad, Schema((Column("click", "label"), Column("price", "dense"))), batch_size=4))
    assert "b.csv:3" in str(err.value)
    with pytest.raises(ConfigError, match="kind"):
        Column("x", "feature")
    with pytest.raises(ConfigError, match="declared twice: a"):
        Schema((Column("a", "label"), Column("a", "dense")))
    with pytest.raises(ConfigError, match="embed_with='nope'"):
        Schema((Column("a", "label"), Column("s", "sequence", embed_with="nope")))
    toml = tmp_path / "bad.toml"
    toml.write_text('[[column]]\nname = "a"\nkind = "label"\ncolour = "red"\n')
    with pytest.raises(ConfigError, match="colour"):
        load_schema(str(toml))
    with pytest.raises(DataError, match="no schema preset matches"):
        detect_preset(write_lines(tmp_path / "c.csv", ["foo;bar", "1;2"]))


def test_int_columns_and_bad_ints_are_reported(tmp_path):
    schema = Schema((Column("y", "label"), Column("item", "categorical", dtype="int"),
                     Column("hist", "sequence", dtype="int")), delimiter="\t")
    data = write_lines(tmp_path / "i.tsv", ["y\titem\thist", "1\t5\t1|2", "0\t\t", "1\tx7\t3"])
    batches = list(CsvReader(data, schema, batch_size=8, on_bad_row="skip"))
    reader_rows = batches[0]
    assert reader_rows["item"].tolist() == [5, -1]  # missing int = -1; the bad row is skipped
    assert reader_rows["hist"].values.tolist() == [1, 2] and reader_rows["hist"].offsets.tolist() == [0, 2, 2]


def test_sequence_reader_and_parquet_agree(tmp_path, behavior):
    train, _ = behavior
    schema = PRESETS["behavior"]
    csv_batches = list(CsvReader(train, schema, batch_size=1000))[:3]
    pq = str(tmp_path / "b.parquet")
    write_parquet(CsvReader(train, schema, batch_size=1000), pq)
    pq_batches = list(ParquetReader(pq, 1000, columns=schema))[:3]
    for a, b in zip(csv_batches, pq_batches):
        for name in schema.names:
            if isinstance(a[name], Ragged):
                assert torch.equal(a[name].values, b[name].values) and torch.equal(a[name].offsets, b[name].offsets)
            else:
                assert torch.equal(a[name], b[name])


def test_ragged_ops_handle_empty_and_long_rows():
    r = Ragged(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 0, 5, 7]))  # empty, 5 items, 2 items
    ids, mask = ops.pad_ragged(r, 3, pad_value=-1)
    assert ids.tolist() == [[-1, -1, -1], [3, 4, 5], [6, 7, -1]]  # the last 3 of a long row, oldest first
    assert mask.tolist() == [[False] * 3, [True] * 3, [True, True, False]]
    t = ops.truncate_ragged(r, 1)
    assert t.values.tolist() == [5, 7] and t.offsets.tolist() == [0, 0, 1, 2]
    strings = Ragged(Ragged.from_strings([b"a", b"b", b"a"]), torch.tensor([0, 2, 3]))
    hashed = ops.hash_ragged(strings, 1000)
    assert hashed.values[0] == hashed.values[2] and hashed.offsets.tolist() == [0, 2, 3]
    assert ops.hash_ragged(r, 4).values.tolist() == [1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ConfigError, match="hash string values first"):
        ops.pad_ragged(strings, 2)
    with pytest.raises(ConfigError, match="max_length must be a positive int"):
        ops.pad_ragged(r, 0)


def test_a_sequence_column_feeds_the_fused_embedding_lookup():
    """MovieLens genres (a "|" sequence) -> hashed Ragged -> EmbeddingCollection bags with a mean combiner."""
    from deeprec.nn import EmbeddingCollection, EmbeddingFeature

    path = sample_path("movielens_sample.txt")
    batch = next(iter(CsvReader(path, schema_for(path), batch_size=4)))
    genres = ops.hash_ragged(batch["genres"], 50)
    coll = EmbeddingCollection([EmbeddingFeature("genres", 50, combiner="mean")], 3)
    pooled = coll({"genres": genres})[:, 0]  # [B, D]
    first = genres.values[: int(genres.offsets[1])]
    expected = coll.lookup.weight[first].mean(0)
    assert pooled.shape == (4, 3) and torch.allclose(pooled[0], expected)
