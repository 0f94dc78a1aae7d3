"""Diagnostic for issue #29's DIN gap: deeprec's DIN beside DeepCTR-Torch's, one variant at a time.

    deeprec            deeprec's Trainer (bench/quality.py's deeprec_run)
    ours-loop          deeprec's DIN module (embedding="torch") in the peer's loop (quality_peers.train_peer:
                       the same encoded batches, torch.optim Adam + SparseAdam): tells the model from the trainer
    deepctr            DeepCTR-Torch's DIN as bench/quality.py builds it
    <variant>+<knob>   with a change; knobs:
        nobn            no batch norm in the top MLP (all variants)
        empty-zero      deeprec / ours-loop: an empty history's interest is 0 (DINConfig.empty_history="zero",
                        deeprec's DIN before the learned vector); deepctr: its attention output zeroed there
        bn-before-relu  ours-loop: Linear, BatchNorm, ReLU in the top MLP (DeepCTR's order)
        bn-after-relu   deepctr: Linear, ReLU, BatchNorm in its DNN (deeprec's order)

Every variant prints one JSON line: its final eval GAUC / AUC / log loss.
    python din_diag.py --variants deeprec,ours-loop,deepctr [--rows 300000] [--seed 1] [--split]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch import nn

from _common import _written_once, synthetic_behavior
from quality import build_peer, deeprec_run
from quality_peers import _match_init, encode, metrics_of, train_peer
from deeprec.data import write_behavior
from deeprec.models.din import DIN


def model_overrides(knobs: set[str]) -> dict:
    """deeprec's DIN config for the knobs: nobn (no batch norm), empty-zero (an empty history's interest
    is 0, as before DINConfig.empty_history; default: the learned vector)."""
    return {**({"batch_norm": False} if "nobn" in knobs else {}),
            **({"empty_history": "zero"} if "empty-zero" in knobs else {})}


class OursPeer:
    """deeprec's DIN (embedding="torch": nn.Embedding tables) fed the encoded ids directly."""

    def __init__(self, data: dict, knobs: set[str], seed: int = 0):
        torch.manual_seed(seed)
        self.model = DIN(embedding="torch", **model_overrides(knobs))
        self.name = "deeprec DIN in the peer loop"
        embedder = self.model.inputs.embedder
        names = (*embedder.categorical, *embedder.sequences)
        embedder.ids = lambda batch: {n: batch[n] for n in names}  # the batch holds the encoded ids already
        self.sequences = list(embedder.sequences)
        self.knobs = knobs
        if "bn-before-relu" in knobs:  # DeepCTR's order: Linear, BatchNorm, ReLU
            top = self.model.top
            mods = list(top)
            out = []
            i = 0
            while i < len(mods):
                if isinstance(mods[i], nn.ReLU) and i + 1 < len(mods) and isinstance(mods[i + 1], nn.BatchNorm1d):
                    out += [mods[i + 1], mods[i]]
                    i += 2
                else:
                    out.append(mods[i])
                    i += 1
            self.model.top = nn.Sequential(*out)

    def logits(self, data: dict, sl: slice) -> torch.Tensor:
        ids, hist = data["ids"][sl], data["hist"][sl]
        batch = {str(c): torch.from_numpy(np.ascontiguousarray(ids[:, i])) for i, c in enumerate(data["categorical"])}
        for s, name in enumerate(self.sequences):
            batch[name] = torch.from_numpy(np.ascontiguousarray(hist[:, s]))
        batch["click"] = torch.zeros(len(ids))
        return self.model(batch)["logits"]


def deepctr_peer(train: dict, knobs: set[str], seed: int = 0):
    peer = build_peer("deepctr", "din", train, batch_norm="nobn" not in knobs)
    if seed:  # another draw of the same init distributions
        torch.manual_seed(seed)
        _match_init(peer.model)
    if "bn-after-relu" in knobs:  # deeprec's order: Linear, ReLU, BatchNorm
        dnn = peer.model.dnn

        def dnn_forward(x, _d=dnn):
            for i, linear in enumerate(_d.linears):
                x = _d.activation_layers[i](linear(x))
                x = _d.bn[i](x) if _d.use_bn else x
            return x

        dnn.forward = dnn_forward
    if "empty-zero" in knobs:  # an empty history pools zeros, as deeprec's
        attention = peer.model.attention
        plain = type(attention).forward

        def forward(query, keys, keys_length, mask=None, _a=attention):
            out = plain(_a, query, keys, keys_length, mask)
            return out * (keys_length.view(-1, 1, 1) > 0).to(out.dtype)

        attention.forward = forward
    return peer


def split_metrics(peer, held_out: dict) -> dict:
    """GAUC over the rows with a history only, and the rows without one: their mean logit
    beside the logit of their click rate, and their AUC."""
    peer.model.eval()
    with torch.no_grad():
        logits = np.concatenate([peer.logits(held_out, slice(s, s + 4096)).numpy()
                                 for s in range(0, len(held_out["label"]), 4096)])
    empty = held_out["hist"][:, 0, 0] < 0
    label, group = held_out["label"], held_out["group"]
    full = metrics_of(label[~empty], logits[~empty], group[~empty])
    rate = label[empty].mean()
    return {"with_history_gauc": full["gauc"], "empty_rows": float(empty.mean()),
            "empty_auc": metrics_of(label[empty], logits[empty])["auc"],
            "empty_mean_logit": float(logits[empty].mean()), "empty_rate_logit": float(np.log(rate / (1 - rate))),
            "with_mean_logit": float(logits[~empty].mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="deeprec,ours-loop,deepctr")
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--eval-rows", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=None, help="default: one epoch")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="init seed (deeprec: the Trainer's seed)")
    p.add_argument("--split", action="store_true", help="also GAUC / mean logit on rows with and without history")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train_path = synthetic_behavior(args.rows)
    eval_path = _written_once(f"synth-behavior-{args.eval_rows}-sample1.tsv",
                              lambda tmp: write_behavior(tmp, args.eval_rows, seed=0, sample_seed=1))
    steps = args.steps or args.rows // args.batch_size
    opt = dict(steps=steps, batch=args.batch_size, optimizer="adam", lr=args.lr, eval_every=steps)
    train = held_out = None
    for variant in args.variants.split(","):
        base, *knobs = variant.split("+")
        knobs = set(knobs)
        start = time.perf_counter()
        if base == "deeprec":
            run = deeprec_run("din", train_path, eval_path, seed=args.seed, overrides=model_overrides(knobs), **opt)
        else:
            if train is None:
                train, held_out = encode("din", train_path), encode("din", eval_path)
            peer = OursPeer(train, knobs, args.seed) if base == "ours-loop" else deepctr_peer(train, knobs, args.seed)
            run = train_peer(peer, train, held_out, drop_remainder=True, **opt)
            if args.split:
                run["eval"].update(split_metrics(peer, held_out))
        e = run["eval"]
        extra = {k: round(float(v), 4) for k, v in e.items() if k.startswith(("empty_", "with_"))}
        print(json.dumps({"variant": variant, "seed": args.seed, "rows": args.rows, "steps": steps,
                          "gauc": round(e["gauc"], 4), **extra,
                          "auc": round(e["auc"], 4), "logloss": round(e["logloss"], 4),
                          "final_loss": round(float(run["final_loss"]), 4),
                          "seconds": round(time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
