"""`python -m deeprec.serving.check_package EXPORT DEVICE`: load an export's compiled package and
score an example batch; exit 0 if it matches the traced program. The export runs it in a child
process (serving.export.verify) before listing a package: a loader that crashes takes only the child.
"""
from __future__ import annotations

import sys
import warnings

import torch

from deeprec.serving import CompiledFallbackWarning, ServedModel
from deeprec.serving.example import example_batch


def check(export_dir: str, device: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=CompiledFallbackWarning)  # a fallback is a failure here
        served = ServedModel(export_dir, device)
    for rows in (7, 1) if served.any_size else (7,):  # a package that scores 1 row as it is: that too
        batch = example_batch(served.schema, rows)
        compiled, served.compiled = served.compiled, None
        want = served.logits(batch)
        served.compiled = compiled
        got = served.logits(batch)
        if not torch.allclose(got, want, rtol=0, atol=1e-5):  # a sanity check; the tests hold 1e-6
            raise SystemExit(f"{rows} row(s): scores differ from the traced program's by "
                             f"{float((got - want).abs().max())}")


if __name__ == "__main__":
    check(sys.argv[1], sys.argv[2])
