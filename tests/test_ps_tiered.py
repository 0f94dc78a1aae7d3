"""PS shards with tiered storage (--storage ssd): the same updates as a shard in DRAM."""
import os

import pytest
import torch

from deeprec.distributed import PSClient, PSError
from deeprec.distributed.ps.state import ShardState
from deeprec.nn import StorageOption

from conftest import running_ps


def _by_key(state: dict) -> dict:
    order = torch.argsort(state["keys"])
    return {k: v[order] if v.dim() else v for k, v in state.items()}


def _register(state: ShardState) -> None:
    torch.manual_seed(0)
    state.register({"variables": [{"name": n, "kind": "embedding", "dim": 4, "optimizer": "adagrad", "lr": 0.1}
                                  for n in ("a", "b")]},
                   {"defaults/a": torch.randn(16, 4), "defaults/b": torch.randn(16, 4)})


def _request(keys_a, keys_b, **header):
    return ({"embeddings": ["a", "b"], **header},
            {"keys": torch.cat([keys_a, keys_b]), "counts": torch.tensor([keys_a.numel(), keys_b.numel()])})


def test_tiered_shard_equals_dram_shard_async_and_sync(tmp_path):
    plain = ShardState(0, 1)
    tiered = ShardState(0, 1, storage=StorageOption(tiers=["dram", "ssd"], dram_bytes=3000, path=str(tmp_path),
                                                    protect_steps=1))
    for s in (plain, tiered):
        _register(s)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 41):
        draws = [torch.randint(0, 300, (12,), generator=g) for _ in range(4)]  # duplicates included
        grads = [torch.randn(24, 4, generator=g) for _ in range(2)]
        sync = dict(step=step, workers=2) if step % 2 else {}
        for s in (plain, tiered):
            pulled = [s.pull(*_request(draws[0], draws[1]))["values/4"], s.pull(*_request(draws[2], draws[3]))]
            header, tensors = _request(draws[0], draws[1], **sync)
            s.push(header, {**tensors, "grads/4": grads[0]})  # worker 1 (sync: waits for worker 2)
            s.pull(*_request(torch.arange(270, 300), torch.arange(0, 30)))  # other rows move meanwhile
            header, tensors = _request(draws[2], draws[3], **sync)
            s.push(header, {**tensors, "grads/4": grads[1]})
            if s is plain:
                expected = pulled
            else:
                assert torch.equal(pulled[0], expected[0]) and torch.equal(pulled[1]["values/4"],
                                                                           expected[1]["values/4"]), step
    stats = tiered.arenas[next(iter(tiered.arenas))].tier_stats()
    assert stats["disk_rows"] > 0 and stats["disk_reads"] > 0  # rows did go to disk and come back
    a, b = plain.export(), tiered.export()
    for name in ("a", "b"):
        pa = _by_key({k[len(f"emb/{name}/"):]: v for k, v in a.items() if k.startswith(f"emb/{name}/")})
        pb = _by_key({k[len(f"emb/{name}/"):]: v for k, v in b.items() if k.startswith(f"emb/{name}/")})
        for k in pa:
            assert torch.equal(pa[k], pb[k]), (name, k)
    restored = ShardState(0, 1, storage=StorageOption(tiers=["dram", "ssd"], dram_bytes=3000, path=str(tmp_path)))
    _register(restored)
    restored.load(b)
    for part in torch.arange(300).split(10):  # one request's keys must fit DRAM
        probe = _request(part, part, train=False)
        assert torch.equal(restored.pull(*probe)["values/4"], plain.pull(*probe)["values/4"])


@pytest.mark.slow
def test_a_ps_process_serves_from_tiers(tmp_path):
    keys = torch.arange(0, 2000)
    results = []
    for args in ([], ["--storage", "ssd", "--dram-bytes", "100000", "--storage-path", str(tmp_path)]):
        with running_ps("--bind", "127.0.0.1:0", *args) as (proc, line):
            client = PSClient([line.split()[-1]], deadline_s=20)
            client.register({"e": 8}, {}, optimizer="adagrad", lr=0.1)
            for part in keys.split(100):
                client.pull({"e": part})
                client.push({"e": (part, torch.ones(part.numel(), 8) * 0.1)})
            results.append(torch.cat([client.pull({"e": part}, train=False)["e"] for part in keys.split(100)]))
            if args:  # one request's keys must fit DRAM: a clear status, the PS lives on
                with pytest.raises(PSError, match="RESOURCE_EXHAUSTED.*dram_bytes"):
                    client.pull({"e": keys}, train=False)
                assert client.pull({"e": keys[:5]}, train=False)["e"].shape == (5, 8)
            client.close()
    assert torch.equal(results[0], results[1])
    assert os.listdir(tmp_path) == []  # the disk tier's file is unlinked: nothing left behind
