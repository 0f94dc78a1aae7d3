"""The export's AOTInductor package: it scores as the traced program, falls back with a reason, and
follows online updates."""
import json
import os
import shutil

import pytest
import torch

import deeprec as dr
from deeprec.cli import MODEL_SAMPLES, sample_path
from deeprec.data import open_reader
from deeprec.serving import CompiledFallbackWarning, ServedModel, ServingError
from deeprec.serving.frozen import merged
from deeprec.trainer import TrainConfig, Trainer



def _export(tmp_path, model, embedding, compile=True):
    data = sample_path(MODEL_SAMPLES.get(model, "criteo_sample.txt"))
    trainer = Trainer(TrainConfig.create(model=model, data=[data], steps=3, batch_size=64, embedding=embedding,
                                         progress=False))
    trainer.train()
    path = dr.export(trainer.model, str(tmp_path / f"{model}-{embedding}"), schema=trainer.schema, model_name=model,
                     step=3, progress=False, compile=compile)
    return path, data, trainer.schema


def _traced(served: ServedModel, batch) -> torch.Tensor:
    """The scores of the traced program (the ExportedProgram) of the same loaded export."""
    compiled, served.compiled = served.compiled, None
    try:
        return served(batch)
    finally:
        served.compiled = compiled


# The full compile path for the models that differ in what inductor sees (a compile costs 20-60 s on 2
# cores): DLRM's interaction over frozen variables (a sorted-key search), DIN's attention over padded
# sequences, DIEN's GRU over fused table gathers, DSSM's two towers, MMoE's gates and task heads.
# DeepFM and WDL add only MLPs, sums and products of embeddings, which these hold; every model of the
# zoo, with both kinds of embedding, scores exactly through its traced program in tests/test_serving.py.
COMPILED = [("dlrm", "variable"), ("din", "variable"), ("dien", "table"), ("dssm", "variable"), ("mmoe", "table")]


@pytest.mark.slow(reason="an AOTInductor compile each (20-60 s on 2 cores); dlrm-variable's is the fixture's, cached")
@pytest.mark.parametrize("model,embedding", COMPILED, ids=[f"{m}-{e}" for m, e in COMPILED])
def test_the_package_scores_as_the_exported_program(tmp_path, model, embedding):
    path, data, schema = _export(tmp_path, model, embedding)
    served = dr.serving.load(path)
    assert served.compiled is not None, served.compiled_reason
    assert served.manifest["compiled"][0] == "cpu" and os.path.exists(os.path.join(path, "program.cpu.pt2"))
    for size in (50, 7, 2, 1):
        batch = next(iter(open_reader([data], size, schema=schema)))
        got, want = served(batch), _traced(served, batch)
        assert got.shape == want.shape
        # fused kernels may sum in another order: bitwise on most batches, within 1e-6 always
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def dlrm_package(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("compiled"), "dlrm", "variable")


def _copy(path, tmp_path) -> str:
    target = str(tmp_path / "copy")
    shutil.copytree(path, target)
    return target


def _manifest(path, **changes) -> None:
    file = os.path.join(path, "manifest.json")
    with open(file) as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(file, "w") as f:
        json.dump(manifest, f)


@pytest.mark.slow
def test_an_export_without_a_package_is_scored_by_the_traced_program_with_a_warning(tmp_path):
    path, data, schema = _export(tmp_path, "deepfm", "table", compile=False)
    assert not any(name.endswith(".cpu.pt2") for name in os.listdir(path))
    with pytest.warns(CompiledFallbackWarning, match="no compiled cpu package in the export"):
        served = dr.serving.load(path)
    batch = next(iter(open_reader([data], 9, schema=schema)))
    assert served.compiled is None and served(batch).shape == (9,)


@pytest.mark.slow
def test_a_package_for_another_cpu_or_torch_falls_back_naming_why(dlrm_package, tmp_path):
    path = _copy(dlrm_package[0], tmp_path)
    _manifest(path, cpu_capability="SVE256")
    with pytest.warns(CompiledFallbackWarning, match="compiled for CPU capability SVE256, this machine has"):
        assert dr.serving.load(path).compiled is None
    _manifest(path, cpu_capability=torch.backends.cpu.get_cpu_capability(), torch="1.0.0")
    with pytest.warns(CompiledFallbackWarning, match="compiled by torch 1.0.0"):
        assert dr.serving.load(path).compiled is None


@pytest.mark.slow
def test_a_package_from_a_cpu_with_more_instructions_falls_back(dlrm_package, tmp_path):
    path = _copy(dlrm_package[0], tmp_path)
    with open(os.path.join(path, "manifest.json")) as f:
        flags = json.load(f)["cpu_flags"]
    _manifest(path, cpu_flags=flags + ["amx_future_isa"])  # -march=native there: it may use it
    with pytest.warns(CompiledFallbackWarning, match="instructions this one lacks \\(amx_future_isa\\)"):
        assert dr.serving.load(path).compiled is None


@pytest.mark.slow
def test_a_package_that_fails_when_called_hands_over_to_the_traced_program(dlrm_package):
    path, data, schema = dlrm_package
    served = dr.serving.load(path)
    batch = next(iter(open_reader([data], 8, schema=schema)))
    want = _traced(served, batch)

    def broken(batch):
        raise RuntimeError("an illegal kernel")
    served.compiled = broken
    with pytest.warns(CompiledFallbackWarning, match="failed when called \\(RuntimeError: an illegal kernel\\)"):
        assert torch.equal(served(batch), want)
    assert served.compiled is None and torch.equal(served(batch), want)


@pytest.mark.slow
def test_a_tampered_package_is_refused_naming_the_file(dlrm_package, tmp_path):
    path = _copy(dlrm_package[0], tmp_path)
    with open(os.path.join(path, "program.cpu.pt2"), "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 64)
    with pytest.raises(ServingError, match="program.cpu.pt2: missing or corrupt"):
        dr.serving.load(path)
    os.unlink(os.path.join(path, "program.cpu.pt2"))
    with pytest.raises(ServingError, match="program.cpu.pt2: missing or corrupt"):
        dr.serving.load(path)


def _variables(served: ServedModel) -> dict:
    """The frozen EmbeddingVariables of the loaded program (plain submodules there, with their buffers)."""
    names = [name[: -len(".sorted_keys")] for name, _ in served.module.named_buffers() if name.endswith(".sorted_keys")]
    return {name: served.module.get_submodule(name) for name in names}


@pytest.mark.slow
def test_new_keys_fill_the_headroom_and_the_package_follows_them(dlrm_package):
    path, data, schema = dlrm_package
    served = dr.serving.load(path)
    batch = next(iter(open_reader([data], 40, schema=schema)))
    name, frozen = next(iter(_variables(served).items()))
    keys = frozen.sorted_keys[frozen.sorted_keys != torch.iinfo(torch.int64).max]
    rows = frozen.sorted_keys.shape[0]
    assert rows >= keys.shape[0] + 64  # headroom for the keys deltas add

    def updated_with(new_keys: torch.Tensor) -> ServedModel:
        import copy

        served.module = copy.deepcopy(served.module)  # as apply_delta does: the copy is updated
        target = served.module.get_submodule(name)
        values = torch.full((new_keys.shape[0], target.values.shape[1]), 0.25)
        target.sorted_keys, target.values = merged(target.sorted_keys, target.values, new_keys, values,
                                                   float(target.missing_value))
        served.recompiled()
        return served

    before = served(batch)
    # every known key overwritten (rows the batch reads) and 20 new ones fit: the same shapes, compiled
    updated_with(torch.cat([keys, torch.arange(10 ** 12, 10 ** 12 + 20)]))
    assert served.module.get_submodule(name).sorted_keys.shape[0] == rows
    assert served.compiled is not None
    after = served(batch)
    assert not torch.allclose(after, before, rtol=0, atol=1e-6)  # the package reads the new rows
    torch.testing.assert_close(after, _traced(served, batch), rtol=0, atol=1e-6)
    # more keys than the headroom: the index grows, scoring falls back to the traced program, named
    with pytest.warns(CompiledFallbackWarning, match=r"variables\.\d+\.(sorted_keys|values) is now \[[\d, ]+\], the package was compiled for"):
        updated_with(torch.arange(2 * 10 ** 12, 2 * 10 ** 12 + rows))
    assert served.compiled is None and "the package was compiled for" in served.compiled_reason
    assert torch.isfinite(served(batch)).all()


@pytest.mark.slow(reason="trains with a full export and deltas: an AOTInductor compile (20-60 s on 2 cores)")
def test_deltas_keep_the_package_and_bring_it_to_the_trained_model(tmp_path):
    exports = tmp_path / "exports"
    # the full export of step 3 is dlrm_package's program (3 steps of 64 rows: the same shapes), compiled once;
    # deltas at steps 4 and 5 (the last) bring it the new rows, which fit its headroom
    cfg = dict(model="dlrm", data=[sample_path("criteo_sample.txt")], batch_size=64, embedding="variable",
               progress=False)
    trainer = Trainer(TrainConfig.create(steps=5, export_dir=str(exports), export_every=3,
                                         export_incremental_every=4, **cfg))
    trainer.train()
    assert sorted(n for n in os.listdir(exports) if not n.endswith(".safetensors")) == [
        "delta-000000004.json", "delta-000000005.json", "full-000000003"]
    served = dr.serving.load(str(exports))
    assert served.step == 5 and served.compiled is not None, served.compiled_reason
    batch = next(iter(open_reader([sample_path("criteo_sample.txt")], 64, schema=trainer.schema)))
    trainer.model.eval()
    with torch.no_grad():
        want = torch.sigmoid(trainer.model(batch)["logits"])
    torch.testing.assert_close(served(batch), want, rtol=0, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_export_holds_a_cuda_package_that_scores_as_the_cpu_one(tmp_path):
    path, data, schema = _export(tmp_path, "dlrm", "variable")
    assert dr.serving.load(path).manifest["compiled"] == ["cpu", "cuda"]
    on_gpu, on_cpu = dr.serving.load(path, device="cuda"), dr.serving.load(path)
    assert on_gpu.compiled is not None, on_gpu.compiled_reason
    for size in (64, 3, 1):
        batch = next(iter(open_reader([data], size, schema=schema)))
        scores = on_gpu(batch)
        assert scores.device.type == "cpu"
        torch.testing.assert_close(scores, on_cpu(batch), rtol=0, atol=1e-5)
