"""Criteo click logs: a preset of `CsvReader`.

The Kaggle/Terabyte files are TSV without a header (label, I1..I13, C1..C26);
CSV with a header in any column order is read too (the layout is detected per file).
"""
from __future__ import annotations

from deeprec.data.csv import CHUNK_BYTES, CsvReader, FileLayout
from deeprec.data.csv import detect_layout as _detect_layout
from deeprec.data.schema import Column, Schema

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
CRITEO_SCHEMA = Schema((Column(LABEL, "label"), *(Column(c, "dense") for c in DENSE),
                        *(Column(c, "categorical") for c in SPARSE)), delimiter="auto", header="auto", name="Criteo")


def detect_layout(path: str) -> FileLayout:
    return _detect_layout(path, CRITEO_SCHEMA)


class CriteoReader(CsvReader):
    """Streaming reader of Criteo click logs; yields raw batches.

    A batch is a dict: ``label`` float32 [B], ``I1``..``I13`` float32 [B]
    (NaN = missing), ``C1``..``C26`` string columns: ``deeprec.Ragged`` of
    raw bytes (b"" = missing). Deterministic for a given seed; every valid row appears
    exactly once per epoch over all shards.
    """

    def __init__(self, paths, batch_size: int, *, chunk_bytes: int = CHUNK_BYTES, **kwargs):
        super().__init__(paths, CRITEO_SCHEMA, batch_size, chunk_bytes=chunk_bytes, **kwargs)


__all__ = ["CRITEO_SCHEMA", "CriteoReader", "DENSE", "LABEL", "SPARSE", "detect_layout"]
