"""ONNX Runtime as the peer of deeprec's in-process serving (issue 39), on the model bench/serving.py
exports (a DLRM with EmbeddingVariables), in the same run:

    the export's weights ──> PlainDLRM: the served DLRM in plain torch (Linear, ReLU, one embedding
        table, bmm), the frozen EmbeddingVariables stacked as one table (a zero row appended)
        ──checked: its scores and ONNX Runtime's equal the package's on the same rows (asserted)──>
    torch.onnx.export (dynamo, batch dimension dynamic) ──> onnxruntime.InferenceSession
        (1 intra-op thread, sequential: as the in-process measurement's 1 torch thread)

What each is given, at 1 and 256 rows, timed alternately (the same load for all three), medians:

    (a) onnxruntime   prepared inputs: dense [B, 13] float32 (NaN missing: filled and log-squashed in
                      the graph, as in deeprec's) and ids [B, 26] int64, already hashed and looked up in
                      the frozen indexes: row numbers in the stacked table. ONNX Runtime has no deeprec
                      hashing (siphash of strings, the EmbeddingVariables' sorted-key search), so that
                      work is done ahead, untimed
    (b) package       ServedModel(raw batch): the compiled AOTInductor package on a prepared raw batch
                      (strings hashed and searched inside the program)
    (c) columns       ServedModel(columns): JSON-like columns, what `dr.serving.load` answers a client

Targets (issue 39): (c) at 1 row <= 3x (a) at 1 row; (c) at 256 rows <= 1.2x (a) at 256 rows.
(b)/(a) is shown beside them: the model's own cost against ONNX Runtime's, without the conversion.

    python bench/serving.py --peer-only     # the in-process measurement and this peer, no HTTP servers
"""
from __future__ import annotations

import importlib
import math
import os
import time

import numpy as np
import torch
from torch import nn

ROWS = (1, 256)
TARGETS = {"columns_1_row_x_onnxruntime": 3.0, "columns_256_rows_x_onnxruntime": 1.2}
LABEL = "ONNX Runtime, ids pre-hashed (int64 row indices)"
INSTALL = "pip install onnxruntime onnx onnxscript (they are in the bench extra: pip install -e '.[bench]')"
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # probabilities: fp32 sums in another order (ORT's GEMMs, the package's)
_VARIABLES = "embeddings.collection.lookup.variables"  # the frozen EmbeddingVariables in a DLRM export


def missing() -> str | None:
    """Why the peer cannot run here (a package not installed, and how to install it), or None."""
    for name in ("onnxruntime", "onnx", "onnxscript"):
        try:
            importlib.import_module(name)
        except ImportError:
            return f"{name} is not installed: {INSTALL}"
    return None


# -- the model, in plain torch --------------------------------------------------------------------

class PlainDLRM(nn.Module):
    """The served DLRM without deeprec: dense [B, N] float32 (NaN missing) and rows [B, C] int64
    (each categorical column's id as a row of `table`) -> probabilities [B]."""

    def __init__(self, bottom: nn.Sequential, top: nn.Sequential, table: torch.Tensor, columns: int):
        super().__init__()
        self.bottom, self.top = bottom, top
        self.table = nn.Embedding.from_pretrained(table, freeze=True)
        n = columns + 1  # the bottom MLP's vector first, then one per categorical column (DLRM's order)
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("pairs", rows * n + cols)

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = torch.log1p(torch.clamp_min(torch.nan_to_num(dense, nan=0.0), 0.0))  # fill_missing, log_normalize
        d = self.bottom(x)
        vectors = torch.cat([d.unsqueeze(1), self.table(rows)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return torch.sigmoid(self.top(torch.cat([d, dots], dim=1)).squeeze(1))


def _mlp(state: dict, prefix: str, relu_last: bool) -> nn.Sequential:
    """prefix.K.weight/bias (Linear layers at positions K of an MLP) as Linear + ReLU layers."""
    positions = sorted({int(k[len(prefix) + 1:].split(".")[0]) for k in state if k.startswith(prefix + ".")})
    layers: list[nn.Module] = []
    for i, k in enumerate(positions):
        if f"{prefix}.{k}.running_mean" in state:
            raise NotImplementedError(f"{prefix}.{k}: a BatchNorm layer (the peer holds Linear and ReLU only)")
        weight, bias = state[f"{prefix}.{k}.weight"], state[f"{prefix}.{k}.bias"]
        linear = nn.Linear(weight.shape[1], weight.shape[0])
        linear.weight.data.copy_(weight)
        linear.bias.data.copy_(bias)
        layers.append(linear)
        if relu_last or i < len(positions) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Indexer:
    """A raw batch -> the peer's inputs: the dense columns as [B, N] and each categorical column's key
    (siphash of a string, or the int id) looked up in its frozen index as a row of the stacked table:
    a hit its row, a key not in the index the row of the variable's missing value (what the frozen
    lookup reads), no id (a negative int id: an empty bag) the zero row. The hashing and searching
    deeprec's program does inside, done here ahead of ONNX Runtime."""

    def __init__(self, served):
        schema = served.schema
        self.dense, self.categorical = schema.of_kind("dense"), schema.of_kind("categorical")
        self.strings = [n for n in self.categorical if schema[n].dtype == "string"]
        if schema.of_kind("sequence") or any(schema[n].embed_with for n in self.categorical):
            raise NotImplementedError("the peer takes a DLRM over dense and categorical columns, one table each")
        # the collection's tables in its features' order: the categorical columns' (checked by `check`)
        frozen = [served.module.get_submodule(f"{_VARIABLES}.{t}") for t in range(len(self.categorical))]
        self.sorted_keys = [f.sorted_keys for f in frozen]
        values = [f.values for f in frozen]
        sentinel = torch.iinfo(torch.int64).max
        self.real = [int((k != sentinel).sum()) for k in self.sorted_keys]  # a sentinel's row: the missing value
        self.offsets = [0]
        for v in values:
            self.offsets.append(self.offsets[-1] + v.shape[0])
        self.zero_row = self.offsets[-1]
        self.table = torch.cat([*values, values[0].new_zeros(1, values[0].shape[1])])

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        from deeprec import ops
        from deeprec.ragged import Ragged

        dense = torch.stack([batch[n].float() for n in self.dense], dim=1)
        hashed = {}
        if self.strings:  # one native call hashes every string column, as the program does
            hashed = dict(zip(self.strings, ops.string_to_hash_key([batch[n] for n in self.strings])))
        rows = []
        for t, name in enumerate(self.categorical):
            keys = hashed.get(name)
            if keys is None:
                keys = batch[name]
                if isinstance(keys, Ragged) or keys.dim() != 1:
                    raise NotImplementedError(f"{name}: one int id per row expected (multi-hot bags are not mapped)")
                keys = keys.long()
            if keys.shape[0] != dense.shape[0]:
                raise NotImplementedError(f"{name}: one id per row expected, got {keys.shape[0]} for {dense.shape[0]}")
            index = self.sorted_keys[t]
            position = torch.searchsorted(index, keys)
            hit = index[position.clamp_max(index.shape[0] - 1)] == keys
            row = torch.where(hit, position, torch.full_like(position, self.real[t])) + self.offsets[t]
            rows.append(torch.where(keys < 0, torch.full_like(row, self.zero_row), row))
        return dense.contiguous(), torch.stack(rows, dim=1).contiguous()


def plain_dlrm(served) -> tuple[PlainDLRM, Indexer]:
    """The export's DLRM as a PlainDLRM (its weights: the MLPs', the frozen tables stacked) and the
    Indexer that prepares its inputs. Only a DLRM export (EmbeddingVariables, dense + categorical)."""
    if served.manifest.get("model") != "dlrm":
        raise NotImplementedError(f"the peer is a DLRM; this export is a {served.manifest.get('model')!r}")
    state = served.module.state_dict()
    indexer = Indexer(served)
    model = PlainDLRM(_mlp(state, "bottom", relu_last=True), _mlp(state, "top", relu_last=False), indexer.table,
                      len(indexer.categorical)).eval()
    return model, indexer


# -- ONNX -----------------------------------------------------------------------------------------

def onnx_session(model: PlainDLRM, example: tuple[torch.Tensor, torch.Tensor], path: str, threads: int = 1):
    """`model` exported to ONNX at `path` (the batch dimension dynamic) and an InferenceSession on it:
    the CPU provider, `threads` intra-op threads, one inter-op, sequential execution."""
    import logging
    import warnings

    import onnxruntime as ort

    batch = torch.export.Dim("batch", min=1)
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)  # its registry's notes (torchvision's ops not installed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's notes on its own version and on dynamic shapes
            torch.onnx.export(model, example, path, dynamo=True, input_names=["dense", "rows"],
                              output_names=["probability"], dynamic_shapes=({0: batch}, {0: batch}), verbose=False)
    finally:
        log.setLevel(level)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def ort_scores(session, dense: torch.Tensor, rows: torch.Tensor) -> np.ndarray:
    return session.run(["probability"], {"dense": dense.numpy(), "rows": rows.numpy()})[0]


def check(served, model: PlainDLRM, indexer: Indexer, session, columns: dict) -> dict:
    """Assert that PlainDLRM and ONNX Runtime score `columns` as the export does (ServedModel on the
    same rows, to fp32 tolerance): a peer computing something else would be no peer. Returns the
    largest differences."""
    batch = served.batch(columns)
    want = served(batch)
    dense, rows = indexer(batch)
    with torch.no_grad():
        plain = model(dense, rows)
    ort = torch.from_numpy(ort_scores(session, dense, rows))
    torch.testing.assert_close(plain, want, **TOLERANCE, msg=lambda m: f"PlainDLRM differs from the export: {m}")
    torch.testing.assert_close(ort, want, **TOLERANCE, msg=lambda m: f"ONNX Runtime differs from the export: {m}")
    return {"rows": int(want.shape[0]), "tolerance": TOLERANCE,
            "max_abs_diff_plain_torch": float((plain - want).abs().max()),
            "max_abs_diff_onnxruntime": float((ort - want).abs().max())}


def check_rows(served, columns: dict) -> dict:
    """`columns` and 3 rows more: ids the tables have not seen (a key missing from the frozen index),
    ids left out (null), and dense values left out: every path of the lookup is checked."""
    out = {k: list(v) + [v[0], v[1], v[2]] for k, v in columns.items()}
    for c in served.schema.columns:
        if c.name not in out:
            continue
        if c.kind == "categorical":
            out[c.name][-3] = f"never-seen-{c.name}" if c.dtype == "string" else 987_654_321_987
            out[c.name][-2] = None
        elif c.kind == "dense":
            out[c.name][-1] = None
    return out


# -- timing ---------------------------------------------------------------------------------------

def alternating(calls: dict, n: int, warmup: int = 10, budget_s: float = math.inf) -> dict[str, list[float]]:
    """n timings of each of `calls` ({name: fn}), one of each in turn, the order rotated every round
    (each sees the same load, none always first); fewer rounds (at least 20) past budget_s."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    out, began = {name: [] for name in names}, time.perf_counter()
    for i in range(n):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            calls[name]()
            out[name].append(time.perf_counter() - start)
        if i + 1 >= 20 and time.perf_counter() - began > budget_s:
            break
    return out


def run(served, columns_of, requests: int, stats, folder: str, threads: int = 1) -> dict:
    """The peer section of bench/serving.py's results: the peer built and checked, then (a), (b), (c)
    at 1 and 256 rows, alternately, with `threads` torch and ONNX Runtime threads. `columns_of(n)`:
    n rows as JSON-like columns; `stats(seconds)`: latency_stats. {"skipped": why} without onnxruntime."""
    from _common import cpu_line

    why = missing()
    if why is not None:
        print(f"  ONNX Runtime peer skipped: {why}", flush=True)
        return {"skipped": why, "cpu": cpu_line()}
    import onnx
    import onnxruntime as ort

    if served.compiled is None:
        raise SystemExit(f"{served.path}: not scored by its compiled package: {served.compiled_reason}")
    torch.set_num_threads(threads)
    model, indexer = plain_dlrm(served)
    began = time.perf_counter()
    session = onnx_session(model, indexer(served.batch(columns_of(4))), os.path.join(folder, "dlrm.onnx"), threads)
    exported = time.perf_counter() - began
    checked = check(served, model, indexer, session, check_rows(served, columns_of(max(ROWS))))
    check(served, model, indexer, session, columns_of(1))  # 1 row: the package scores it twice, ORT once
    out = {"label": LABEL, "onnxruntime": ort.__version__, "onnx": onnx.__version__, "torch": torch.__version__,
           "cpu": cpu_line(), "threads": threads,
           "session": "CPUExecutionProvider, intra_op_num_threads=%d, inter_op_num_threads=1, ORT_SEQUENTIAL, "
                      "ORT_ENABLE_ALL" % threads,
           "what": {"onnxruntime": "session.run on prepared inputs: dense [B, 13] float32, ids [B, 26] int64 "
                                   "pre-hashed and looked up (row indices of one stacked table)",
                    "package": "ServedModel(raw batch): the compiled package on a prepared raw batch",
                    "columns": "ServedModel(columns): JSON-like columns through dr.serving.load's conversion"},
           "onnx_export_seconds": exported, "check": checked, "targets": TARGETS, "rows": {}}
    for n in ROWS:
        columns = columns_of(n)
        raw = served.batch(columns)
        dense, rows = (t.numpy() for t in indexer(raw))
        feeds = {"dense": dense, "rows": rows}
        calls = {"onnxruntime": lambda: session.run(["probability"], feeds), "package": lambda: served(raw),
                 "columns": lambda: served(columns)}
        count = requests if n < 256 else max(30, requests // 4)
        times = alternating(calls, count, budget_s=10.0)
        entry = {name: stats(t) for name, t in times.items()}
        base = entry["onnxruntime"]["p50_ms"]
        entry["package_x_onnxruntime"] = entry["package"]["p50_ms"] / base
        entry["columns_x_onnxruntime"] = entry["columns"]["p50_ms"] / base
        target = TARGETS["columns_1_row_x_onnxruntime" if n == 1 else "columns_256_rows_x_onnxruntime"]
        entry["target_columns_x_onnxruntime"] = target
        entry["met"] = entry["columns_x_onnxruntime"] <= target
        out["rows"][str(n)] = entry
        print(f"  {n:3} rows: onnxruntime p50 {base:.3f} ms, package {entry['package']['p50_ms']:.3f} ms "
              f"({entry['package_x_onnxruntime']:.2f}x), columns {entry['columns']['p50_ms']:.3f} ms "
              f"({entry['columns_x_onnxruntime']:.2f}x, target <= {target}x)", flush=True)
    out["verdicts"] = [{"target": f"in process, {n} row{'s' if n > 1 else ''}: served(columns) p50 <= "
                                  f"{out['rows'][str(n)]['target_columns_x_onnxruntime']}x ONNX Runtime's",
                        "value": out["rows"][str(n)]["columns_x_onnxruntime"], "met": out["rows"][str(n)]["met"]}
                       for n in ROWS]
    return out


# -- report ---------------------------------------------------------------------------------------

def print_table(peer: dict) -> None:
    from _common import print_table as table

    if "skipped" in peer:
        print(f"ONNX Runtime peer: skipped ({peer['skipped']})")
        return
    rows = []
    for n in ROWS:
        e = peer["rows"][str(n)]
        for name, what in (("onnxruntime", LABEL), ("package", "deeprec package, raw batch"),
                           ("columns", "deeprec dr.serving.load, JSON columns")):
            ratio = e[f"{name}_x_onnxruntime"] if name != "onnxruntime" else 1.0
            target, met = "", ""
            if name == "columns":
                target, met = f"<= {e['target_columns_x_onnxruntime']}x", "met" if e["met"] else "MISSED"
            rows.append([what, n, f"{e[name]['p50_ms']:.3f}", f"{e[name]['p99_ms']:.3f}",
                         f"{n / e[name]['p50_ms'] * 1e3:,.0f}", f"{ratio:.2f}x", target, met])
    table(f"peer: ONNX Runtime {peer['onnxruntime']} on the same DLRM, in process, {peer['threads']} thread, "
          f"timed alternately - {peer['cpu']}",
          ["load", "rows", "p50 ms", "p99 ms", "rows/s", "x ONNX Runtime", "target", ""], rows)
    c = peer["check"]
    print(f"peer checked on {c['rows']} rows: |ONNX Runtime - export| <= {c['max_abs_diff_onnxruntime']:.1e}, "
          f"|plain torch - export| <= {c['max_abs_diff_plain_torch']:.1e} (probabilities)")


def plot_panel(ax, peer: dict) -> None:
    """(a), (b), (c) p50 at 1 and 256 rows, the ratios written on the bars, the targets as red marks."""
    if "skipped" in peer:
        ax.text(0.5, 0.5, f"ONNX Runtime peer skipped:\n{peer['skipped']}", ha="center", va="center", fontsize=8,
                wrap=True, transform=ax.transAxes)
        ax.set_axis_off()
        return
    kinds = (("onnxruntime", "ONNX Runtime (ids pre-hashed)", "tab:green"),
             ("package", "deeprec package (raw batch)", "tab:blue"),
             ("columns", "dr.serving.load (JSON columns)", "tab:orange"))
    for k, (name, label, color) in enumerate(kinds):
        xs = [i + 0.27 * k for i in range(len(ROWS))]
        values = [peer["rows"][str(n)][name]["p50_ms"] for n in ROWS]
        ax.bar(xs, values, 0.27, color=color, label=label)
        if name != "onnxruntime":
            for x, n, v in zip(xs, ROWS, values):
                ax.text(x, v * 1.08, f"{peer['rows'][str(n)][f'{name}_x_onnxruntime']:.1f}x", ha="center",
                        fontsize=7)
    for i, n in enumerate(ROWS):
        e = peer["rows"][str(n)]
        x = i + 0.27 * 2
        ax.hlines(e["onnxruntime"]["p50_ms"] * e["target_columns_x_onnxruntime"], x - 0.14, x + 0.14,
                  color="tab:red", ls="--", lw=1.5, label="target for JSON columns" if i == 0 else None)
    ax.set_xticks([i + 0.27 for i in range(len(ROWS))], [f"{n} row{'s' if n > 1 else ''}" for n in ROWS])
    ax.set_yscale("log")
    low = min(peer["rows"][str(n)]["onnxruntime"]["p50_ms"] for n in ROWS)
    ax.set_ylim(low / 3, ax.get_ylim()[1] * 6)  # the shortest bar seen; room for the legend
    ax.set_ylabel("ms per call, p50")
    ax.set_title(f"peer: ONNX Runtime {peer['onnxruntime']}, {peer['threads']} thread, same DLRM", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def plot(peer: dict) -> None:
    """bench/results/serving_peer.png: the peer panel alone (bench/serving.py --peer-only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _common import save_figure

    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    plot_panel(ax, peer)
    fig.suptitle(f"deeprec in process vs ONNX Runtime, DLRM (EmbeddingVariables)\n{peer['cpu']}", fontsize=9)
    save_figure(fig, "serving_peer")

