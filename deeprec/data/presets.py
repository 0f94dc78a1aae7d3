"""Schemas of the public datasets (and of deeprec's synthetic data), and picking one for a file.

    criteo     label, I1..I13 dense, C1..C26 categorical (TSV without header, or CSV with one)
    avazu      click; hour, C1, banner_pos, site_*, app_*, device_*, C14..C21 categorical (CSV)
    movielens  rating -> label (>= 4), user/movie/profile categorical, genres a "|" sequence (CSV)
    byterec    finish and like (two labels), ids categorical, duration_time dense (TSV, no header)
    behavior   click and like; user, item, category; hist_items / hist_cats "|" sequences
               (what `deeprec data synth --kind behavior` writes: DIN, DIEN, DSSM, MMoE)
"""
from __future__ import annotations

from deeprec.data.criteo import CRITEO_SCHEMA
from deeprec.data.schema import Column, Schema
from deeprec.errors import DataError

AVAZU_CATEGORICAL = ("hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
                     "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
                     "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")
AVAZU_SCHEMA = Schema((Column("id", "ignore"), Column("click", "label"),
                       *(Column(c, "categorical") for c in AVAZU_CATEGORICAL)), name="avazu")

MOVIELENS_SCHEMA = Schema((
    Column("user_id", "categorical", role="user"), Column("movie_id", "categorical", role="item"),
    Column("rating", "label", positive_at=4.0), Column("timestamp", "ignore"), Column("title", "ignore"),
    Column("genres", "sequence", separator="|", max_length=6, role="item"),
    Column("gender", "categorical", role="user"), Column("age", "categorical", role="user"),
    Column("occupation", "categorical", role="user"), Column("zip", "categorical", role="user")), name="movielens")

BYTEREC_SCHEMA = Schema((
    Column("uid", "categorical", role="user"), Column("user_city", "categorical", role="user"),
    Column("item_id", "categorical", role="item"), Column("author_id", "categorical", role="item"),
    Column("item_city", "categorical", role="item"), Column("channel", "categorical", role="item"),
    Column("finish", "label"), Column("like", "label"), Column("music_id", "categorical", role="item"),
    Column("device", "categorical", role="user"), Column("time", "ignore"),
    Column("duration_time", "dense", role="item")), delimiter="\t", header=False, name="byterec")

BEHAVIOR_SCHEMA = Schema((
    Column("click", "label"), Column("like", "label"),
    Column("user_id", "categorical", dtype="int", role="user"),
    Column("item_id", "categorical", dtype="int", role="item"),
    Column("category_id", "categorical", dtype="int", role="item"),
    Column("hist_items", "sequence", dtype="int", max_length=50, role="user", embed_with="item_id"),
    Column("hist_cats", "sequence", dtype="int", max_length=50, role="user", embed_with="category_id")),
    delimiter="\t", name="behavior")

PRESETS = {"criteo": CRITEO_SCHEMA, "avazu": AVAZU_SCHEMA, "movielens": MOVIELENS_SCHEMA,
           "byterec": BYTEREC_SCHEMA, "behavior": BEHAVIOR_SCHEMA}


def _first_line(path: str) -> str:
    from deeprec.data import fs  # a URL or a compressed file too

    return fs.first_line(path).decode("utf-8", errors="replace").rstrip("\r\n").removeprefix("\ufeff")  # a BOM


def detect_preset(path: str) -> str:
    """The preset whose header (or headerless field count and delimiter) the file matches."""
    line = _first_line(path)
    delimiter = "\t" if "\t" in line else ","
    fields = [f.strip().strip('"') for f in line.split(delimiter)]
    for name, schema in PRESETS.items():
        if schema.delimiter not in ("auto", delimiter):
            continue
        if schema.header is not False and set(schema.names) <= set(fields):
            return name
        if schema.header is not True and len(fields) == len(schema.file_names) \
                and not any(f in schema.file_names for f in fields):
            return name
    # a header naming some of a preset's columns: that preset (its reader names what is missing)
    fields = {f.strip().strip('"') for f in line.replace("\t", ",").split(",")}
    overlap = {name: len(fields & set(schema.names)) for name, schema in PRESETS.items()}
    best = max(overlap, key=overlap.get)
    if overlap[best]:
        return best
    raise DataError(f"no schema preset matches this file (presets: {', '.join(PRESETS)}); "
                    "describe its columns in a schema file and pass --schema FILE", path, 1)


def schema_for(path: str, name: str | None = None) -> Schema:
    if name is None:
        name = detect_preset(path)
    if name not in PRESETS:
        raise DataError(f"unknown schema preset {name!r}; presets: {', '.join(PRESETS)}", path)
    return PRESETS[name]
