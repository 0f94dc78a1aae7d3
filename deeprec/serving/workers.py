"""`deeprec serve --workers N`: N worker processes answering on one port, under a supervisor (as gunicorn).

    the supervisor (the command's process: it loads no model and scores nothing)
      ├─ binds HOST:PORT with SO_REUSEPORT and never listens: --port 0 resolved, the port held; the same
      │  for HOST:GRPC_PORT (--grpc-port, 0 resolved)
      ├─ PROMETHEUS_MULTIPROC_DIR: a temporary folder of its own, removed at exit
      └─ starts N workers (multiprocessing's spawn: fresh interpreters, never a fork of a process that
         has torch threads or an event loop); each runs server.serve as one process does, except:
           its socket bound to HOST:PORT with SO_REUSEPORT too: the kernel spreads connections over them
           its gRPC service (--grpc-port) bound to HOST:GRPC_PORT with SO_REUSEPORT (grpc.so_reuseport), the
             port not checked first (server.serve's check_address: the supervisor's reserve is the check)
           /metrics: every worker's (repository.Metrics), each answer an X-Deeprec-Worker: <its pid> (over
             gRPC: the trailing metadata x-deeprec-worker)
           ──its pipe──> ("ready", pid, what serve printed) once the app's startup ran (its batchers started,
             its gRPC service answering) | ("failed", kind, its error)
      prints what a worker printed (`listening on http://HOST:PORT`, the models, `grpc listening on
      HOST:GRPC_PORT`) once, when all are ready; then:
        a worker that exits ──> logged, its live gauges dropped (mark_process_dead), another started
        a worker that fails at start (the first ones or a replacement) ──> the others stopped, the
             command fails with that worker's error (never a loop of restarts)
        SIGINT / SIGTERM ──> SIGTERM to every worker (uvicorn's graceful stop; SIGKILL after GRACE_S),
             then the supervisor ends by that signal, as a single process does

A worker whose supervisor is gone (killed) sees its pipe close and stops itself. Every worker loads
the model itself and follows its export dir itself (repository.Served.watch): a delta reaches each
within --watch-interval. The weights are mapped from tables.safetensors (serving.mapped): N workers,
one copy of the tables in the page cache.

Thread budget: a worker runs an event loop (parsing, batching) and its scoring threads (--threads,
torch's intra-op threads). Default per worker: max(1, cores // N - 1), so N × (1 + threads) fits the
cores when N <= cores / 2; a warning says when N × (1 + threads) exceeds them.
"""
from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection

log = logging.getLogger("deeprec.serve")
GRACE_S = 30.0  # a stopping worker's graceful stop (requests in flight answered), then SIGKILL
HEADER = "X-Deeprec-Worker"


class Worker:
    """This process, when it is a worker of a supervisor (`current()`): what serve does differently."""

    def __init__(self, index: int, conn):
        self.index, self.conn = index, conn
        self.printed = io.StringIO()  # serve's stdout until it is ready: the supervisor prints it once

    def serving(self, app) -> None:
        """Called by serve before uvicorn runs `app` (a Starlette app): its answers say which worker gave
        them; once the app's startup has run (its batchers started, its gRPC service answering; uvicorn then
        accepts the connections queued on the listening socket), the supervisor is told this one is ready,
        with what serve and the startup printed; what it prints later goes to stderr (the supervisor's
        stdout stays its own). A startup that fails is reported as a failed serve is (_main)."""
        app.add_middleware(_WorkerHeader, value=str(os.getpid()))
        startup = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app):
            started = False
            try:
                async with startup(app) as state:
                    started = True
                    self._ready()
                    yield state
            except Exception as err:  # uvicorn logs it and exits (3); the supervisor gets its words
                if not started:
                    _report(self.conn, err)
                raise

        app.router.lifespan_context = lifespan

    def grpc_options(self) -> dict:
        """start_grpc's keywords in a worker: the port shared (SO_REUSEPORT), answers naming this worker."""
        return {"reuse_port": True, "metadata": ((HEADER.lower(), str(os.getpid())),)}

    def _ready(self) -> None:
        sys.stdout.flush()
        text, sys.stdout = self.printed.getvalue(), sys.stderr
        self.conn.send(("ready", os.getpid(), text))
        threading.Thread(target=self._orphaned, name="deeprec-supervisor", daemon=True).start()

    def _orphaned(self) -> None:
        """Stops this worker (uvicorn's graceful stop) once the supervisor is gone: its pipe closes."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)


_current: Worker | None = None


def current() -> Worker | None:
    """This process as a worker of `deeprec serve --workers N`, or None (a single process, a library)."""
    return _current


class _WorkerHeader:
    """ASGI middleware: every HTTP answer names the worker that gave it."""

    def __init__(self, app, value: str):
        self.app, self.header = app, (HEADER.lower().encode(), value.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, sending)


def _report(conn, err: Exception) -> str:
    """A worker's failure at start sent to the supervisor as ("failed", kind, message), kind "usage" (a
    ConfigError or a missing file: exit 2), "failed" (a DeepRecError) or "bug"; returns the kind."""
    from deeprec.errors import ConfigError, DeepRecError

    kind = ("usage" if isinstance(err, (ConfigError, FileNotFoundError)) else
            "failed" if isinstance(err, DeepRecError) else "bug")
    try:
        conn.send(("failed", kind, str(err) if kind != "bug" else f"{type(err).__name__}: {err}"))
    except OSError:
        pass
    return kind


def _main(serve, arguments: dict, index: int, conn) -> None:
    """A worker (multiprocessing's target): serve(**arguments) (server.serve, handed over by reference:
    this module does not import the server, which imports it) with its sockets shared; its startup's
    failure sent to the supervisor (_report)."""
    global _current
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us (uvicorn
    # takes SIGINT again once it serves)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s %(name)s (worker {index}): %(message)s")
    _current = Worker(index, conn)
    sys.stdout = _current.printed
    from deeprec.errors import ConfigError, DeepRecError

    try:
        serve(**arguments)
    except Exception as err:  # noqa: BLE001  (reported, then this process ends)
        if not isinstance(err, (ConfigError, FileNotFoundError, DeepRecError)):
            traceback.print_exc()
        sys.exit(2 if _report(conn, err) == "usage" else 1)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


def thread_budget(workers: int, threads: int | None, ncores: int) -> tuple[int, str | None]:
    """(scoring threads per worker, a warning or None): --threads, or max(1, cores // workers - 1)."""
    per = threads or max(1, ncores // workers - 1)
    busy = workers * (1 + per)
    if busy <= ncores:
        return per, None
    fit = max(1, ncores // (1 + per))
    return per, (f"--workers {workers} × (an event loop + {per} scoring thread{'s' if per > 1 else ''}, --threads) "
                 f"= {busy} busy threads on {ncores} cores: they take turns, each request waits longer; "
                 f"{fit} worker{'s fit' if fit > 1 else ' fits'} with --threads {per}" +
                 (f", or --threads {max(1, ncores // workers - 1)}" if threads and ncores // workers >= 2 else ""))


def reserve(host: str, port: int, option: str = "--port") -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: the port (0: a free one) held for
    the workers, which bind it too. A ConfigError naming `option` if it cannot be bound."""
    from deeprec.serving.listen import bound

    if port:  # first a plain bind: SO_REUSEPORT would join a port another server listens on with it
        bound(host, port, option).close()
    return bound(host, port, option, reuse_port=True)


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Slot:
    """A worker's place: its process, its pipe, whether it said it is ready."""

    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn, self.ready, self.closed = index, process, conn, False, False


class Supervisor:
    """Starts `count` workers serving `arguments` (serve's, the port resolved), restarts those that
    exit, stops them all on SIGINT/SIGTERM. `run` returns that signal's number, or raises the error of
    a worker that failed at start (the others stopped)."""

    def __init__(self, serve, arguments: dict, count: int, metrics_dir: str):
        self.serve, self.arguments, self.count, self.metrics_dir = serve, arguments, count, metrics_dir
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[_Slot] = []
        self.announced, self.signalled = False, None

    def _start(self, index: int) -> _Slot:
        mine, theirs = self.context.Pipe()
        process = self.context.Process(target=_main, args=(self.serve, self.arguments, index, theirs),
                                       name=f"deeprec-serve-worker-{index}")
        process.start()
        theirs.close()  # the worker's end: ours closed, its exit closes the pipe
        return _Slot(index, process, mine)

    def _fail(self, slot: _Slot, message: tuple | None):
        """The error of a worker that failed at start (its message, or how it ended)."""
        from deeprec.errors import ConfigError
        from deeprec.serving import ServingError

        if message is not None and message[0] == "failed":
            _, kind, text = message
            if kind == "usage":
                return ConfigError(text)
            return ServingError(text if kind == "failed" else
                                f"worker {slot.index} failed at start: {text} (its traceback above)")
        slot.process.join()
        return ServingError(f"worker {slot.index} (pid {slot.process.pid}) {_how(slot.process.exitcode)} before it "
                            "was ready (its output above)")

    def _received(self, slot: _Slot) -> None:
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):  # it exited: its sentinel says how
            slot.closed = True
            return
        if message[0] != "ready":
            raise self._fail(slot, message)
        slot.ready = True
        if self.announced:
            log.warning("worker %d restarted (pid %d)", slot.index, slot.process.pid)
        elif all(s.ready for s in self.slots):
            self.announced = True
            print(message[2], end="", flush=True)  # serve's lines: `listening on http://HOST:PORT`, the models
            print(f"workers: {self.count} (pids {', '.join(str(s.process.pid) for s in self.slots)})", flush=True)

    def _exited(self, slot: _Slot) -> None:
        slot.process.join()
        if not slot.ready:
            message = None
            if not slot.closed and slot.conn.poll():
                try:
                    message = slot.conn.recv()
                except (EOFError, OSError):
                    pass
            raise self._fail(slot, message)
        from prometheus_client import multiprocess

        log.warning("worker %d (pid %d) %s: starting another", slot.index, slot.process.pid,
                    _how(slot.process.exitcode))
        multiprocess.mark_process_dead(slot.process.pid, self.metrics_dir)  # its live gauges; its counts stay
        slot.conn.close()
        self.slots[self.slots.index(slot)] = self._start(slot.index)

    def _signal(self, signum, frame) -> None:
        self.signalled = signum

    def run(self) -> int:
        main = threading.current_thread() is threading.main_thread()  # signals are the main thread's
        woken, wakes = socket.socketpair()  # a signal writes into `wakes`: `woken` is readable, the wait ends
        for s in (woken, wakes):
            s.setblocking(False)
        if main:
            previous = {sig: signal.signal(sig, self._signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            previous_fd = signal.set_wakeup_fd(wakes.fileno(), warn_on_full_buffer=False)
        try:
            self.slots = [self._start(index) for index in range(self.count)]
            while self.signalled is None:
                waiting = {}
                for slot in self.slots:
                    waiting[slot.process.sentinel] = (slot, self._exited)
                    if not slot.ready and not slot.closed:
                        waiting[slot.conn] = (slot, self._received)
                for ready in connection.wait([*waiting, woken]):
                    if ready is woken:
                        while True:
                            try:
                                woken.recv(512)
                            except BlockingIOError:
                                break
                    elif ready in waiting and self.signalled is None:
                        slot, handle = waiting[ready]
                        if slot in self.slots:  # not replaced by an earlier one of this round
                            handle(slot)
        finally:
            self.stop()
            if main:
                signal.set_wakeup_fd(previous_fd)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            woken.close()
            wakes.close()
        return self.signalled

    def stop(self) -> None:
        """Every worker stopped: SIGTERM (uvicorn's graceful stop), SIGKILL after GRACE_S."""
        alive = [s.process for s in self.slots if s.process.pid is not None and s.process.exitcode is None]
        for process in alive:
            process.terminate()
        left, deadline = {p.sentinel for p in alive}, time.monotonic() + GRACE_S
        while left and deadline > time.monotonic():  # wait returns when any one is done: until all are
            left -= set(connection.wait(left, deadline - time.monotonic()))
        for process in alive:
            if process.is_alive():
                process.kill()
            process.join()
        for slot in self.slots:
            slot.conn.close()


def supervise(serve, arguments: dict, count: int) -> None:
    """`deeprec serve --workers count`: `serve` (server.serve) run in each worker with `arguments`
    (its keywords, by name)."""
    host, port = arguments["host"], arguments["port"]
    held = [reserve(host, port)]
    signalled = None
    try:
        arguments = {**arguments, "port": held[0].getsockname()[1]}
        if arguments.get("grpc_port") is not None:  # every worker's gRPC service on this one port too
            held.append(reserve(host, arguments["grpc_port"], "--grpc-port"))
            arguments["grpc_port"] = held[1].getsockname()[1]
        threads, warning = thread_budget(count, arguments.get("threads"), cores())
        if warning:
            log.warning(warning)
        arguments = {**arguments, "threads": threads, "workers": 1}
        metrics_dir = tempfile.mkdtemp(prefix="deeprec-serve-metrics-")
        before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the workers' (spawned: they inherit it)
        try:
            signalled = Supervisor(serve, arguments, count, metrics_dir).run()
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            if before is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
    finally:
        for sock in held:
            sock.close()
    if signalled is not None:  # ends by that signal, as a single process does (exit 143, 130)
        signal.signal(signalled, signal.SIG_DFL)
        signal.raise_signal(signalled)
