"""A delta whose rows do not fit the served table (another dim, 2-D keys) is refused before it
changes anything, not an error at every refresh: the server stays at its version and says why."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deeprec.atomic import sha256_file
from deeprec.serving.online import ExportFolder

from test_serving_hardening import _export_dir, dlrm  # noqa: F401  (dlrm: the fixture)


def _row_delta(live, name: str, keys: torch.Tensor, values: torch.Tensor) -> str:
    base = str(live / "delta-000000004")
    save_file({f"{name}.keys": keys, f"{name}.values": values}, base + ".safetensors")
    with open(base + ".json", "w") as f:
        json.dump({"format": 1, "step": 4, "after": 3, "variables": [name],
                   "sha256": sha256_file(base + ".safetensors")}, f)
    return base + ".json"


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["dim", "keys"])
def test_a_delta_with_rows_of_the_wrong_shape_is_refused(dlrm, tmp_path, shape):  # noqa: F811
    path, _ = dlrm
    live = _export_dir(tmp_path, path)
    folder = ExportFolder(str(live), lenient=True)
    model = folder.load()
    name, table = next((n, m) for n, m in model.module.named_modules() if hasattr(m, "sorted_keys"))
    dim = table.values.shape[1]
    keys, values = torch.tensor([1, 2]), torch.ones(2, dim + 1)
    if shape == "keys":
        keys, values = torch.tensor([[1, 2]]), torch.ones(2, dim)
    delta = _row_delta(live, name, keys, values)
    assert folder.refresh(model) is None  # refused, not raised
    assert delta in folder.refused and f"variable {name!r}" in folder.refused[delta], folder.refused
