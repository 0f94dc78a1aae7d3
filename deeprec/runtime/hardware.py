"""What this machine's hardware does fast, read (never assumed) from torch and /proc/cpuinfo.

Machines differ: an AMX or AVX512-BF16 CPU runs bf16 matmuls natively (bf16 end to end
measured 1.18x-1.9x fp32 on some), an AVX2-only CPU emulates them (20x slower on another), and an
AVX512-BF16 Xeon without AMX ran them at 0.6x fp32: bf16 "auto" measures before it picks.
"""
from __future__ import annotations

import functools
import platform

import torch


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """{"model": name, "flags": set of cpuinfo flags, "torch_capability": str}."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": flags, "torch_capability": torch.backends.cpu.get_cpu_capability()}


@functools.lru_cache(maxsize=1)
def bf16_gemm_speedup() -> float:
    """fp32 time / bf16 time of a GEMM at an MLP's shapes (batch 512, 512 x 512), measured here.
    A flag is not a rate: an AVX512-BF16 Xeon without AMX measured bf16 GEMMs at 0.6x fp32
    (bench/step.py), where a Zen 4 EPYC's bf16 step ran 1.9x its fp32 one. ~30 ms, once a process."""
    import time

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        torch.mm(a, b)  # first call: oneDNN picks and packs its kernel
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(3):
                torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether bf16 autocast pays on `device`, why), for `bf16="auto"`."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name(device)} {'has' if ok else 'lacks'} bf16"
    info = cpu_info()
    native = sorted(info["flags"] & {"amx_bf16", "avx512_bf16"})
    capability = info["torch_capability"]
    if native or "AMX" in capability.upper():
        speedup = bf16_gemm_speedup()
        if speedup < 1.1:
            return False, (f"{info['model']} has bf16 instructions ({', '.join(native) or capability}) but a bf16 "
                           f"GEMM measured {speedup:.2f}x fp32's speed here: the step stays fp32")
        return True, (f"{info['model']} runs bf16 natively ({', '.join(native) or capability}; a bf16 GEMM measured "
                      f"{speedup:.2f}x fp32)")
    return False, (f"{info['model']} has no AMX / AVX512-BF16 (torch capability {capability}): bf16 would be "
                   "emulated and slower, so the step stays fp32")
