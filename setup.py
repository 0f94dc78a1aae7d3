"""Builds deeprec's C++ extension of torch custom ops (deeprec/csrc) at install.

Metadata lives in pyproject.toml. Build with the installed torch:
`pip install --no-build-isolation -e .` (what `make` runs), so the extension
links against the very torch it will load into.
"""
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers (serial without it); the link names
# libgomp.so.1, which resolves to the one torch has loaded. Only where torch runs on GNU OpenMP.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info() else []

setup(
    ext_modules=[CppExtension("deeprec._C", ["deeprec/csrc/feature_ops.cpp", "deeprec/csrc/bags.cpp",
                               "deeprec/csrc/key_index.cpp", "deeprec/csrc/ev_lookup.cpp", "deeprec/csrc/sparse_optim.cpp",
                               "deeprec/csrc/ps_rows.cpp", "deeprec/csrc/step_ops.cpp", "deeprec/csrc/linear_relu.cpp",
                               "deeprec/csrc/request_columns.cpp"],
                              depends=["deeprec/csrc/hashes.h", "deeprec/csrc/key_index.h", "deeprec/csrc/clones.h"],
                              extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off", *OPENMP],
                              extra_link_args=OPENMP)],
    cmdclass={"build_ext": BuildExtension},
)
