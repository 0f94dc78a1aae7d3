"""Readers yielding raw batches, dataset schemas and presets, and the synthetic generators."""
import os

from deeprec.data.collate import collate
from deeprec.data.criteo import CRITEO_SCHEMA, DENSE, LABEL, SPARSE, CriteoReader, detect_layout
from deeprec.data.csv import CsvReader
from deeprec.data.orc import OrcReader, write_orc
from deeprec.data.parquet import ParquetReader, write_parquet
from deeprec.data.presets import PRESETS, detect_preset, schema_for
from deeprec.data.reader import BatchReader, ReaderStats
from deeprec.data.schema import Column, Schema, load_schema, schema_from_dict, schema_to_dict
from deeprec.data.synth import KAGGLE_CARDINALITIES, SMALL_CARDINALITIES, write_synthetic
from deeprec.data.synth_behavior import write_behavior
from deeprec.data.tables import file_format
from deeprec.errors import ConfigError


def resolve_schema(paths, schema=None) -> Schema:
    """A Schema, a preset name, a TOML path, or None (the preset the first file matches)."""
    from deeprec.data.reader import resolve_paths

    if isinstance(schema, Schema):
        return schema
    if isinstance(schema, dict):
        return schema_from_dict(schema)
    if isinstance(schema, str) and (schema.endswith(".toml") or os.sep in schema or os.path.exists(schema)):
        return load_schema(schema)  # a file: named by --schema when it is missing or no file
    if isinstance(schema, str) and schema not in PRESETS:
        raise ConfigError(f"--schema {schema!r} is neither a preset ({', '.join(PRESETS)}) nor a TOML schema file")
    files = resolve_paths(paths)
    if file_format(files[0]) != "text":  # resolve_paths has refused a mix of formats
        return PRESETS[schema or "criteo"]
    return schema_for(files[0], schema)


def open_reader(paths, batch_size: int, schema=None, **kwargs) -> BatchReader:
    """`ParquetReader` for .parquet files, `OrcReader` for ORC, `CsvReader` otherwise, with `schema`
    (a Schema, preset name or TOML file; None: the preset the file matches)."""
    from deeprec.data.reader import resolve_paths

    files = resolve_paths(paths)
    schema = resolve_schema(files, schema)
    kind = file_format(files[0])  # by extension, else magic bytes (Hive's 000000_0); one kind for all files
    if kind == "parquet":
        return ParquetReader(files, batch_size, columns=schema, **kwargs)
    if kind == "orc":
        return OrcReader(files, batch_size, columns=schema, **kwargs)
    return CsvReader(files, schema, batch_size, **kwargs)


__all__ = ["collate", "BatchReader", "CriteoReader", "CsvReader", "ParquetReader", "OrcReader", "write_orc", "ReaderStats", "Column",
           "Schema", "CRITEO_SCHEMA", "PRESETS", "detect_preset", "schema_for", "load_schema", "schema_from_dict",
           "schema_to_dict", "resolve_schema", "write_behavior", "file_format",
           "LABEL", "DENSE", "SPARSE", "KAGGLE_CARDINALITIES",
           "SMALL_CARDINALITIES", "detect_layout", "open_reader", "write_parquet", "write_synthetic"]
