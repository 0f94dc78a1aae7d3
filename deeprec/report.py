"""What a training run reports: the summary table rank 0 prints, and the result as JSON (--json,
and under deeprec launch its result folder, where the launcher adds up the job's totals)."""
from __future__ import annotations

import json
import os

from rich.table import Table

from deeprec.nn.tiered import describe_tiers


def write_result(result: dict, path: str | None, strategy) -> None:
    """--json PATH (rank R of several: <name>.rank-R.json); under deeprec launch also its result folder,
    where the launcher adds up the job's totals."""
    paths = []
    if path:
        if strategy.world_size > 1:
            stem, ext = os.path.splitext(path)
            path = f"{stem}.rank-{strategy.rank}{ext}"
        paths.append(path)
    if os.environ.get("DEEPREC_RESULT_DIR"):
        paths.append(os.path.join(os.environ["DEEPREC_RESULT_DIR"], f"rank-{strategy.rank}.json"))
    for p in paths:
        with open(p, "w") as f:
            json.dump(result, f, indent=2)


def summary_table(cfg, result: dict) -> Table:
    table = Table(title=f"deeprec train --model {cfg.model.name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(result["steps"]))
    table.add_row("samples/s", f"{result['samples_per_s']:,.0f}" +
                  (f" (this rank of {result['world_size']})" if result.get("world_size", 1) > 1 else ""))
    if "job" in result:
        job = result["job"]
        table.add_row("job samples/s", f"{job['samples_per_s']:,.0f} ({job['ranks']} ranks, {job['rows']:,} rows)")
    table.add_row("final train loss", f"{result['final_loss']:.4f}")
    if "auto" in result:
        table.add_row("smart stage auto", result["auto"])
    if "bf16" in result:
        table.add_row("bf16 auto", result["bf16"])
    if "malloc" in result:
        table.add_row("memory", result["malloc"])
    if "stage" in result:
        st = result["stage"]
        table.add_row("smart stage", f"{st['taken']} batches staged ahead, {st['dropped']} dropped, "
                                     f"{st['ignored']} ignored")
    if "device" in result:
        host = result["tables_on_host"]
        table.add_row("device", result["device"] + (f" (tables on the host: {', '.join(host)})" if host else ""))
    if "communication" in result:
        c = result["communication"]
        table.add_row("all-to-all per step", f"{c['all_to_all_ms']:.2f} ms, {c['all_to_all_bytes'] / 1e3:,.0f} kB sent")
        table.add_row("all-reduce per step", f"{c['all_reduce_ms']:.2f} ms, {c['all_reduce_bytes'] / 1e3:,.0f} kB sent")
    if "tiers" in result:
        table.add_row("tiered storage", describe_tiers(result["tiers"]).split(": ", 1)[1])
    if result["bad_rows"]:
        table.add_row("bad rows skipped", str(result["bad_rows"]))
    if "eval" in result:
        ev = result["eval"]
        table.add_row("eval rows", f"{ev['rows']:,}")
        for name, metrics in (ev.get("tasks") or {"": ev}).items():
            suffix = f" ({name})" if name else ""
            table.add_row(f"eval AUC{suffix}", f"{metrics['auc']:.4f}")
            table.add_row(f"eval logloss{suffix}", f"{metrics['logloss']:.4f}")
        if "gauc" in ev:
            table.add_row("eval GAUC", f"{ev['gauc']:.4f} ({ev['gauc_users']:,} users with both classes"
                          + (f"; a {ev['gauc_sampled']:.0%} sample of users)" if "gauc_sampled" in ev else ")"))
        recalls = [k for k in ev if k.startswith("recall@")]
        if recalls:
            table.add_row("eval retrieval", ", ".join(f"{k} {ev[k]:.4f}, ndcg@{k[7:]} {ev['ndcg@' + k[7:]]:.4f}"
                                                      for k in recalls)
                          + f" ({ev['retrieval_queries']:,} queries among {ev['retrieval_candidates']:,} items)")
    return table


__all__ = ["summary_table", "write_result"]
