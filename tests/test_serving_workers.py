"""deeprec serve --workers N: worker processes on one port (SO_REUSEPORT) under a supervisor, each serving
gRPC on one gRPC port too; the export's tables mapped, not copied (serving.mapped). Real processes on
loopback; every wait is on a state."""
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import torch

import deeprec as dr
from deeprec.cli import sample_path
from deeprec.serving.workers import HEADER, thread_budget
from deeprec.trainer import Trainer

from test_serving import _json_rows, _online_cfg
from waits import wait_until

WORKERS = 2


def _tables(path: str) -> str:
    return os.path.join(path, "tables.safetensors")


def _mapped_files(maps: str) -> dict[str, list[tuple[int, int]]]:
    """{path: [(low, high), ...]} of the file mappings in a /proc/PID/maps text."""
    found: dict[str, list] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            found.setdefault(fields[5].removesuffix(" (deleted)"), []).append((low, high))
    return found


def _in_mapping(tensor: torch.Tensor, file: str) -> bool:
    with open("/proc/self/maps") as f:
        ranges = _mapped_files(f.read()).get(os.path.realpath(file), [])
    return any(low <= tensor.data_ptr() < high for low, high in ranges)


class Server:
    """`deeprec serve ARGS` in a process: its stdout lines in a queue, its stderr in a file."""

    def __init__(self, args: list[str], stderr_path):
        self.stderr_path = stderr_path
        with open(stderr_path, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-m", "deeprec", "serve", *args], stdout=subprocess.PIPE,
                                         stderr=stderr, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def line(self, timeout: float = 180) -> str | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the server within {timeout} s; stderr:\n{self.stderr()}") from None

    def stderr(self) -> str:
        with open(self.stderr_path) as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ask(url: str, path: str = "/healthz", **kw) -> httpx.Response:
    """One request on a fresh connection (the kernel picks the worker per connection)."""
    with httpx.Client(timeout=60) as client:
        return client.request("POST" if "json" in kw else "GET", url + path, **kw)


def _worker_of(reply: httpx.Response) -> int:
    return int(reply.headers[HEADER])


def _each_worker(url: str, pids: set, ask, what: str, timeout: float = 60) -> dict:
    """{pid: ask()'s reply} with a reply from every worker in `pids`, on fresh connections."""
    seen: dict = {}

    def all_seen():
        reply = ask()
        seen[_worker_of(reply)] = reply
        return pids <= set(seen)

    wait_until(all_seen, timeout, what, poll=0)
    return seen


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped yet
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A training's export dir (full exports at steps 5 and 10, deltas 6, 8, 11), its schema."""
    folder = tmp_path_factory.mktemp("workers")
    trainer = Trainer(_online_cfg(folder, 11, export_dir=str(folder / "exports"), export_every=5,
                                  export_incremental_every=2))
    trainer.train()
    return folder / "exports", trainer.schema


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    """`deeprec serve LIVE --workers 2 --grpc-port 0`, LIVE the export dir holding full-10 only (deltas
    copied in by a test): (url, the printed worker pids, Server, LIVE); Server.grpc: the printed gRPC
    host:port."""
    source, _ = exports
    live = tmp_path_factory.mktemp("live")
    shutil.copytree(source / "full-000000010", live / "full-000000010")
    running = Server([str(live), "--port", "0", "--grpc-port", "0", "--workers", str(WORKERS),
                      "--watch-interval", "0.2"], tmp_path_factory.mktemp("log") / "stderr.txt")
    try:
        line = running.line()
        assert line and line.startswith("listening on http://127.0.0.1:"), (line, running.stderr())
        assert running.line() == f"model: {live.name}\n"
        grpc_line = running.line()  # once, by the supervisor: every worker's gRPC service answers
        assert grpc_line and grpc_line.startswith("grpc listening on 127.0.0.1:"), (grpc_line, running.stderr())
        running.grpc = grpc_line.split()[-1]
        assert running.grpc != line.split()[-1].removeprefix("http://")  # --grpc-port 0: a port of its own
        workers = running.line()
        assert workers.startswith(f"workers: {WORKERS} (pids "), workers
        pids = {int(p) for p in workers.split("pids ")[1].rstrip(")\n").split(", ")}
        yield line.split()[-1], pids, running, live
    finally:
        running.stop()


def test_thread_budget():
    assert thread_budget(2, None, 8) == (3, None)  # 2 x (loop + 3) = 8 cores
    assert thread_budget(4, None, 16) == (3, None)
    per, warning = thread_budget(2, None, 2)  # 2 workers on 2 cores: at least a thread each, said
    assert per == 1 and "4 busy threads on 2 cores" in warning
    per, warning = thread_budget(2, 4, 8)  # the user's --threads oversubscribes
    assert per == 4 and "10 busy threads on 8 cores" in warning and "--threads 3" in warning


def test_the_port_is_held_by_the_supervisor_and_one_in_use_is_refused():
    from deeprec.errors import ConfigError
    from deeprec.serving.workers import reserve, supervise

    held = reserve("127.0.0.1", 0)  # --port 0: a free port, held (bound, not listening)
    try:
        port = held.getsockname()[1]
        again = reserve("127.0.0.1", port)  # the workers bind it too (SO_REUSEPORT)
        again.close()
        with socket.socket() as other:  # a socket without SO_REUSEPORT cannot take it meanwhile
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
    finally:
        held.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=f"--port {taken.getsockname()[1]}: cannot listen there"):
            reserve("127.0.0.1", taken.getsockname()[1])
    with socket.socket() as foreign:  # another server listening with SO_REUSEPORT (grpc's default): not joined
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        with pytest.raises(ConfigError, match=f"--port {foreign.getsockname()[1]}: cannot listen there"):
            reserve("127.0.0.1", foreign.getsockname()[1])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # --grpc-port too: refused in the supervisor, before any worker starts
        with pytest.raises(ConfigError, match=f"--grpc-port {taken.getsockname()[1]}: cannot listen there"):
            supervise(None, {"host": "127.0.0.1", "port": 0, "threads": None,
                             "grpc_port": taken.getsockname()[1]}, 2)
    from deeprec.serving.server import serve

    with pytest.raises(ConfigError, match="--grpc-port 9000 is --port's"):
        serve("unread", port=9000, grpc_port=9000, workers=2)


@pytest.mark.slow(reason="trains and exports a DLRM (the module's export dir)")
def test_the_tables_are_mapped_not_copied_and_score_the_same(exports):
    from deeprec.serving.online import apply_delta

    source, schema = exports
    path = str(source / "full-000000010")
    model = dr.serving.load(path)
    state = model.module.state_dict()
    assert state and all(_in_mapping(t, _tables(path)) for t in state.values())  # views of the file's mapping
    copied = dr.serving.load(path)  # the same weights in memory of their own, as a copying load has them
    copied.module.load_state_dict({k: v.clone() for k, v in copied.module.state_dict().items()}, assign=True)
    assert not any(_in_mapping(t, _tables(path)) for t in copied.module.state_dict().values())
    rows = _json_rows(sample_path("criteo_sample.txt"), schema, 16)
    before, saved = model(rows), {k: v.clone() for k, v in state.items()}
    assert torch.equal(before, copied(rows))
    # a delta applied builds a new model: the one serving is never written into (its tensors stay the file's)
    updated = apply_delta(model, str(source / "delta-000000011.json"))
    assert updated.step == 11 and not torch.equal(updated(rows), before)
    assert torch.equal(model(rows), before)
    assert all(_in_mapping(t, _tables(path)) and torch.equal(t, saved[k]) for k, t in model.module.state_dict().items())


@pytest.mark.slow(reason="trains a DLRM, starts 2 worker processes (each imports torch and loads the model)")
def test_every_worker_answers_on_the_one_port_with_the_mapped_model(server, exports):
    url, pids, running, live = server
    _, schema = exports
    for pid in pids:  # the supervisor's children, each mapping the export's tables
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == running.proc.pid
        with open(f"/proc/{pid}/maps") as f:
            assert os.path.realpath(_tables(str(live / "full-000000010"))) in _mapped_files(f.read())
    rows = _json_rows(sample_path("criteo_sample.txt"), schema, 8)
    want = dr.serving.load(str(live / "full-000000010"))(rows)
    replies = _each_worker(url, pids, lambda: _ask(url, "/v1/predict", json={"inputs": rows}),
                           "an answer of each worker")
    for reply in replies.values():
        assert reply.status_code == 200 and reply.json()["step"] == 10
        assert torch.equal(torch.tensor(reply.json()["scores"], dtype=torch.float32), want)


@pytest.mark.slow(reason="the module's 2-worker server")
def test_metrics_are_summed_over_the_workers(server, exports):
    url, pids, _, _ = server
    _, schema = exports
    rows = _json_rows(sample_path("criteo_sample.txt"), schema, 2)

    def answered() -> float:
        lines = _ask(url, "/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith('deeprec_requests_total{code="200"}'))

    before, by = answered(), set()
    for _ in range(20):
        reply = _ask(url, "/v1/predict", json={"inputs": rows})
        assert reply.status_code == 200
        by.add(_worker_of(reply))
    assert by == pids  # both answered some (20 fresh connections: all on one would be a 2^-19 chance)
    for pid in pids:  # whichever worker answers /metrics: the sum over both
        metrics = _each_worker(url, {pid}, lambda: _ask(url, "/metrics"), f"/metrics of worker {pid}")[pid].text
        lines = [line for line in metrics.splitlines() if line.startswith('deeprec_requests_total{code="200"}')]
        assert lines == [f'deeprec_requests_total{{code="200"}} {before + 20:.1f}'], lines
        assert "deeprec_model_ready 1.0" in metrics


@pytest.mark.slow(reason="the module's 2-worker server, its gRPC port")
def test_every_worker_answers_grpc_on_the_one_grpc_port_counted_in_the_summed_metrics(server, exports):
    """tritonclient.grpc through the supervisor's printed gRPC port: HTTP's scores, from each worker (the
    trailing metadata x-deeprec-worker names it), each call counted in /metrics summed over the workers.
    (tritonclient.grpc is imported here only: this module never loads deeprec's own gRPC messages.)"""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    url, pids, running, live = server
    _, schema = exports
    rows = _json_rows(sample_path("criteo_sample.txt"), schema, 8)
    http = _ask(url, "/v1/predict", json={"inputs": rows})
    assert http.status_code == 200 and http.json()["step"] == 10
    want = torch.tensor(http.json()["scores"], dtype=torch.float32)
    assert torch.equal(want, dr.serving.load(str(live / "full-000000010"))(rows))
    kinds = {spec["name"]: spec["datatype"] for spec in _ask(url, f"/v2/models/{live.name}").json()["inputs"]}
    assert set(kinds.values()) == {"FP32", "BYTES"}  # dense values, string ids
    arrays = [(name, kinds[name], np.array([np.nan if v is None else v for v in values], np.float32)
               if kinds[name] == "FP32" else np.array([(v or "").encode() for v in values], dtype=object))
              for name, values in rows.items()]

    def answered() -> float:
        lines = _ask(url, "/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith('deeprec_requests_total{code="200"}'))

    before = answered()
    client = grpcclient.InferenceServerClient(running.grpc)
    inputs = [grpcclient.InferInput(n, [len(a)], k).set_data_from_numpy(a) for n, k, a in arrays]
    result = client.infer(live.name, inputs)
    client.close()
    assert result.get_response().model_version == "10"
    assert torch.equal(torch.from_numpy(result.as_numpy("scores").copy()), want)
    request = service_pb2.ModelInferRequest(model_name=live.name, inputs=[
        service_pb2.ModelInferRequest.InferInputTensor(name=n, datatype=k, shape=[len(a)]) for n, k, a in arrays],
        raw_input_contents=[a.tobytes() if k == "FP32" else
                            b"".join(len(v).to_bytes(4, "little") + v for v in a) for _, k, a in arrays])
    seen: dict[int, np.ndarray] = {}
    calls = [1]  # the tritonclient one above

    def every_worker_answered():  # a channel of its own each: a fresh connection, the kernel picks the worker
        with grpc.insecure_channel(running.grpc, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            response, call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(request,
                                                                                                  timeout=60)
        calls[0] += 1
        seen[int(dict(call.trailing_metadata())[HEADER.lower()])] = np.frombuffer(response.raw_output_contents[0],
                                                                                  "<f4")
        return pids <= set(seen)

    wait_until(every_worker_answered, 60, "a gRPC answer of each worker", poll=0)
    assert set(seen) == pids
    for scores in seen.values():
        assert torch.equal(torch.from_numpy(scores.copy()), want)
    for pid in pids:  # whichever worker answers /metrics: both workers' gRPC calls counted
        metrics = _each_worker(url, {pid}, lambda: _ask(url, "/metrics"), f"/metrics of worker {pid}")[pid].text
        lines = [line for line in metrics.splitlines() if line.startswith('deeprec_requests_total{code="200"}')]
        assert lines == [f'deeprec_requests_total{{code="200"}} {before + calls[0]:.1f}'], (lines, calls)
    assert "grpc listening" not in running.stderr()  # the workers' own lines: the supervisor printed one


@pytest.mark.slow(reason="the module's 2-worker server follows an export dir")
def test_a_delta_reaches_every_worker(server, exports):
    url, pids, _, live = server
    source, _ = exports
    for suffix in (".safetensors", ".json"):  # the .json last, as the trainer writes it
        shutil.copy(source / f"delta-000000011{suffix}", live / f"delta-000000011{suffix}")
    steps: dict[int, int] = {}

    def every_worker_updated():
        reply = _ask(url)
        steps[_worker_of(reply)] = reply.json()["step"]
        return set(steps) >= pids and all(steps[p] == 11 for p in pids)

    wait_until(every_worker_updated, 60, "step 11 from every worker", poll=0)
    assert "deeprec_model_step 11.0" in _ask(url, "/metrics").text  # the least step of the workers


@pytest.mark.slow(reason="the module's 2-worker server; a worker killed is replaced (a new process)")
def test_a_killed_worker_is_replaced_and_the_port_keeps_answering(server):
    url, pids, running, _ = server
    victim, other = sorted(pids)
    os.kill(victim, signal.SIGKILL)
    # reaped by the supervisor: every thread of it ended, its socket closed (the connections waiting in
    # its queue then are reset, as with any SO_REUSEPORT listener that closes; later ones go to the others)
    wait_until(lambda: not os.path.exists(f"/proc/{victim}"), 30, f"worker {victim} reaped")
    answered: dict[int, httpx.Response] = {}

    def replaced():
        reply = _ask(url)
        assert reply.status_code == 200  # the other worker answers meanwhile: no refused connection
        answered[_worker_of(reply)] = reply
        return len(set(answered) - {victim, other}) == 1 and other in answered

    wait_until(replaced, 120, "a new worker answering", poll=0.05)
    new = (set(answered) - {other}).pop()
    assert victim not in answered
    with open(f"/proc/{new}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == running.proc.pid
    assert answered[new].json()["step"] == answered[other].json()["step"]  # the export dir as it is now
    assert re.search(rf"worker \d \(pid {victim}\) was killed by SIGKILL: starting another", running.stderr())
    pids.clear()
    pids.update({other, new})


@pytest.mark.slow(reason="the module's 2-worker server, stopped")
def test_sigterm_to_the_supervisor_stops_every_worker(server):
    url, pids, running, _ = server
    workers = {pid for pid in pids if not _gone(pid)}
    assert len(workers) == WORKERS
    with open(f"/proc/{next(iter(workers))}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    metrics_dir = environ[b"PROMETHEUS_MULTIPROC_DIR"].decode()
    assert os.path.isdir(metrics_dir)
    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(90) == -signal.SIGTERM  # as a single process ends on SIGTERM
    assert running.line(60) is None  # nothing printed after `workers:`, a replaced worker's lines neither
    assert all(_gone(pid) for pid in workers)  # stopped and reaped by the supervisor before it ended
    assert not os.path.exists(metrics_dir)


@pytest.mark.slow(reason="starts 2 worker processes, each importing torch")
def test_a_worker_that_fails_at_start_fails_the_command(exports, tmp_path):
    source, _ = exports
    bad = tmp_path / "bad"
    shutil.copytree(source / "full-000000010", bad)
    with open(_tables(str(bad)), "r+b") as f:  # one byte changed: its sha256 differs from the manifest's
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    done = subprocess.run([sys.executable, "-m", "deeprec", "serve", str(bad), "--port", "0", "--workers", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "listening" not in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert "tables.safetensors: missing or corrupt" in done.stderr.splitlines()[-1], done.stderr
