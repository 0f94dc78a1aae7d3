"""--device: resolution and refusals on any machine; training on a GPU where one is present
(`pytest -m cuda`: these run wherever torch sees CUDA and are skipped elsewhere)."""
import pytest
import torch

from deeprec.errors import ConfigError
from deeprec.runtime import device as placement
from deeprec.runtime.device import DeviceBatches, place_model, resolve_device, to_device
from deeprec.distributed.ps.strategy import ParameterServer
from deeprec.trainer import TrainConfig, train

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_device_resolution_and_refusals(sample):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                      else torch.device("cpu"))
    with pytest.raises(ConfigError, match="device='tpu' is not allowed; choose one of cpu, cuda, auto"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="parameter-server training runs on the CPU"):
        ParameterServer(["127.0.0.1:1"]).validate(TrainConfig.create(data=[sample], device="cuda"))


def test_cpu_placement_leaves_model_and_batches_alone(sample):
    from deeprec.data import CriteoReader
    from deeprec.models import build_model

    model = build_model("dlrm", hash_buckets=100, embedding="table")
    before = {k: v.data_ptr() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert place_model(model, torch.device("cpu")) == []
    assert before == {k: v.data_ptr() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    reader = CriteoReader(sample, 64)
    batches = DeviceBatches(reader, torch.device("cpu"))
    first = next(iter(batches))
    assert batches.state_dict() == reader.state_dict() and to_device(first, torch.device("cpu")) is first


def _run(sample, tmp_path, **kw) -> dict:
    return train(TrainConfig.create(data=[sample], steps=6, batch_size=64, progress=False, seed=1,
                                    model_overrides={"hash_buckets": 1000}, **kw))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("embedding,smart_stage", [("table", False), ("table", True), ("variable", False)])
def test_cuda_training_matches_cpu(sample, tmp_path, embedding, smart_stage):
    kw = dict(embedding=embedding, optimize={"smart_stage": smart_stage, "smart_stage_options": {"executor": "thread"}})
    on_gpu, on_cpu = _run(sample, tmp_path, device="cuda", **kw), _run(sample, tmp_path, device="cpu", **kw)
    assert on_gpu["device"].startswith("cuda")
    assert ("collection" in " ".join(on_gpu["tables_on_host"])) == (embedding == "variable")  # EVs stay on the host
    assert on_gpu["final_loss"] == pytest.approx(on_cpu["final_loss"], rel=1e-3, abs=1e-4)


@pytest.mark.cuda
@cuda
def test_cuda_tables_that_do_not_fit_stay_on_the_host(sample, tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "DEVICE_MEMORY_SHARE", 1e-12)
    on_gpu = _run(sample, tmp_path, device="cuda", embedding="table")
    on_cpu = _run(sample, tmp_path, device="cpu", embedding="table")
    assert on_gpu["tables_on_host"]  # the fixed tables were kept on the host, rows moved per step
    assert on_gpu["final_loss"] == pytest.approx(on_cpu["final_loss"], rel=1e-3, abs=1e-4)
