"""Multi-tier EmbeddingVariable storage: a bounded DRAM cache over a disk tier, equal to all-DRAM."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import deeprec as dr
from deeprec.checkpoint import load_checkpoint
from deeprec.nn.disk_rows import DiskRows
from deeprec.nn.tiered import TieredEmbeddingVariable, tier_summary
from deeprec.optim import sparse
from deeprec.trainer import TrainConfig, Trainer


def _tiered(tmp_path, dram_bytes=4000, **kw) -> dr.StorageOption:
    return dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=dram_bytes, path=str(tmp_path), **kw)


def _ev(storage, optimizer=None, **option):
    ev = dr.nn.embedding_variable(8, ev_option=dr.EmbeddingVariableOption(storage=storage, **option), name="t")
    ev.set_optimizer(optimizer or sparse.Adagrad(lr=0.1))
    return ev


def _by_key(state: dict) -> dict:
    order = torch.argsort(state["keys"])
    return {k: v[order] if v.dim() else v for k, v in state.items()}


def assert_same_rows(a: dict, b: dict) -> None:
    a, b = _by_key(a), _by_key(b)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_model(a: dict, b: dict) -> None:
    """Two model state dicts equal: dense tensors exactly, each EmbeddingVariable's rows by key."""
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".keys"):
            prefix = name[: -len("keys")]
            assert_same_rows({k[len(prefix):]: v for k, v in a.items() if k.startswith(prefix)},
                             {k[len(prefix):]: v for k, v in b.items() if k.startswith(prefix)})
        elif isinstance(a[name], torch.Tensor) and "variables" not in name:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("cache", ["lfu", "lru"])
@pytest.mark.parametrize("optimizer", [lambda: sparse.Adagrad(lr=0.1), lambda: sparse.Adam(lr=0.01)])
def test_training_equals_all_dram_exactly_while_rows_move(tmp_path, cache, optimizer):
    torch.manual_seed(0)
    plain, tiered = _ev(dr.StorageOption(), optimizer()), _ev(_tiered(tmp_path, 12000, cache=cache, protect_steps=1), optimizer())
    assert isinstance(tiered, TieredEmbeddingVariable) and tiered.capacity < 130  # 12 KB: about a hundred rows
    for step in range(80):  # a hot set and a long tail: rows go to disk and come back
        ids = torch.cat([torch.randint(0, 60, (32,)), torch.randint(0, 600, (32,))]).reshape(8, 8)
        outs = []
        for ev in (plain, tiered):
            y = ev(ids)
            (y * torch.arange(8.0)).pow(2).sum().backward()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1]), step
    stats = tiered.tier_stats()
    assert stats["disk_writes"] > 500 and stats["disk_reads"] > 200 and stats["disk_rows"] > 0  # rows did move
    assert tiered.size <= tiered.capacity
    assert_same_rows(plain.export(), tiered.export())


def test_collection_with_delayed_updates_equals_all_dram(tmp_path):
    # micro-batches keep gradients until apply_pending(): rows may go to disk and back before their update
    torch.manual_seed(1)
    features = lambda storage: [dr.nn.EmbeddingFeature(f"f{i}", ev_option=dr.EmbeddingVariableOption(storage=storage))
                                for i in range(3)]
    plain = dr.EmbeddingCollection(features(dr.StorageOption()), 4).set_optimizer(sparse.Adam(lr=0.01), fused=False)
    tiered = dr.EmbeddingCollection(features(_tiered(tmp_path, 12000, protect_steps=1)), 4) \
        .set_optimizer(sparse.Adam(lr=0.01), fused=False)
    for step in range(30):
        for _ in range(3):  # three backwards, one step
            ids = {f"f{i}": torch.randint(0, 400, (32,)) for i in range(3)}
            for c in (plain, tiered):
                c(ids).pow(2).sum().backward()
        plain.apply_pending(), tiered.apply_pending()
    for a, b in zip(plain.lookup.variables, tiered.lookup.variables):
        assert b.tier_stats()["disk_rows"] > 0
        assert_same_rows(a.export(), b.export())


def _fill(ev, n: int, chunk: int = 10) -> None:
    """Train keys 0..n-1 a few at a time (one lookup's keys must fit DRAM): most end on disk."""
    for start in range(0, n, chunk):
        ev(torch.arange(start, min(n, start + chunk))).sum().backward()


def _read(ev, keys: torch.Tensor, chunk: int = 10) -> torch.Tensor:
    return torch.cat([ev(part) for part in keys.split(chunk)])


def test_cold_rows_are_read_in_one_batch_per_lookup(tmp_path, monkeypatch):
    ev = _ev(_tiered(tmp_path, 3000, protect_steps=1))
    _fill(ev, 500)
    reads, original = [], DiskRows.read
    monkeypatch.setattr(DiskRows, "read", lambda self, slots: reads.append(slots.numel()) or original(self, slots))
    before, cold = ev.tier_stats()["disk_reads"], ev.disk.ints[ev.disk.live()[:20], 0].clone()
    ev(torch.cat([cold, torch.arange(3)])).sum().backward()
    assert len(reads) == 1 and reads[0] == ev.tier_stats()["disk_reads"] - before == 20


def test_prefetch_makes_the_next_lookup_hit_dram(tmp_path):
    ev = _ev(_tiered(tmp_path, 3000, protect_steps=1))
    _fill(ev, 500)
    before, cold = ev.tier_stats(), ev.disk.ints[ev.disk.live()[:20], 0].clone()
    ev.prefetch_rows(cold)
    ev(cold).sum().backward()
    after = ev.tier_stats()
    assert after["prefetched"] - before["prefetched"] == 20
    assert after["hits"] - before["hits"] == 20 and after["disk_reads"] == before["disk_reads"]


def test_a_prefetch_never_makes_a_lookup_fail(tmp_path):
    ev = _ev(_tiered(tmp_path, 6000))  # 60 rows; rows of the last 4 lookups are protected
    _fill(ev, 500)
    cold = ev.disk.ints[ev.disk.live(), 0].clone()
    ev.prefetch_rows(cold[:40])  # no room for 40 without evicting protected rows: skipped, nothing changed
    assert ev.tier_stats()["prefetch_skipped"] == 1 and ev.tier_stats()["prefetched"] == 0
    ev.prefetch_rows(cold[40:55])
    assert ev.tier_stats()["prefetched"] == 15
    before = ev.tier_stats()["disk_reads"]
    ev(cold[60:80]).sum().backward()  # 30 rows protected + 15 staged: 15 evictable the usual way  # room only by evicting rows prefetched for a later batch: it does
    assert ev.tier_stats()["disk_reads"] - before == 20


def test_eviction_policy_checkpoints_and_incremental_match_all_dram(tmp_path):
    evict = dict(evict_option=dr.GlobalStepEvict(steps_to_live=5))
    plain, tiered = _ev(dr.StorageOption(), **evict), _ev(_tiered(tmp_path, 10000, protect_steps=1), **evict)
    for step in range(20):
        ids = torch.arange(step * 30, step * 30 + 60) % 700
        for ev in (plain, tiered):
            ev(ids).sum().backward()
        if step == 9:
            assert_same_rows(plain.export(), tiered.export())  # drops keys not updated in 5 steps
    assert tiered.tier_stats()["disk_rows"] > 0
    assert_same_rows(plain.export(incremental=True), tiered.export(incremental=True))
    restored = _ev(_tiered(tmp_path, 3000, protect_steps=1))
    restored.load(plain.export())
    assert restored.tier_stats()["disk_rows"] > 0  # what did not fit DRAM was loaded onto disk
    assert_same_rows(plain.export(), restored.export())
    for ev in (plain, restored):
        ev.eval()
    probe = torch.arange(0, 800)
    assert torch.equal(plain(probe), _read(restored, probe))


def test_serving_export_of_a_tiered_model_reads_every_row(tmp_path):
    ev = _ev(_tiered(tmp_path, 3000, protect_steps=1))
    _fill(ev, 400)
    copy = __import__("copy").deepcopy(ev)  # dr.export freezes a deep copy: an all-DRAM variable
    assert type(copy) is dr.EmbeddingVariable and copy.size == 400
    ev.eval(), copy.eval()
    assert torch.equal(copy(torch.arange(420)), _read(ev, torch.arange(420)))
    keys, values = ev.snapshot()
    assert keys.numel() == 400 and torch.equal(values[torch.argsort(keys)], copy(torch.arange(400)))


def test_dram_too_small_and_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(dr.ConfigError, match="--storage ssd needs --dram-bytes"):
        dr.StorageOption(tiers=["dram", "ssd"])
    with pytest.raises(dr.ConfigError, match=r"--dram-bytes \(storage.dram_bytes in a config file\): expected `int` >= 1"):
        dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=0)
    with pytest.raises(dr.ConfigError, match="tiers=.*is not allowed"):
        dr.StorageOption(tiers=["ssd"], dram_bytes=10)
    with pytest.raises(dr.ConfigError, match="--cache .*'fifo' is not allowed; choose one of lfu, lru"):
        dr.StorageOption(tiers=["dram", "ssd"], dram_bytes=10, cache="fifo")
    assert dr.StorageOption(tiers=["dram", "ssd"], dram_bytes="512M").dram_bytes == 512 * 1024 ** 2
    ev = _ev(_tiered(tmp_path, 2000))
    with pytest.raises(dr.ConfigError, match="holds 20 rows, too few for the rows of the last 4 lookups"):
        ev(torch.arange(100))  # one lookup's keys must fit DRAM


def test_lfu_keeps_hot_rows_in_dram(tmp_path):
    ev = _ev(_tiered(tmp_path, 4000, cache="lfu", protect_steps=1))
    hot = torch.arange(5)
    for step in range(40):
        ev(torch.cat([hot, 100 + torch.arange(step * 10, step * 10 + 10)])).sum().backward()
    rows = ev._index.lookup(hot)
    assert bool((rows >= 0).all())  # the hot keys were never evicted
    assert ev.tier_stats()["disk_rows"] > 200


def test_trainer_with_ssd_tier_trains_like_dram_and_reports_tiers(tmp_path, unique_tsv, small_model):
    def run(name, **kw):
        cfg = TrainConfig.create(model="dlrm", data=[unique_tsv], batch_size=128, seed=4, steps=90,
                                 embedding="variable", model_overrides=small_model, progress=False,
                                 checkpoint_dir=str(tmp_path / name), optimizer="adagrad", lr=0.05, **kw)
        trainer = Trainer(cfg)
        return trainer, trainer.train()
    stage = dict(smart_stage=True, main_threads=1, smart_stage_options=dict(capacity=2, num_threads=1,
                                                                            executor="thread"))
    plain, a = run("plain", optimize=stage)
    tiered, b = run("tiered", optimize=stage, storage="ssd", dram_bytes=26 * 162 * 900, storage_path=str(tmp_path / "t"))
    assert a["final_loss"] == b["final_loss"]
    tiers = b["tiers"]
    assert tiers["variables"] == 26 and tiers["disk_rows"] > 0 and tiers["prefetched"] > 0
    assert tier_summary(tiered.model)["hit_rate"] == tiers["hit_rate"]
    assert "tiered storage" in tiered.fast.explain() and "promote the next batch's rows" in tiered.fast.explain()
    assert_same_model(*(load_checkpoint(os.path.join(tmp_path / n, "checkpoint-000000090.pt"))["model"]
                        for n in ("plain", "tiered")))
    assert os.listdir(tmp_path / "t") == []  # the disk tier's files are unlinked at creation


@pytest.mark.slow
def test_a_killed_tiered_run_resumes_from_its_checkpoint(tmp_path, unique_tsv):
    config = tmp_path / "run.toml"
    config.write_text('[model_overrides]\nbottom_mlp = [32, 16]\ntop_mlp = [32]\n')
    steps, tiers = 40, tmp_path / "tiers"

    def command(ckpt):
        return [sys.executable, "-m", "deeprec", "train", "--config", str(config), "--data", unique_tsv,
                "--batch-size", "128", "--seed", "4", "--steps", str(steps), "--embedding", "variable",
                "--optimizer", "adagrad", "--storage", "ssd", "--dram-bytes", str(26 * 162 * 2000), "--storage-path", str(tiers),
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--resume", "--no-progress"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    def reached() -> bool:
        return killed.is_dir() and any(n.startswith("checkpoint-000000015") for n in os.listdir(killed))
    while proc.poll() is None and time.monotonic() < deadline and not reached():
        time.sleep(0.01)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert os.listdir(tiers) == []  # nothing of the killed run's disk tier is left to resume from
    resumed = subprocess.run(command(killed), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full = tmp_path / "full"
    subprocess.run(command(full), check=True, capture_output=True, timeout=180)
    last = f"checkpoint-{steps:09d}.pt"
    assert_same_model(load_checkpoint(str(killed / last))["model"], load_checkpoint(str(full / last))["model"])
