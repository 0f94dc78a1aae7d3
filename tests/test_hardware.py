"""bf16="auto" follows the hardware: on where bf16 is native, fp32 with a reason elsewhere."""
import math

import pytest
import torch

import deeprec as dr
from deeprec.models import build_model
from deeprec.runtime import hardware


def _pretend(monkeypatch, flags, capability="AVX2", speedup=1.8):
    monkeypatch.setattr(hardware, "cpu_info", lambda: {"model": "Test CPU", "flags": set(flags),
                                                      "torch_capability": capability})
    monkeypatch.setattr(hardware, "bf16_gemm_speedup", lambda: speedup)


@pytest.mark.parametrize("flags,capability,expected", [
    ({"avx2", "fma"}, "AVX2", False),
    ({"avx512f", "avx512_bf16"}, "AVX512", True),
    ({"avx512f", "amx_bf16", "amx_tile"}, "AVX512", True),
    ({"avx512f"}, "AVX512", False),
])
def test_bf16_auto_follows_the_cpu(monkeypatch, flags, capability, expected):
    _pretend(monkeypatch, flags, capability)
    fast = dr.optimize(build_model("dlrm", hash_buckets=100), dr.Config(bf16="auto"))
    assert fast.config.bf16 is expected
    text = fast.explain()
    assert f"bf16 auto: {'on' if expected else 'off'}: Test CPU" in text
    if not expected:
        assert "stays fp32" in text and fast.main_step is None  # nothing applied: the plain step runs


def test_bf16_auto_stays_fp32_where_bf16_instructions_measure_slower(monkeypatch):
    _pretend(monkeypatch, {"avx512f", "avx512_bf16"}, "AVX512", speedup=0.6)
    fast = dr.optimize(build_model("dlrm", hash_buckets=100), dr.Config(bf16="auto"))
    assert fast.config.bf16 is False
    text = fast.explain()
    assert "bf16 auto: off: Test CPU" in text and "measured 0.60x" in text and "stays fp32" in text


def test_the_bf16_gemm_probe_measures_a_rate():
    # any positive ratio: bf16 emulated on an AVX2-only CPU measured 0.007x fp32 (2 threads), AMX many x
    speedup = hardware.bf16_gemm_speedup()
    assert math.isfinite(speedup) and speedup > 0


def test_bf16_auto_on_the_real_machine_is_decided_and_explained():
    info = hardware.cpu_info()
    assert info["model"] and isinstance(info["flags"], set)
    enabled, why = hardware.fast_bf16(torch.device("cpu"))
    assert isinstance(enabled, bool) and why


def test_bad_bf16_value_is_named():
    with pytest.raises(dr.ConfigError, match="Config.bf16 must be True, False or 'auto'"):
        dr.Config(bf16="yes")


def test_malloc_tuning_applies_in_a_fresh_process():
    import subprocess
    import sys

    code = ("from deeprec.runtime.memory import tune_malloc, minor_faults; import torch; "
            "print(tune_malloc()); before = minor_faults(); x = torch.ones(1 << 22); print(minor_faults() > before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said, faulted = out.stdout.strip().splitlines()
    assert said.startswith("glibc malloc tuned: mmap threshold 32 MiB") and faulted == "True"
