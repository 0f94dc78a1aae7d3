"""The fp32 training step against this CPU's GEMM rate, and where its time goes (issue 41).

    probe     the GEMMs one training step runs (aten mm / addmm / bmm with their shapes and
              strides, recorded from a real step at batch 512), replayed alone, fp32 and bf16:
              what the step's matrix work costs on this CPU with nothing around it; measured again
              in each round beside that round's steps (the fraction is each round's, median)
    step      forward + backward + update on staged batches (no reading or parsing), per model
              and variant (eager fp32, torch.compile, bf16 autocast): samples/s, GEMM GFLOP/s
              (torch.utils.flop_counter) and the fraction of the probe's rate that is
    profile   torch.profiler of the eager fp32 step, by part: GEMMs, embeddings (lookup and
              the row-sparse update inside the backward), the dense optimizer, the rest

Variants of a round run back to back, rounds alternate; medians. glibc malloc is tuned as with
`deeprec train --malloc-tuning` (not the default there). Models: DLRM, DeepFM, WDL at
modelzoo sizes, 10k buckets, Adagrad lr 0.01 (bench/e2e.py's workload). The end-to-end comparison
with TF 2.21 XLA is bench/e2e.py's (`--peers` here runs it for DLRM in the same process).
Writes results/step.json and results/step.png.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from _common import cpu_line, print_table, save_figure, save_json, synthetic_criteo
import deeprec as dr
from deeprec.data import CriteoReader
from deeprec.models import build_model
from deeprec.optim import make_optimizer

BATCH = 512
GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
# bf16 forced on (auto measures first and may stay fp32: see deeprec/runtime/hardware.py)
VARIANTS = {"eager fp32": {}, "compile fp32": {"graph_fusion": True}, "bf16": {"bf16": True}}


class _RecordGemms(TorchDispatchMode):
    """The GEMM calls of what runs under it: (op, [(shape, stride) of each tensor arg], other args)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.calls.append((func, [(tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else a
                                      for a in args], dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _gemm_flops(func, shapes) -> int:
    if func is torch.ops.aten.bmm.default:
        (b, m, k), (_, _, n) = shapes[0][0], shapes[1][0]
        return 2 * b * m * k * n
    a, w = (shapes[1], shapes[2]) if func is torch.ops.aten.addmm.default else (shapes[0], shapes[1])
    (m, k), (_, n) = a[0], w[0]
    return 2 * m * k * n


def probe(calls, dtype: torch.dtype, repeats: int = 30) -> dict:
    """The recorded GEMMs replayed in `dtype`: seconds per pass (median) and GFLOP/s."""
    def tensor(spec):
        shape, stride = spec
        size = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        return torch.randn(size, dtype=dtype).as_strided(shape, stride)

    replay = [(func, [tensor(a) if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], tuple) else a
                      for a in shapes], kw) for func, shapes, kw in calls]
    flops = sum(_gemm_flops(func, shapes) for func, shapes, _ in calls)
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        for func, args, kw in replay:
            func(*args, **kw)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[5:])
    return {"seconds_per_step": seconds, "gflop_per_s": flops / seconds / 1e9, "gflop_per_step": flops / 1e9}


def _setup(name: str, data: str, options: dict):
    torch.manual_seed(0)
    model = build_model(name)
    opt = make_optimizer(model, "adagrad", 0.01)
    fast = dr.optimize(model, dr.Config(smart_stage=True, **options))
    staged = [fast.stage(b) for b in itertools.islice(CriteoReader(data, BATCH), 32)]
    return fast, opt, staged


def _step(fast, opt, item) -> None:
    fast(item)["loss"].backward()
    opt.step()
    opt.zero_grad()


def gemm_calls(name: str, data: str) -> tuple[list, int]:
    """The GEMMs of one eager fp32 step, and the step's FLOPs as torch's flop counter counts them."""
    fast, opt, staged = _setup(name, data, {})
    _step(fast, opt, staged[0])
    with _RecordGemms() as recorder:
        _step(fast, opt, staged[1])
    with FlopCounterMode(display=False) as counter:
        _step(fast, opt, staged[2])
    return recorder.calls, counter.get_total_flops()


def step_rate(name: str, data: str, options: dict, steps: int) -> float:
    fast, opt, staged = _setup(name, data, options)
    for item in staged[:10]:  # warm-up (compile: the first calls compile)
        _step(fast, opt, item)
    start = time.perf_counter()
    for item in itertools.islice(itertools.cycle(staged), steps):
        _step(fast, opt, item)
    return steps * BATCH / (time.perf_counter() - start)


def _part(event_name: str) -> str:
    if event_name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "GEMMs (mm, addmm, bmm)"
    if event_name.startswith(("deeprec::dot_interaction", "deeprec::gather_rows")):
        return "step ops (deeprec: DLRM's dots, the pooled rows' gather)"
    if event_name.startswith("deeprec::"):
        return "embeddings (deeprec ops: lookup, row-sparse update)"
    if "fused_adagrad" in event_name or "foreach" in event_name:
        return "dense optimizer"
    return "other ops (elementwise, copies, interaction gather, autograd)"


def profile(name: str, data: str, steps: int) -> dict:
    """ms per step by part (self CPU time of the ops, on the calling thread) and by stage."""
    from torch.profiler import ProfilerActivity, record_function

    fast, opt, staged = _setup(name, data, {})
    for item in staged[:10]:
        _step(fast, opt, item)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for item in itertools.islice(itertools.cycle(staged), steps):
            with record_function("step.forward"):
                loss = fast(item)["loss"]
            with record_function("step.backward"):
                loss.backward()
            with record_function("step.dense_optimizer"):
                opt.step()
            with record_function("step.zero_grad"):
                opt.zero_grad()
    parts, stages, ops = {}, {}, {}
    for event in prof.key_averages():
        if event.key.startswith("step."):
            stages[event.key[5:]] = event.cpu_time_total / 1e3 / steps
        elif not event.key.startswith(("ProfilerStep", "deeprec.")):
            ms = event.self_cpu_time_total / 1e3 / steps
            parts[_part(event.key)] = parts.get(_part(event.key), 0.0) + ms
            ops[event.key] = ms
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    return {"ms_per_step_by_part": parts, "ms_per_step_by_stage": stages, "top_ops_ms_per_step": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400_000, help="synthetic Criteo rows (Kaggle cardinalities)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="dlrm,deepfm,wdl")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--peers", action="store_true", help="also DLRM end to end beside TF 2.21 (+XLA), bench/e2e.py's")
    args = parser.parse_args()
    from deeprec.runtime.memory import tune_malloc

    tune_malloc()  # `deeprec train --malloc-tuning`'s setting: freed buffers are reused, not faulted in again
    data = synthetic_criteo(args.rows)
    models, variants = args.models.split(","), args.variants.split(",")

    result = {"cpu": cpu_line(), "batch": BATCH, "models": {}}
    calls = {}
    for name in models:
        calls[name], flops = gemm_calls(name, data)
        result["models"][name] = {"gflop_per_step": flops / 1e9, "gemms_per_step": len(calls[name]),
                                  "probe_rounds": [], "samples_per_s": {v: [] for v in variants},
                                  "fraction_rounds": {v: [] for v in variants}}
    # the probe runs again in every round, just before that round's steps: this VM's speed drifts by
    # 10-30% over minutes, so a step is compared with the GEMMs measured beside it
    for _ in range(args.rounds):
        for name in models:
            r = result["models"][name]
            r["probe_rounds"].append({"fp32": probe(calls[name], torch.float32), "bf16": probe(calls[name], torch.bfloat16)})
            for variant in variants:
                rate = step_rate(name, data, VARIANTS[variant], args.steps)
                r["samples_per_s"][variant].append(rate)
                r["fraction_rounds"][variant].append(rate / BATCH * r["gflop_per_step"]
                                                     / r["probe_rounds"][-1]["fp32"]["gflop_per_s"])

    rows = []
    for name, r in result["models"].items():
        for kind in ("fp32", "bf16"):  # medians over the rounds
            rates = [p[kind]["gflop_per_s"] for p in r["probe_rounds"]]
            seconds = [p[kind]["seconds_per_step"] for p in r["probe_rounds"]]
            r[f"probe_{kind}"] = {"gflop_per_s": statistics.median(rates), "seconds_per_step": statistics.median(seconds),
                                  "gflop_per_s_rounds": rates}
        r["median"] = {v: statistics.median(rates) for v, rates in r["samples_per_s"].items()}
        for variant, rate in r["median"].items():
            gflops = rate / BATCH * r["gflop_per_step"]
            probe_rate = r["probe_bf16" if variant.startswith("bf16") else "probe_fp32"]["gflop_per_s"]
            fraction = statistics.median(r["fraction_rounds"][variant])  # each round's step over its own probe
            r.setdefault("fraction_of_fp32_probe", {})[variant] = fraction
            rows.append([name, variant, f"{rate:,.0f}", f"{gflops:.1f}", f"{fraction:.2f}",
                         f"{probe_rate:.1f}", " ".join(f"{x:,.0f}" for x in r["samples_per_s"][variant])])
    print_table(f"The training step at batch {BATCH}, staged batches, Adagrad ({cpu_line()})",
                ["model", "variant", "samples/s", "GEMM GFLOP/s", "of fp32 probe (per round, median)", "probe GFLOP/s",
                 "per round"], rows)
    print_table("GEMM probe: the step's own GEMMs replayed alone",
                ["model", "GFLOP/step", "GEMMs", "fp32 GFLOP/s", "bf16 GFLOP/s", "fp32 ms", "bf16 ms"],
                [[n, f"{r['gflop_per_step']:.3f}", r["gemms_per_step"], f"{r['probe_fp32']['gflop_per_s']:.1f}",
                  f"{r['probe_bf16']['gflop_per_s']:.1f}", f"{r['probe_fp32']['seconds_per_step'] * 1e3:.2f}",
                  f"{r['probe_bf16']['seconds_per_step'] * 1e3:.2f}"] for n, r in result["models"].items()])

    for name in models:
        prof = profile(name, data, 50)
        result["models"][name]["profile"] = prof
        total = sum(prof["ms_per_step_by_part"].values())
        print_table(f"{name}, eager fp32: ms per step by part (torch.profiler, self CPU time, 50 steps)",
                    ["part", "ms", "share"],
                    [[p, f"{ms:.2f}", f"{ms / total:.0%}"] for p, ms in sorted(prof["ms_per_step_by_part"].items(),
                                                                               key=lambda kv: -kv[1])]
                    + [[f"stage: {s}", f"{ms:.2f}", ""] for s, ms in prof["ms_per_step_by_stage"].items()]
                    + [[f"op: {op}", f"{ms:.2f}", f"{ms / total:.0%}"] for op, ms in prof["top_ops_ms_per_step"].items()])

    if args.peers:
        result["end_to_end"] = peers(data, models, args.steps, args.rounds)
    print("saved", save_json("step", {"rows": args.rows, "steps": args.steps, "rounds": args.rounds, **result}))
    _plot(result)


def peers(data: str, models: list[str], steps: int, rounds: int) -> dict:
    """End to end from the TSV: `deeprec train` (fp32, bf16 auto) beside tf.data + Keras (with and
    without XLA), per model, runs alternating over rounds (bench/e2e.py's helpers)."""
    import e2e

    runs = {"deeprec train fp32": lambda m: e2e.train_rate(data, steps + 50, model=m)[0],
            "deeprec train bf16 auto": lambda m: e2e.train_rate(data, steps + 50, model=m, optimize=dict(bf16="auto"))[0],
            "tf keras": lambda m: e2e.tf_rate(data, steps, jit=False, model=m),
            "tf keras xla": lambda m: e2e.tf_rate(data, steps, jit=True, model=m)}
    rates = {m: {k: [] for k in runs} for m in models}
    for _ in range(rounds):
        for model, (key, run) in itertools.product(models, runs.items()):
            rate = run(model)
            if rate is not None:
                rates[model][key].append(rate)
    out, rows = {}, []
    for model in models:
        medians = {k: statistics.median(v) for k, v in rates[model].items() if v}
        xla = medians.get("tf keras xla")
        out[model] = {"samples_per_s": rates[model], "median": medians,
                      "vs_tf_xla": {k: m / xla for k, m in medians.items()} if xla else None}
        rows += [[model, k, f"{m:,.0f}", f"{m / xla:.2f}" if xla else "-", " ".join(f"{x:,.0f}" for x in rates[model][k])]
                 for k, m in medians.items()]
    print_table(f"End to end from a TSV (deeprec train vs tf.data + Keras), batch {BATCH} ({cpu_line()})",
                ["model", "run", "samples/s", "vs TF XLA fp32", "per round"], rows)
    return out


def _plot(result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    labels, values = [], []
    for name, r in result["models"].items():
        for variant, fraction in r["fraction_of_fp32_probe"].items():
            labels.append(f"{name} {variant}")
            values.append(fraction)
    ax.barh(labels, values, color="#1b9e77")
    ax.axvline(0.7, color="black", linestyle="--", linewidth=1, label="target: 0.7 of the fp32 probe")
    ax.invert_yaxis()
    ax.set_xlabel("step's GEMM rate / the same GEMMs alone (fp32)")
    ax.set_title(result["cpu"], fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, "step")


if __name__ == "__main__":
    main()
