"""Serving inputs mean what they mean in training (issue #25): every row of each bundled sample, sent as
the file holds it, scores as `deeprec evaluate` scores it; "" == null == an absent column == the reader's
fill; "3" == 3; a value the reader refuses is a 400 naming field and row in the reader's words."""
import csv
import inspect

import numpy as np
import pytest
import torch

import deeprec as dr
from deeprec.cli import main, sample_path
from deeprec.data import open_reader
from deeprec.data.csv import CsvReader, detect_layout
from deeprec.data.schema import Column, Schema
from deeprec.errors import DeepRecError
from deeprec.ragged import Ragged
from deeprec.serving import RequestError
from deeprec.serving.request import request_batch
from deeprec.trainer import TrainConfig, Trainer

# sample -> (model, embedding): each preset's model, EmbeddingVariables on one
SAMPLES = {"criteo_sample.txt": ("dlrm", "variable"), "avazu_sample.txt": ("deepfm", "table"),
           "movielens_sample.txt": ("din", None), "byterec_sample.txt": ("mmoe", None)}


def _file_columns(path: str, schema) -> dict:
    """Every column of the file as it holds it: text, "" where empty (csv module, the file's delimiter)."""
    layout = detect_layout(path, schema)
    tsv = layout.delimiter == "\t"  # the reader reads TSV unquoted
    with open(path, newline="") as f:
        f.seek(layout.data_start)
        rows = list(csv.reader(f, delimiter=layout.delimiter, quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL))
    return {name: [r[k] for r in rows] for k, name in enumerate(layout.names)}


def _export(model, folder) -> str:
    kw = {"compile": False} if "compile" in inspect.signature(dr.export).parameters else {}  # the traced program
    return dr.export(model, str(folder), schema=model.schema, step=3, **kw)


@pytest.fixture(scope="module", params=sorted(SAMPLES))
def trained(request, tmp_path_factory):
    """A model trained 3 steps on a sample (its checkpoint), and its export."""
    tmp = tmp_path_factory.mktemp(request.param.split("_")[0])
    data = sample_path(request.param)
    model, embedding = SAMPLES[request.param]
    kw = {"embedding": embedding} if embedding else {}
    trainer = Trainer(TrainConfig.create(model=model, data=[data], steps=3, batch_size=64, progress=False,
                                         checkpoint_dir=str(tmp / "ckpt"), **kw))
    trainer.train()
    return data, trainer.schema, str(tmp / "ckpt"), _export(trainer.model, tmp / "export"), tmp


def _equal(a, b) -> bool:
    """Two raw-batch columns hold the same values (NaN equal to NaN)."""
    if isinstance(a, Ragged) or isinstance(b, Ragged):
        return isinstance(a, Ragged) and isinstance(b, Ragged) and a.tolist() == b.tolist()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


@pytest.mark.slow
def test_every_sample_row_sent_as_the_file_holds_it_scores_as_evaluate(trained):
    data, schema, ckpt, export, tmp = trained
    columns = _file_columns(data, schema)
    served = dr.serving.load(export)
    reader_batch = next(iter(open_reader([data], 10 ** 6, schema=schema)))  # the whole file: one batch
    request = served.batch(columns)
    for name in reader_batch:  # the request's raw batch is the reader's, column by column
        assert _equal(request[name], reader_batch[name]), name
    predictions = tmp / "predictions.csv"
    assert main(["evaluate", "--checkpoint", ckpt, "--data", data, "--predictions", str(predictions)]) == 0
    labels = list(served.labels)
    lines = predictions.read_text().splitlines()
    if len(labels) > 1:  # a multi-task model: a CSV whose header names the labels
        assert lines[0] == ",".join(labels)
        lines = lines[1:]
    table = np.array([[float(x) for x in line.split(",")] for line in lines], np.float32)
    want = torch.from_numpy(table[:, 0] if len(labels) == 1 else table)
    assert len(lines) == len(next(iter(columns.values())))
    scores = served(columns)
    assert torch.equal(scores, served(reader_batch))  # the program scores the request as the reader's batch
    # evaluate runs the checkpoint's eager model, serving its exported program on the same 1-batch file:
    # equal up to float rounding (the program may order a sum otherwise: a few 1e-8 seen here)
    torch.testing.assert_close(scores, want, rtol=0, atol=1e-6)
    # in requests of 7 rows the batches differ (a matmul's blocking may too): within 1e-6 as well
    parts = [served({k: v[i:i + 7] for k, v in columns.items()}) for i in range(0, len(lines), 7)]
    torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_missing_is_null_is_empty_is_absent_and_numbers_may_be_text(trained):
    data, schema, _, export, _ = trained
    served = dr.serving.load(export)
    columns = {k: v[:20] for k, v in _file_columns(data, schema).items()}
    want = served(columns)
    for c in schema.columns:
        if c.kind in ("label", "ignore"):
            continue
        values = columns[c.name]
        empty = {**columns, c.name: [""] * 20}
        nulls = {**columns, c.name: [None] * 20}
        absent = {k: v for k, v in columns.items() if k != c.name}
        assert torch.equal(served(empty), served(nulls)) and torch.equal(served(empty), served(absent)), c.name
        if c.kind == "dense":  # JSON numbers (null where empty), and a numpy array, score as the text
            numbers = [float(v) if v else None for v in values]
            assert torch.equal(served({**columns, c.name: numbers}), want), c.name
            array = np.array([float(v) if v else np.nan for v in values])
            assert torch.equal(served({**columns, c.name: array}), want), c.name
        elif c.kind == "categorical":  # an object array of the strings, as a KServe BYTES tensor
            assert torch.equal(served({**columns, c.name: np.array(values, dtype=object)}), want), c.name
            if all(v.lstrip("-").isdigit() and str(int(v)) == v for v in values):  # ids as JSON numbers
                assert torch.equal(served({**columns, c.name: [int(v) for v in values]}), want), c.name
        elif c.kind == "sequence":  # lists of ids score as the joined text
            lists = [v.split(c.separator) if v else [] for v in values]
            assert torch.equal(served({**columns, c.name: lists}), want), c.name


def test_evaluate_predictions_refuses_what_it_could_not_write_before_reading(tmp_path, capsys):
    base = ["evaluate", "--checkpoint", str(tmp_path), "--data", sample_path("criteo_sample.txt")]  # no checkpoint
    for where, why in (([str(tmp_path / "p"), "--on-bad-row", "skip"], "would no longer match"),
                       ([str(tmp_path / "no" / "p")], "no folder"), ([str(tmp_path)], "a folder")):
        assert main(base + ["--predictions", *where]) == 2
        assert why in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


# -- the reader, value by value ----------------------------------------------------------------------

SCHEMA = Schema((Column("y", "label"), Column("x", "dense"), Column("k", "categorical", dtype="int"),
                 Column("s", "categorical"), Column("q", "sequence", dtype="int", max_length=3),
                 Column("t", "sequence", max_length=3), Column("w", "weight")), delimiter="\t", name="probe")
DEFAULTS = {"y": "1", "x": "1", "k": "1", "s": "a", "q": "1", "t": "a", "w": "1"}
NUMBERS = ["1", "1.5", " 7 ", "+3", "-2", ".5", "5.", "1e3", "1E+3", "nan", "NaN", "NA", "null", "NULL", "N/A",
           "#N/A", "", " ", "0x10", "1_000", "1,5", "3.4e38", "3.4e39", "1e-50", "0.1", "16777217", "abc", "1d",
           "inf", "-Infinity", "INF", "nAn", "-0", "007", "9223372036854775807", "9223372036854775808", "é"]
VALUES = {"x": NUMBERS, "k": NUMBERS, "w": NUMBERS,
          "s": ["a", "", "NA", "null", " x ", "17", "1.0", "é", "#N/A"],
          "q": ["1|2", "", "1||2", "|", "7", " 7", "1|x", "1|2|3|4|5", "x|9|1|2", "+3", "NA", "0x10"],
          "t": ["a|b", "", "a||b", "|", "a", " a | b ", "NA", "a|b|c|d|e", "é|1"]}


def _read(tmp_path, name: str, value: str):
    """The reader's raw batch of one row holding `value` in column `name`, or its error."""
    path = tmp_path / f"{name}.tsv"
    row = {**DEFAULTS, name: value}
    path.write_text("\t".join(SCHEMA.file_names) + "\n" + "\t".join(row[c] for c in SCHEMA.file_names) + "\n")
    try:
        return next(iter(CsvReader([str(path)], SCHEMA, batch_size=4)))
    except DeepRecError as err:
        return err


@pytest.mark.parametrize("name", sorted(VALUES))
def test_each_value_means_what_it_means_to_the_reader(tmp_path, name):
    """A value the reader reads is read the same; one it refuses is refused (sent as row 1 of 2: the
    error names that row), a number it cannot parse in its words."""
    for value in VALUES[name]:
        got = _read(tmp_path, name, value)
        if isinstance(got, Exception):
            rows = {c: [v, value if c == name else v] for c, v in DEFAULTS.items()}
            with pytest.raises(RequestError) as err:
                request_batch(SCHEMA, rows, "$.inputs")
            assert err.value.path == f"$.inputs.{name}[1]", (value, str(err.value))
            if "is not a" in getattr(got, "reason", ""):  # "column x: 'abc' is not a number"
                assert got.reason.split(": ", 1)[1] in err.value.reason, (value, got.reason, err.value.reason)
            continue
        batch = request_batch(SCHEMA, {c: [value if c == name else v] for c, v in DEFAULTS.items()})
        assert all(_equal(batch[c], got[c]) for c in got), (name, value, batch, got)


def test_json_values_mean_what_their_text_means():
    """3 == "3" == " 3", null == "" == "NA" == absent, an int id 17 == 17.0 == "17", a list of ids == their
    text; numpy arrays as lists."""
    def batch(**columns):
        return request_batch(SCHEMA, {"y": [1, 1], **columns})

    same = [({"x": [3, None]}, {"x": ["3", ""]}, {"x": [" 3", "NA"]}, {"x": np.array([3.0, np.nan])}),
            ({"k": [17, None]}, {"k": ["17", ""]}, {"k": [17.0, "null"]}, {"k": np.array([17, -1])}),
            ({"s": ["17", None]}, {"s": [17, ""]}, {"s": np.array(["17", ""])}, {"s": np.array([b"17", b""])}),
            ({"q": [[1, 2], None]}, {"q": ["1|2", ""]}, {"q": [["1", "2"], []]}),
            ({"t": [["a", "b"], None]}, {"t": ["a|b", ""]}, {"t": np.array(["a|b", ""])}),
            ({"w": [None, None]}, {"w": ["", ""]}, {"w": [1, 1]}), ({"x": [None, None]}, {})]
    for group in same:
        first = batch(**group[0])
        for other in group[1:]:
            got = batch(**other)
            assert all(_equal(got[c], first[c]) for c in first), (group[0], other)


def test_a_bad_value_names_its_field_and_row():
    rows = {"x": [1, 2, "x", "y"], "k": [1, 2, 3, 4]}
    with pytest.raises(RequestError, match=r"^\$\.inputs\.x\[2\]: field 'x': 'x' is not a number"):
        request_batch(SCHEMA, rows, "$.inputs")
    for value, why in ((2.5, "2.5 is not an integer"), ("2.5", "'2.5' is not an integer"),
                       (2 ** 63, "is not an integer"), ({"id": 1}, "got an object")):
        with pytest.raises(RequestError, match=r"^\$\.k\[3\]: field 'k'") as err:
            request_batch(SCHEMA, {"k": [1, "2", None, value]})
        assert why in err.value.reason
    for value, why in (("inf", 'got "inf"'), (1e39, "beyond float32"), ("-1e39", "beyond float32"),
                       ([1.0], "got an array")):
        with pytest.raises(RequestError, match=r"^\$\.x\[1\]: field 'x': expected a finite number") as err:
            request_batch(SCHEMA, {"x": ["1", value]})
        assert why in err.value.reason
    with pytest.raises(RequestError, match=r"^\$\.x: field 'x': must be a list .* got a 2-D array"):
        request_batch(SCHEMA, {"x": np.zeros((2, 1))})
    with pytest.raises(RequestError, match=r"^\$\.s\[1\]: field 's'"):  # a lone surrogate
        request_batch(SCHEMA, {"s": ["a", "\ud800"]})


def test_requests_merged_convert_as_each_alone_stacked():
    """The server converts a batch's requests once (merge_columns): every value means what it means in its
    own request, a column one request left out is missing in its rows, arrays of one dtype join."""
    from deeprec.data.collate import collate
    from deeprec.serving.request import convert_columns, merge_columns, request_rows

    requests = [{"x": [3, None], "k": ["17", ""], "s": ["a", None], "q": [[1, 2], None], "t": ["a|b", ""]},
                {"x": ["1e3"], "s": [7], "t": [["c"]]},
                {"x": [" 2.5", "NA", 4], "k": [1, 2, None], "q": ["3|4", "", [5]], "w": [2, 2, 2]}]
    checked = [(rows, request_rows(SCHEMA, rows)) for rows in requests]
    merged = merge_columns(checked)
    got = convert_columns(SCHEMA, merged, sum(n for _, n in checked))
    want = collate([request_batch(SCHEMA, rows) for rows in requests])
    assert set(got) == set(want) and all(_equal(got[c], want[c]) for c in want), \
        {c: (got[c], want[c]) for c in want if not _equal(got[c], want[c])}
    arrays = [({"x": np.array([1.0, np.nan], np.float32)}, 2), ({"x": np.array([2.0], np.float32)}, 1)]
    assert _equal(convert_columns(SCHEMA, merge_columns(arrays), 3)["x"], torch.tensor([1.0, float("nan"), 2.0]))
    assert merge_columns([({"x": np.array([1.0])}, 1), ({"x": [2.0]}, 1)]) is None  # a list beside an array
    assert merge_columns([({"x": np.array([1.0])}, 1), ({"x": np.array([2], np.int64)}, 1)]) is None
