"""Row-sparse optimizer update: deeprec's one-pass C++ kernels vs the torch-op composition
they replaced (gathers, elementwise ops, scatters), side by side, interleaved rounds.

Workload: a table of 1M rows, the rows a DLRM step touches (26 tables x 512 ids, ~13k distinct
rows, sorted as merge_rows leaves them), dims 16 and 64, one thread (the PS and the trainer
both run the update on the calling thread). Reported: median ms per update and the speed-up.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from _common import cpu_line, print_table, save_figure, save_json, summarize
from deeprec import optim


def composed(name: str, opt, weight, slots, rows, grad) -> None:
    """The torch-op update each optimizer used before the fused kernels (same math)."""
    if name == "sgd":
        weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(grad, alpha=opt.lr))
    elif name == "adagrad":
        acc = slots["accumulator"]
        new_acc = acc.index_select(0, rows).addcmul_(grad, grad)
        acc.index_copy_(0, rows, new_acc)
        step = grad / new_acc.sqrt_().add_(opt.eps)
        weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(step, alpha=opt.lr))
    else:
        b1, b2 = opt.betas
        m = slots["exp_avg"].index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        v = slots["exp_avg_sq"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        slots["exp_avg"].index_copy_(0, rows, m)
        slots["exp_avg_sq"].index_copy_(0, rows, v)
        t = opt.step_count
        step_size = opt.lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        denom = v.sqrt_().add_(opt.eps * math.sqrt(1 - b2 ** t))
        weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(m / denom, alpha=step_size))


def measure(name: str, dim: int, rounds: int, reps: int) -> dict:
    make = {"sgd": lambda: optim.SGD(lr=0.01), "adagrad": lambda: optim.Adagrad(lr=0.01),
            "adam": lambda: optim.Adam(lr=0.001)}[name]
    g = torch.Generator().manual_seed(0)
    table_rows = 1_000_000
    rows = torch.unique(torch.randint(0, table_rows, (26 * 512,), generator=g))
    grad = torch.randn(rows.numel(), dim, generator=g)
    opt = make()
    weight = torch.randn(table_rows, dim, generator=g)
    slots = opt.init_slots(table_rows, dim)
    opt.begin_step()
    times = {"torch ops": [], "fused C++": []}
    for _ in range(rounds):
        for label, run in (("torch ops", lambda: composed(name, opt, weight, slots, rows, grad)),
                           ("fused C++", lambda: opt.update(weight, slots, rows, grad))):
            start = time.perf_counter()
            for _ in range(reps):
                run()
            times[label].append((time.perf_counter() - start) / reps * 1e3)
    return {"rows": int(rows.numel()), **{k: summarize(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, rows = {}, []
    for name in ("sgd", "adagrad", "adam"):
        for dim in (16, 64):
            r = measure(name, dim, args.rounds, args.reps)
            results[f"{name}/dim{dim}"] = r
            old, new = r["torch ops"]["median"], r["fused C++"]["median"]
            rows.append([name, str(dim), f"{r['rows']:,}", f"{old:.3f}", f"{new:.3f}", f"{old / new:.1f}x"])
    print_table(f"row-sparse update of ~13k rows of a 1M-row table, 1 thread - {cpu_line()}",
                ["optimizer", "dim", "rows", "torch ops ms", "fused C++ ms", "speed-up"], rows)
    print("saved", save_json("sparse_optim", {"rounds": args.rounds, "reps": args.reps, "results": results}))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    keys = list(results)
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [results[k]["torch ops"]["median"] for k in keys], 0.4, label="torch ops")
    ax.bar([i + 0.2 for i in x], [results[k]["fused C++"]["median"] for k in keys], 0.4, label="fused C++")
    ax.set_xticks(list(x), keys, fontsize=8)
    ax.set_ylabel("ms per update")
    ax.legend()
    save_figure(fig, "sparse_optim")


if __name__ == "__main__":
    main()
