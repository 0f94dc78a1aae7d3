"""Every SmartStageOptions field of the prefetch runtime, and thread hygiene."""
import logging
import threading
import time
import traceback

import pytest
import torch
from torch import nn

import deeprec as dr
from deeprec import ops
from deeprec.data import CriteoReader
from deeprec.models import build_model
from deeprec.runtime import PrefetchRunner
from waits import wait_until


def drain(runner):
    out = []
    while True:
        try:
            out.append(runner.take())
        except StopIteration:
            return out


def run_all(source, stage, **opts):
    runner = PrefetchRunner(source, stage, dr.SmartStageOptions(**opts))
    try:
        return [item.values for item in drain(runner)], runner
    finally:
        runner.close()


def deeprec_threads(before=()):
    """deeprec's threads not among `before` (those an earlier test left: a PS client's pool, fs's
    process-wide pool of ranged GETs, are not this test's)."""
    return [t for t in threading.enumerate() if t.name.startswith("deeprec-") and t not in before]


def test_defaults_are_the_seeds():
    o = dr.SmartStageOptions()
    assert (o.capacity, o.num_threads, o.num_clients, o.timeout_millis) == (1, 1, 1, 300000)
    assert o.closed_exception_types == (StopIteration, dr.OutOfRangeError) and o.ignored_exception_types == ()
    assert (o.use_stage_subgraph_thread_pool, o.stage_subgraph_thread_pool_id, o.stage_subgraph_stream_id,
            o.name) == (False, 0, 0, None)
    with pytest.raises(dr.ConfigError, match="--capacity .*expected `int` >= 1"):
        dr.SmartStageOptions(capacity=0)
    with pytest.raises(dr.ConfigError, match="must hold exception classes"):
        dr.SmartStageOptions(ignored_exception_types=("ValueError",))


def test_capacity_bounds_results_held_ahead():
    held = []
    runner = PrefetchRunner(range(30), lambda x: x, dr.SmartStageOptions(capacity=3, num_threads=2))
    try:
        for _ in range(10):
            time.sleep(0.02)  # slow consumer: runners fill the buffer and wait
            with runner._cond:
                held.append(len(runner._buffer))
            runner.take()
    finally:
        runner.close()
    assert max(held) == 3


def test_num_threads_run_concurrently_and_order_is_kept():
    seen_threads = set()

    def stage(x):
        seen_threads.add(threading.current_thread().name)
        time.sleep(0.002 * (x % 4))  # later items often finish first
        return x

    values, runner = run_all(range(40), stage, num_threads=3, capacity=4)
    assert values == list(range(40)) and len(seen_threads) == 3
    assert runner.stats.taken == runner.stats.pulled == 40


def test_unordered_delivers_everything_in_completion_order():
    def stage(x):
        time.sleep(0.03 if x == 0 else 0.0)  # item 0 is slow
        return x

    values, _ = run_all(range(12), stage, num_threads=3, capacity=12, ordered=False)
    assert sorted(values) == list(range(12)) and values[0] != 0


def test_num_clients_share_the_stream():
    runner = PrefetchRunner(range(200), lambda x: x, dr.SmartStageOptions(num_clients=2, capacity=2))
    got = {0: [], 1: []}

    def client(k):
        try:
            while True:
                got[k].append(runner.take().values)
        except StopIteration:
            runner.client_finished()

    threads = [threading.Thread(target=client, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got[0] + got[1]) == list(range(200)) and not set(got[0]) & set(got[1])
    assert not any(t.is_alive() for t in runner.threads)  # the last client closed the runner


def test_timeout_drops_results_loudly(caplog):
    runner = PrefetchRunner(range(6), lambda x: x, dr.SmartStageOptions(capacity=1, timeout_millis=30))
    try:
        wait_until(lambda: runner.stats.dropped >= 1, 10, "a result timed out")  # nobody takes: it drops
        values = [item.values for item in drain(runner)]
    finally:
        runner.close()
    assert runner.stats.dropped >= 1 and len(values) + runner.stats.dropped == 6
    assert values == sorted(values) and values[0] == 0
    assert "dropped prefetched batch" in caplog.text and "timeout_millis=30" in caplog.text


class OutOfData(Exception):
    pass


def source_then(exc, n=5):
    yield from range(n)
    raise exc


@pytest.mark.parametrize("exc,closed", [(dr.OutOfRangeError("end"), (StopIteration, dr.OutOfRangeError)),
                                        (OutOfData("no more"), (OutOfData,))])
def test_closed_exceptions_end_the_stream_cleanly(exc, closed):
    values, runner = run_all(source_then(exc), lambda x: x * 10, closed_exception_types=closed, capacity=2)
    assert values == [0, 10, 20, 30, 40]


def test_ignored_exceptions_skip_the_batch(caplog):
    def stage(x):
        if x == 3:
            raise ValueError("bad batch 3")
        return x

    with caplog.at_level(logging.WARNING, "deeprec.prefetch"):
        values, runner = run_all(range(7), stage, ignored_exception_types=(ValueError,), num_threads=2)
    assert values == [0, 1, 2, 4, 5, 6] and runner.stats.ignored == 1
    assert "skipping batch 3 after ignored ValueError: bad batch 3" in caplog.text


def stage_that_fails(x):
    if x == 4:
        raise KeyError("missing column C9")
    return x


def take_until(runner, error, match):
    """Values taken before `error` is raised in the loop, and the raised exception."""
    got = []
    with pytest.raises(error, match=match) as err:
        while True:
            got.append(runner.take().values)
    runner.close()
    return got, err.value


def test_other_exceptions_reach_the_loop_with_their_traceback():
    runner = PrefetchRunner(range(100), stage_that_fails, dr.SmartStageOptions(capacity=2, num_threads=2))
    got, err = take_until(runner, KeyError, "missing column C9")
    assert got == [0, 1, 2, 3]
    assert "stage_that_fails" in [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert not any(t.is_alive() for t in runner.threads)


def test_reader_errors_are_raised_too():
    runner = PrefetchRunner(iter_raising(), lambda x: x, dr.SmartStageOptions())
    with pytest.raises(dr.DataError, match="broken.tsv:7"):
        drain(runner)
    runner.close()


def iter_raising():
    yield 1
    raise dr.DataError("bad row", "broken.tsv", 7)


def test_thread_pool_runs_the_stage_with_its_intra_op_threads():
    seen = []

    def stage(x):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return x

    pool = dr.ThreadPoolOptions(num_threads=2, intra_op_threads=1, name="stagepool")
    runner = PrefetchRunner(range(8), stage, dr.SmartStageOptions(use_stage_subgraph_thread_pool=True),
                            pool=pool)
    values = [i.values for i in drain(runner)]
    runner.close()
    assert values == list(range(8))
    assert all(name.startswith("deeprec-stagepool") and n == 1 for name, n in seen)


def test_bad_thread_pool_id_is_a_clear_error():
    opts = dr.SmartStageOptions(use_stage_subgraph_thread_pool=True, stage_subgraph_thread_pool_id=2)
    with pytest.raises(dr.ConfigError, match=r"stage_subgraph_thread_pool_id=2 but Config.stage_thread_pools "
                                             r"declares 1 pool\(s\) \(ids 0..0\)"):
        dr.Config(smart_stage=True, smart_stage_options=opts, stage_thread_pools=[dr.ThreadPoolOptions()])
    with pytest.raises(dr.ConfigError, match=r"declares 0 pool\(s\) \(none\)"):
        dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(use_stage_subgraph_thread_pool=True))


def test_stage_subgraph_on_cpu_is_a_noop_on_cpu_models(sample):
    model = build_model("dlrm", hash_buckets=100)
    cfg = dr.Config(smart_stage=True, stage_subgraph_on_cpu=True,
                    smart_stage_options=dr.SmartStageOptions(stage_subgraph_stream_id=1))
    fast = dr.optimize(model, cfg)
    losses = [o["loss"].item() for o in fast.iterate(CriteoReader(sample, 64))]
    assert losses == [model(b)["loss"].item() for b in CriteoReader(sample, 64)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_copy_on_side_stream_matches_plain_copy(sample):
    torch.manual_seed(0)
    model = build_model("dlrm", hash_buckets=100).cuda()
    cfg = dr.Config(smart_stage=True, stage_subgraph_on_cpu=True,
                    smart_stage_options=dr.SmartStageOptions(capacity=2, stage_subgraph_stream_id=1))
    fast = dr.optimize(model, cfg)
    got = [o["logits"].cpu() for o in fast.iterate(CriteoReader(sample, 64))]
    plain = dr.optimize(model, dr.Config(smart_stage=True))
    ref = [plain(b)["logits"].cpu() for b in CriteoReader(sample, 64)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, batch):
        return {"loss": (ops.log_normalize(ops.fill_missing(batch["I1"])) * self.w).sum()}


def tiny_batches(n=20):
    return [{"I1": torch.full((4,), float(i))} for i in range(n)]


def test_prefetch_hook_in_a_hand_written_loop():
    model = Tiny()
    fast = dr.optimize(model, dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(capacity=4)))
    losses = []
    with dr.make_prefetch_hook(fast, tiny_batches()) as batches:
        for staged in batches:
            losses.append(fast(staged)["loss"].item())
        assert batches.stats.taken == 20
    assert losses == [model(b)["loss"].item() for b in tiny_batches()]


@pytest.mark.parametrize("ending", ["normal", "exception", "break"])
def test_no_thread_outlives_its_loop(ending):
    fast = dr.optimize(Tiny(), dr.Config(smart_stage=True,
                                         smart_stage_options=dr.SmartStageOptions(capacity=2, num_threads=3)))
    before = set(threading.enumerate())
    threads_before = torch.get_num_threads()

    def loop():
        for i, out in enumerate(fast.iterate(tiny_batches(50))):
            if i == 2:  # the stage is running (50 batches, only 2 buffered ahead)
                assert len(deeprec_threads(before)) == 3
            if ending == "exception" and i == 5:
                raise RuntimeError("user code failed")
            if ending == "break" and i == 5:
                break

    if ending == "exception":
        with pytest.raises(RuntimeError, match="user code failed"):
            loop()
    else:
        loop()
    # none of ours may stay; other libraries' threads (e.g. inductor's compile-worker timer, left by an
    # earlier test's export) may start or end meanwhile: they are not the loop's
    new = set(threading.enumerate()) - before
    ours = [t.name for t in new if t.name.startswith("deeprec")
            or getattr(getattr(t, "_target", None), "__module__", "").startswith("deeprec")]
    assert deeprec_threads(before) == [] and ours == [], [t.name for t in new]
    assert torch.get_num_threads() == threads_before  # the main step's thread budget is restored


def test_hook_sets_the_thread_budget():
    fast = dr.optimize(Tiny(), dr.Config(smart_stage=True, main_threads=1))
    with dr.make_prefetch_hook(fast, tiny_batches()) as batches:
        assert torch.get_num_threads() == 1
        assert len(list(batches)) == 20


# -- executor="process": the stage in a worker process ---------------------------------------
PROCESS = dict(executor="process", capacity=3)


def double(x):
    return torch.tensor([x * 2])


def test_process_executor_delivers_in_order_with_reader_position(sample):
    reader = CriteoReader(sample, 32)
    runner = PrefetchRunner(reader, lambda_free_stage, dr.SmartStageOptions(**PROCESS))
    items = drain(runner)
    runner.close()
    assert [i.source_state["batches"] for i in items] == [1, 2, 3, 4, 5, 6, 7]
    first = next(iter(CriteoReader(sample, 32)))
    ids, label, names = items[0].values
    assert torch.equal(ids, ops.string_to_hash_bucket(first["C3"], 1000)) and torch.equal(label, first["label"])
    assert names.tolist() == first["C1"].tolist()  # raw strings cross too
    assert not runner._process_source.process.is_alive()


def lambda_free_stage(batch):
    return ops.string_to_hash_bucket(batch["C3"], 1000), batch["label"], batch["C1"]


def test_process_executor_errors_keep_their_type_and_remote_traceback():
    runner = PrefetchRunner(range(100), stage_that_fails, dr.SmartStageOptions(**PROCESS))
    got, err = take_until(runner, KeyError, "missing column C9")
    assert got == [0, 1, 2, 3]
    assert "stage_that_fails" in str(err.__cause__)
    assert not runner._process_source.process.is_alive()


def stage_ignoring(x):
    if x == 2:
        raise ValueError("skip me")
    return torch.tensor([x])


def test_process_executor_closed_and_ignored(caplog):
    opts = dict(PROCESS, ignored_exception_types=(ValueError,))
    values, runner = run_all(range(5), stage_ignoring, **opts)
    assert [int(v) for v in values] == [0, 1, 3, 4] and runner.stats.ignored == 1
    assert "ValueError: skip me" in caplog.text


@pytest.mark.slow
def test_process_executor_model_outputs_identical_and_process_stopped_on_break(sample):
    import multiprocessing

    before = set(threading.enumerate())
    model = build_model("dlrm", hash_buckets=200)
    fast = dr.optimize(model, dr.Config(smart_stage=True, smart_stage_options=dr.SmartStageOptions(**PROCESS)))
    losses = [o["loss"].item() for o in fast.iterate(CriteoReader(sample, 40))]
    assert losses == [model(b)["loss"].item() for b in CriteoReader(sample, 40)]
    for i, _ in enumerate(fast.iterate(CriteoReader(sample, 10, num_epochs=None))):
        if i == 3:
            break
    assert multiprocessing.active_children() == [] and deeprec_threads(before) == []


def test_process_executor_needs_picklable_input():
    with pytest.raises(dr.ConfigError, match="must be picklable"):
        PrefetchRunner((i for i in range(3)), double, dr.SmartStageOptions(**PROCESS))
    with pytest.raises(dr.ConfigError, match="num_threads=1"):
        dr.SmartStageOptions(executor="process", num_threads=2)
    with pytest.raises(dr.ConfigError, match="--stage-executor .*'fiber' is not allowed"):
        dr.SmartStageOptions(executor="fiber")
