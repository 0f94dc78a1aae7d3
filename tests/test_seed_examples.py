"""The two code examples of shared/seeds/smart-stage.md, in deeprec's API."""
import pyarrow.csv as pacsv
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deeprec as dr
from deeprec import ops


@pytest.fixture
def test_data_csv(tmp_path):
    path = tmp_path / "test_data.csv"
    path.write_text("".join(f"a{i},b{i}\n" for i in range(10)))
    return str(path)


def text_line_dataset(path, batch_size):
    """TextLineDataset(path).batch(2).map(decode_csv) with two string columns."""
    table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=["c0", "c1"]),
                           convert_options=pacsv.ConvertOptions(column_types={"c0": "binary", "c1": "binary"}))
    for start in range(0, table.num_rows, batch_size):
        part = table.slice(start, batch_size)
        yield {"c0": dr.Ragged.from_arrow(part.column("c0")), "c1": dr.Ragged.from_arrow(part.column("c1"))}


@dr.op
def append_string(col, value: str):
    """tf.concat([xx[1], ['xxx']], axis=0)"""
    return dr.Ragged.cat([col, dr.Ragged.from_strings([value])])


@dr.op
def as_string_concat(embedded: torch.Tensor, strings):
    """tf.concat([tf.as_string(xx[0]), [xx[1], xx[1]]], 0)"""
    as_string = [[f"{v:.6f}".encode() for v in row] for row in embedded.tolist()]
    return as_string + [strings.tolist()[: len(as_string[0])]] * 2


class AutoExample(nn.Module):
    def __init__(self):
        super().__init__()
        self.var = nn.Parameter(torch.ones(100, 3))  # tf.get_variable("var", [100, 3], ones)

    def forward(self, xx):
        x0 = ops.string_to_hash_bucket(xx["c0"], 10)
        x0 = F.embedding(x0, self.var)
        x1 = append_string(xx["c1"], "xxx")
        return dr.mark_target_node(as_string_concat(x0, x1))


def test_auto_smart_stage_example(test_data_csv):
    fast = dr.optimize(AutoExample(), dr.Config(smart_stage=True,
                                               smart_stage_options=dr.SmartStageOptions(capacity=1, num_threads=1)))
    part = fast.partition
    # the hash and the string concat are data-side and run ahead; the lookup reads `var`
    assert {"string_to_hash_bucket", "append_string"} <= set(part.stage_nodes)
    assert {"embedding", "as_string_concat", "mark_target_node"} <= set(part.main_nodes)
    assert part.kept["embedding"] == "depends on parameter/buffer var"
    results = list(fast.iterate(text_line_dataset(test_data_csv, 2)))
    expected = [AutoExample()(b) for b in text_line_dataset(test_data_csv, 2)]
    assert len(results) == 5  # the seed runs 5 steps over 10 rows, batch 2
    for got, want in zip(results, expected, strict=True):
        assert len(got) == 4 and len(got[0]) == 3 and got == want
    assert results[0][0][0] == b"1.000000" and results[0][2][0] == b"b0"


class ManualExample(nn.Module):
    def __init__(self):
        super().__init__()
        self.var = nn.Parameter(torch.ones(100, 3))

    def forward(self, batch):
        v0, v1 = dr.staged(batch["c0"], batch["c1"])  # xx = tf.staged([v0, v1])
        x0 = F.embedding(ops.string_to_hash_bucket(v0, 10), self.var)
        x1 = append_string(v1, "xxx")
        return dr.mark_target_node(as_string_concat(x0, x1))


def test_existing_stage_is_extended_by_smart_stage(test_data_csv):
    manual_only = dr.optimize(ManualExample(), dr.Config(smart_stage=False))
    assert set(manual_only.partition.stage_nodes) == {"getitem", "getitem_1", "staged"}
    smart = dr.optimize(ManualExample(), dr.Config(smart_stage=True))
    assert {"staged", "string_to_hash_bucket", "append_string"} <= set(smart.partition.stage_nodes)
    assert "embedding" in smart.partition.main_nodes
    want = [ManualExample()(b) for b in text_line_dataset(test_data_csv, 2)]
    with dr.make_prefetch_hook(smart, text_line_dataset(test_data_csv, 2)) as batches:
        got = [smart(staged) for staged in batches]
    assert len(got) == 5 and got == want
