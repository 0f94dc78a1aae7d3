"""Readers yielding raw batches, and the synthetic Criteo generator."""
from deeprec.data.criteo import CRITEO_COLUMNS, DENSE, LABEL, SPARSE, CriteoReader, detect_layout
from deeprec.data.parquet import ParquetReader, write_parquet
from deeprec.data.reader import BatchReader, ColumnSpec, ReaderStats
from deeprec.data.synth import KAGGLE_CARDINALITIES, SMALL_CARDINALITIES, write_synthetic


def open_reader(paths, batch_size: int, **kwargs) -> BatchReader:
    """`ParquetReader` for .parquet files, `CriteoReader` otherwise."""
    from deeprec.data.reader import resolve_paths

    files = resolve_paths(paths)
    if all(f.endswith((".parquet", ".pq")) for f in files):
        return ParquetReader(files, batch_size, **kwargs)
    return CriteoReader(files, batch_size, **kwargs)


__all__ = ["BatchReader", "ColumnSpec", "CriteoReader", "ParquetReader", "ReaderStats",
           "CRITEO_COLUMNS", "LABEL", "DENSE", "SPARSE", "KAGGLE_CARDINALITIES",
           "SMALL_CARDINALITIES", "detect_layout", "open_reader", "write_parquet", "write_synthetic"]
