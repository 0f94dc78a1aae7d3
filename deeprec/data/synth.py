"""Synthetic Criteo-layout click logs with a planted ground-truth click model.

Rows are generated in chunks (constant memory) and written as headerless TSV:
label, I1..I13 (non-negative counts, some missing), C1..C26 (8 hex digits,
some missing). Categorical ids are Zipf-distributed over the real
Criteo-Kaggle cardinalities (or small ones). The click probability is

    sigmoid(bias + sum_f strength_f * effect_f(id) + sum_d slope_d * log1p(I_d))

where effect_f(id) is a fixed pseudo-random value of unit variance, so a model
that learns per-id embeddings can recover it and reach an AUC well above 0.5.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from deeprec.data.criteo import DENSE, SPARSE
from deeprec.errors import check_choice
from deeprec.progress import progress as show_progress

# Distinct values of C1..C26 in the Criteo Kaggle display-advertising data.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                        8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18,
                        15, 286181, 105, 142572)
SMALL_CARDINALITIES = tuple(min(c, 1000) for c in KAGGLE_CARDINALITIES)
CARDINALITIES = {"kaggle": KAGGLE_CARDINALITIES, "small": SMALL_CARDINALITIES}

ZIPF_EXPONENT = 1.2
BIAS = -1.9
# Every third feature carries signal; the rest are noise a model must learn to ignore.
STRENGTH = np.array([0.7 if f % 3 == 0 else 0.0 for f in range(26)])
DENSE_SLOPE = np.array([0.35, 0.0, -0.25, 0.0, 0.0, 0.2] + [0.0] * 7)
DENSE_MISSING = np.array([0.45, 0.0, 0.2, 0.2, 0.03, 0.2, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2])
SPARSE_MISSING = np.array([0.0] * 18 + [0.4] * 8)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def id_effect(feature: int, rank: np.ndarray) -> np.ndarray:
    """Planted per-id effect, uniform with unit variance, fixed by (feature, rank)."""
    h = _splitmix64(rank.astype(np.uint64) * np.uint64(1000003) + np.uint64(feature))
    unit = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (unit - 0.5) * np.sqrt(12.0)


def zipf_ranks(rng: np.random.Generator, n: int, cardinality: int, exponent: float = ZIPF_EXPONENT) -> np.ndarray:
    """Ranks in [0, cardinality), P(rank) ~ (rank+1)^-s (continuous inverse CDF)."""
    if cardinality == 1:
        return np.zeros(n, dtype=np.int64)
    a = 1.0 - exponent
    u = rng.random(n)
    x = ((float(cardinality + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return np.clip(x.astype(np.int64) - 1, 0, cardinality - 1)


def hex_ids(feature: int, rank: np.ndarray) -> np.ndarray:
    """Bijective scramble of rank to a 32-bit id, as 8 lowercase hex digits (dtype S8)."""
    x = (rank.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(feature * 0x85EBCA77)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    nibbles = (x[:, None] >> _SHIFTS[None, :]) & np.uint64(0xF)
    return np.ascontiguousarray(_HEX[nibbles.astype(np.intp)]).view("S8").reshape(-1)


def generate_chunk(rng: np.random.Generator, n: int, cardinalities,
                   exponent: float = ZIPF_EXPONENT) -> tuple[pa.Table, np.ndarray]:
    """One chunk of rows and the true click probabilities."""
    logit = np.full(n, BIAS)
    columns = {}
    for d, name in enumerate(DENSE):
        values = np.floor(np.exp(rng.normal(1.0 + 0.3 * d, 1.3, n))).astype(np.int64)
        logit += DENSE_SLOPE[d] * (np.log1p(values) - (1.0 + 0.3 * d))
        missing = rng.random(n) < DENSE_MISSING[d]
        columns[name] = pa.array(values, mask=missing)
    for f, name in enumerate(SPARSE):
        rank = zipf_ranks(rng, n, cardinalities[f], exponent)
        missing = rng.random(n) < SPARSE_MISSING[f]
        if STRENGTH[f]:
            logit += np.where(missing, 0.0, STRENGTH[f] * id_effect(f, rank))
        columns[name] = pa.array(hex_ids(f, rank), type=pa.binary(), mask=missing)
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(n) < prob).astype(np.int8)
    return pa.table({"label": label, **columns}), prob


def write_synthetic(path: str, rows: int, *, cardinalities: str | tuple = "kaggle", seed: int = 0,
                    chunk_rows: int = 100_000, zipf_exponent: float = ZIPF_EXPONENT, progress=None) -> dict:
    """Write `rows` rows of Criteo-layout TSV to `path`; returns a summary. `cardinalities`:
    a preset name or 26 ints (the distinct ids of C1..C26). `progress`: rows written of `rows`
    on a terminal (None or True: deeprec.progress's shared console, False: never, or a rich Console)."""
    if isinstance(cardinalities, str):
        check_choice("cardinalities", cardinalities, tuple(CARDINALITIES))
        cards = CARDINALITIES[cardinalities]
    elif len(cardinalities) != len(SPARSE) or min(cardinalities) < 1:
        raise ValueError(f"cardinalities must name a preset or give {len(SPARSE)} ints >= 1")
    else:
        cards = tuple(int(c) for c in cardinalities)
    rng = np.random.default_rng(seed)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    clicks = 0
    prob_sum = 0.0
    with pa.OSFile(path, "wb") as sink, show_progress("synth", total=rows, console=progress) as shown:
        written = 0
        while written < rows:
            n = min(chunk_rows, rows - written)
            table, prob = generate_chunk(rng, n, cards, zipf_exponent)
            pacsv.write_csv(table, sink, write_options=options)
            clicks += int(np.asarray(table.column("label")).sum())
            prob_sum += float(prob.sum())
            written += n
            shown.advance(n)
    return {"path": path, "rows": rows, "click_rate": clicks / max(rows, 1),
            "cardinalities": cardinalities, "seed": seed}
