"""What this machine's hardware does fast, read (never assumed) from torch and /proc/cpuinfo.

Machines differ: an AMX or AVX512-BF16 CPU runs bf16 matmuls natively (bf16 end to end
measured 1.18x fp32 on one), while an AVX2-only CPU emulates them (20x slower on another).
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


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether bf16 autocast pays on `device`, why), for `bf16="auto"`."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name(device)} {'has' if ok else 'lacks'} bf16"
    info = cpu_info()
    native = sorted(info["flags"] & {"amx_bf16", "avx512_bf16"})
    capability = info["torch_capability"]
    if native or "AMX" in capability.upper():
        return True, f"{info['model']} runs bf16 natively ({', '.join(native) or capability})"
    return False, (f"{info['model']} has no AMX / AVX512-BF16 (torch capability {capability}): bf16 would be "
                   "emulated and slower, so the step stays fp32")
