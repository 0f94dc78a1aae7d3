"""The peers of bench/quality.py in this venv, fed the numbers deeprec's own feature layer makes.

encode() runs a deeprec model's FeatureEmbedder (hashed bucket ids, log1p dense, WDL's dense
buckets, padded histories) once over a file into numpy arrays; TorchRec's DLRM, DeepCTR-Torch's
DeepFM / WDL / DIN and TensorFlow's DLRM (bench/quality_tf.py, .venv-tf) train on those arrays,
batch by batch in the file's order, as deeprec's reader gives them to deeprec's model. So the id
space, the split, the batches and their order are the same, and only the model code differs.

Initialisation is matched to deeprec's: embeddings U(-0.05, 0.05), linear layers torch's default
U(+-1/sqrt(fan_in)) (weights and biases), WDL's dense-bucket weights zero. The optimizers are torch's
with deeprec's settings and semantics (Optimizers).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deeprec import ops
from deeprec.data import open_reader, resolve_schema
from deeprec.metrics import StreamingMetrics
from deeprec.models import build_model
from deeprec.models.features import INIT_BOUND
from deeprec.models.wdl import DENSE_BOUNDARIES

try:
    from deeprec.metrics import GroupedAUC
except ImportError:  # lands with the DIN GAUC change
    GroupedAUC = None


# -- the data, as deeprec's feature layer sees it ---------------------------------------------------
def encode(model_name: str, path: str, schema=None, embedding: str = "table") -> dict[str, np.ndarray]:
    """{"ids": [N, C] bucket ids, "dense": [N, D], "dense_buckets": [N, D], "label": [N],
    "hist": [N, S, L] (-1 padded), "group": [N] (the role="user" column's raw id)} of one file.
    The peers need bucket ids: the model's hashed tables (embedding="table") whatever the zoo's
    default; embedding="variable" gives the EmbeddingVariables' 63-bit keys instead."""
    schema = resolve_schema([path], schema)
    model = build_model(model_name, schema=schema, embedding=embedding)
    embedder = model.inputs.embedder if model_name == "din" else model.embeddings
    user = [c.name for c in schema.columns if c.kind == "categorical" and c.role == "user"]
    parts: dict[str, list] = {}
    for batch in open_reader([path], 65536, schema=schema, num_epochs=1):
        ids = embedder.ids(batch)
        parts.setdefault("ids", []).append(torch.stack([ids[c] for c in embedder.categorical], 1).numpy())
        if embedder.sequences:
            parts.setdefault("hist", []).append(torch.stack([ids[s] for s in embedder.sequences], 1).numpy())
        dense = embedder.dense_values(batch)
        if dense is not None:
            parts.setdefault("dense", []).append(dense.numpy())
            parts.setdefault("dense_buckets", []).append(ops.bucketize(dense, DENSE_BOUNDARIES).numpy())
        parts.setdefault("label", []).append(batch[model.label_columns[0]].numpy().astype(np.float32))
        if user and isinstance(batch[user[0]], torch.Tensor):  # an int id (a string column is ragged bytes)
            parts.setdefault("group", []).append(batch[user[0]].numpy().astype(np.int64))
    out = {k: np.concatenate(v) for k, v in parts.items()}
    out["categorical"] = np.array(embedder.categorical)
    out["buckets"] = np.array([embedder.buckets[c] for c in embedder.categorical])
    out["sequences"] = np.array(embedder.sequences)
    out["sequence_buckets"] = np.array([embedder.buckets[s] for s in embedder.sequences])
    return out


def batches(rows: int, batch: int, steps: int, drop_remainder: bool = False):
    """(step, slice) in deeprec's reader order: the file's rows in order, epoch after epoch, the
    last short batch kept (dropped for batch-norm models, as deeprec's trainer does)."""
    starts = list(range(0, rows, batch))
    if drop_remainder and rows % batch:
        starts.pop()
    for k in range(steps):
        s = starts[k % len(starts)]
        yield k + 1, slice(s, min(s + batch, rows))


class Optimizers:
    """torch optimizers with deeprec's settings (deeprec.optim.make_optimizer). Adam: the embedding
    tables get sparse gradients and torch.optim.SparseAdam (lazy Adam: only the rows of the batch
    move, bias correction by the global step), which is the math of deeprec's row-sparse Adam; the
    rest torch.optim.Adam. Adagrad: one torch.optim.Adagrad (initial accumulator 0.1, eps 1e-10)
    for all (a dense gradient's zero rows leave their weights and accumulators unchanged)."""

    def __init__(self, model: nn.Module, name: str, lr: float):
        params = [p for p in model.parameters() if p.requires_grad]
        if name == "adagrad":
            self.opts = [torch.optim.Adagrad(params, lr=lr, initial_accumulator_value=0.1, eps=1e-10)]
            return
        if name == "dense_adam":  # as Keras: every row of a table moves each step
            self.opts = [torch.optim.Adam(params, lr=lr, eps=1e-8)]
            return
        tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        for m in tables:
            m.sparse = True
        sparse = {id(m.weight) for m in tables}
        self.opts = [torch.optim.Adam([p for p in params if id(p) not in sparse], lr=lr, eps=1e-8),
                     torch.optim.SparseAdam([p for p in params if id(p) in sparse], lr=lr, eps=1e-8)]

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


def metrics_of(labels: np.ndarray, logits: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """deeprec.metrics' AUC and log loss (and GroupedAUC's GAUC when groups are given)."""
    m = StreamingMetrics()
    m.update(labels, logits)
    out = m.result()
    if groups is not None and GroupedAUC is not None:
        g = GroupedAUC()
        g.update(groups, labels, logits)
        out.update(g.result())
    return out


# -- the peers ------------------------------------------------------------------------------------
def _match_init(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            nn.init.uniform_(m.weight, -INIT_BOUND, INIT_BOUND)


class TorchRecPeer:
    """torchrec.models.dlrm.DLRM over an EmbeddingBagCollection of the same tables."""

    def __init__(self, data: dict, dim: int = 16, dense_adam: bool = False):
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.name = "TorchRec 1.9.2 DLRM" + (", dense Adam" if dense_adam else "")
        self.optimizer = "dense_adam" if dense_adam else None
        self.keys = [str(c) for c in data["categorical"]]
        tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=int(n), feature_names=[k],
                                     weight_init_min=-INIT_BOUND, weight_init_max=INIT_BOUND)
                  for k, n in zip(self.keys, data["buckets"])]
        self.model = DLRM(EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                          dense_in_features=data["dense"].shape[1], dense_arch_layer_sizes=[512, 256, 64, dim],
                          over_arch_layer_sizes=[512, 256, 1])
        for m in self.model.modules():  # TorchRec's MLPs are nn.Linear at torch's default init already
            if isinstance(m, nn.Linear):
                m.reset_parameters()

    def logits(self, data: dict, sl: slice) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids = data["ids"][sl]
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.from_numpy(np.ascontiguousarray(ids.T)).reshape(-1),
                                lengths=torch.ones(ids.size, dtype=torch.int32))
        return self.model(torch.from_numpy(data["dense"][sl]), kjt).squeeze(1)


class DeepCTRPeer:
    """DeepCTR-Torch 0.3.0's DeepFM, WDL or DIN, its X built from the encoded arrays; its
    PredictionLayer set to return the logit (bias added, no sigmoid) for a logits loss. DeepFM's
    sequence columns (MovieLens genres) are mean-pooled VarLenSparseFeats, as deeprec's DeepFM
    pools them (ids shifted by 1: 0 = padding). seed: DeepCTR's (it seeds torch before the init)."""

    def __init__(self, kind: str, data: dict, dim: int, hidden: tuple, din: dict | None = None, seed: int = 0):
        import deepctr_torch.models as dm
        from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat

        self.name = {"deepfm": "DeepCTR-Torch 0.3.0 DeepFM", "wdl": "DeepCTR-Torch 0.3.0 WDL",
                     "din": "DeepCTR-Torch 0.3.0 DIN"}[kind]
        cats = [str(c) for c in data["categorical"]]
        sparse = [SparseFeat(c, int(n) + (kind == "din"), dim) for c, n in zip(cats, data["buckets"])]
        n_dense = data["dense"].shape[1] if "dense" in data else 0
        dense = [DenseFeat(f"I{d + 1}", 1) for d in range(n_dense)]
        common = dict(l2_reg_embedding=0.0, l2_reg_dnn=0.0, init_std=1e-4, seed=seed, task="binary", device="cpu")
        self.seqs = [str(s) for s in data.get("sequences", ())] if kind == "deepfm" else []
        if self.seqs:
            sparse = sparse + [VarLenSparseFeat(SparseFeat(s, int(n) + 1, dim), data["hist"].shape[2], combiner="mean",
                                                length_name=f"{s}_length")
                               for s, n in zip(self.seqs, data["sequence_buckets"])]
        if kind == "deepfm":
            self.model = dm.DeepFM(sparse + dense, sparse + dense, dnn_hidden_units=hidden, l2_reg_linear=0.0, **common)
        elif kind == "wdl":
            wide = [SparseFeat(f"I{d + 1}_bucket", len(DENSE_BOUNDARIES) + 1, 1) for d in range(n_dense)]
            self.model = dm.WDL(sparse + wide, sparse + dense, dnn_hidden_units=hidden, l2_reg_linear=0.0, **common)
        else:  # hist_<item column> share the item column's table (+1: id 0 is DeepCTR's padding)
            hist = [VarLenSparseFeat(SparseFeat(f"hist_{c}", int(n) + 1, dim, embedding_name=c), din["max_length"],
                                     length_name="hist_length") for c, n in zip(din["items"], din["item_buckets"])]
            self.model = dm.DIN(sparse + hist, list(din["items"]), dnn_use_bn=din.get("batch_norm", True),
                                dnn_hidden_units=hidden,
                                att_hidden_size=din["attention"], att_activation="sigmoid",
                                att_weight_normalization=True, **common)
        self.model.out.task = "regression"  # logit + bias: the loss takes logits
        _match_init(self.model)
        linear = self.model.linear_model if hasattr(self.model, "linear_model") else None
        if linear is not None and hasattr(linear, "weight"):  # DeepFM's dense first-order weights: nn.Linear's init
            nn.init.uniform_(linear.weight, -n_dense ** -0.5, n_dense ** -0.5)
        if linear is not None:
            for name, table in linear.embedding_dict.items():
                if name.endswith("_bucket"):
                    nn.init.zeros_(table.weight)  # as deeprec's WDL wide_dense
        self.kind, self.cats, self.n_dense = kind, cats, n_dense
        self.X: dict[int, torch.Tensor] = {}

    def _x(self, data: dict) -> torch.Tensor:
        """DeepCTR's input: every feature one float column (ids < 2^24 are exact)."""
        key = id(data)
        if key not in self.X:
            index = self.model.feature_index
            x = np.zeros((len(data["label"]), max(e for _, e in index.values())), np.float32)
            for i, c in enumerate(self.cats):
                x[:, index[c][0]] = data["ids"][:, i] + (self.kind == "din")
            for d in range(self.n_dense):
                x[:, index[f"I{d + 1}"][0]] = data["dense"][:, d]
                if f"I{d + 1}_bucket" in index:
                    x[:, index[f"I{d + 1}_bucket"][0]] = data["dense_buckets"][:, d]
            for s, name in enumerate(self.seqs):  # DeepFM's sequences: ids + 1, and their lengths
                a, b = index[name]
                x[:, a:b] = data["hist"][:, s] + 1
                x[:, index[f"{name}_length"][0]] = (data["hist"][:, s] >= 0).sum(1)
            if self.kind == "din":
                hist = data["hist"]  # [N, S, L], -1 padded at the end
                for s, name in enumerate(k for k in index if k.startswith("hist_") and k != "hist_length"):
                    a, b = index[name]
                    x[:, a:b] = hist[:, s] + 1
                x[:, index["hist_length"][0]] = (hist[:, 0] >= 0).sum(1)
            self.X[key] = torch.from_numpy(x)
        return self.X[key]

    def logits(self, data: dict, sl: slice) -> torch.Tensor:
        return self.model(self._x(data)[sl]).squeeze(1)


def train_peer(peer, train: dict, held_out: dict, *, steps: int, batch: int, optimizer: str, lr: float,
               eval_every: int, drop_remainder: bool = False, eval_batch: int = 4096) -> dict:
    """The peer's loop: the same batches as deeprec's trainer, torch's optimizer with deeprec's
    settings, evaluation every eval_every steps and at the end, on the whole held-out split."""
    torch.manual_seed(0)
    model = peer.model
    opt = Optimizers(model, getattr(peer, "optimizer", None) or optimizer, lr)
    labels = torch.from_numpy(train["label"])
    history, losses = [], []

    def evaluate(step):
        model.eval()
        with torch.no_grad():
            out = np.concatenate([peer.logits(held_out, slice(s, s + eval_batch)).numpy()
                                  for s in range(0, len(held_out["label"]), eval_batch)])
        model.train()
        history.append({"step": step, **metrics_of(held_out["label"], out, held_out.get("group"))})

    model.train()
    start = time.perf_counter()
    for step, sl in batches(len(labels), batch, steps, drop_remainder):
        loss = F.binary_cross_entropy_with_logits(peer.logits(train, sl), labels[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    return {"eval_history": history, "eval": history[-1], "final_loss": losses[-1],
            "seconds": time.perf_counter() - start}
