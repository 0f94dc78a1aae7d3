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


def test_a_delta_to_tied_weights_updates_every_name_of_them():
    """A weight under two names (a user's tied layers, tie_shared's aliases) is in a delta once; the
    update replaces tensors (the old ones may be shared with the model serving), so both names take it."""
    from deeprec.serving.online import _merge_delta

    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    module[1].weight = module[0].weight
    old = module[0].weight.detach().clone()
    new = torch.arange(9.0).reshape(3, 3)
    _merge_delta(module, {"variables": []}, {"0.weight": new}, "delta")
    assert torch.equal(module[0].weight, new) and torch.equal(module[1].weight, new)
    assert module[0].weight.data_ptr() == module[1].weight.data_ptr() and not torch.equal(old, new)
