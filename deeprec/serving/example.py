"""A made-up batch of a schema's columns: what an export traces with and what a compiled package is
checked on (serving.export, serving.check_package)."""
from __future__ import annotations

import pyarrow as pa

from deeprec.data.schema import Schema


def example_batch(schema: Schema, rows: int = 5) -> dict:
    """A raw batch of `rows` made-up rows: uneven strings and sequences, a missing value, so the
    traced program keeps every size symbolic."""
    columns = {}
    for c in schema.columns:
        if c.kind == "ignore":
            continue
        if c.kind in ("label", "dense", "weight"):
            values = [float(i % 2) if c.kind == "label" else (None if i == 1 else float(i) + 0.5) for i in range(rows)]
            columns[c.name] = pa.array(values, pa.float32())
        elif c.kind == "categorical" and c.dtype == "int":
            columns[c.name] = pa.array([None if i == 1 else i * 7 for i in range(rows)], pa.int64())
        elif c.kind == "categorical":
            columns[c.name] = pa.array([b"" if i == 1 else b"v" * (i + 1) for i in range(rows)], pa.binary())
        else:  # sequence: lengths 0, 1, 2, ... (its separator; string or int items)
            items = [[str(3 * i + j + 1) for j in range(i)] for i in range(rows)]
            columns[c.name] = pa.array([c.separator.join(row) for row in items], pa.string())
    return schema.to_batch(pa.table(columns))
