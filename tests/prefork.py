"""The suite's fork server: a process the tests start as `python -m deeprec...` is forked from one
that has imported torch and deeprec already, instead of importing them again.

    test (xdist worker) ── Popen([python, -m, deeprec, train, ...]) ──┐ request: argv, env, cwd + the
    prefork server: imported torch, deeprec, its CLI and PS once      ◀┘ child's stdin/out/err fds
         └─ fork ─▶ child: env, cwd, fds, sys.path, stdio, threads, RNG as a fresh process has them;
                    runs the module as `python -m` does; exits as the interpreter does (threads, atexit)

Why: a run of the suite starts ~600 Python processes, and importing torch and deeprec costs each
~1.8 CPU-s: more than half of all the suite's CPU on the 2-core machine. A fork costs ~0.1 s.

`Popen` is subprocess.Popen (conftest installs it as such): the child is the server's, so waiting
goes through a pidfd (the exit is seen) and the server (the status is read); signals, pipes,
communicate and timeouts are Popen's own. Anything else (another program, interpreter options,
preexec_fn, pass_fds, a PYTHONHASHSEED) is started as before, by exec. DEEPREC_TEST_PREFORK=0 turns
the server off; test_prefork.py checks that a forked child sees what an exec'd one sees.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import warnings

PRELOAD = ("deeprec.cli", "deeprec.distributed.ps.shard", "deeprec.distributed.launch")
MODULES = ("deeprec",)  # `python -m` of these packages (and their modules) is forked
SCRIPTS = ("deeprec",)  # console scripts (bin/) forked too
_MAX_MESSAGE = 1 << 20
# a fresh process has none of these set by us; the server's own values would leak into every child
_SERVER_ENV_DROP = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


# -- the client: a Popen that forks eligible commands from the server ----------------------------------------
class _Server:
    """The fork server of this process, started at the first eligible Popen."""

    def __init__(self):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k not in _SERVER_ENV_DROP}
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS pool would be a second thread: no fork then
        self.proc = _Base([sys.executable, os.path.abspath(__file__), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                          env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.lock = mine, threading.Lock()
        try:
            os.close(os.pidfd_open(self.proc.pid))  # Linux >= 5.3: how a child's exit is seen
            if self.call({"op": "ready"}).get("ready") is not True:
                raise RuntimeError("the prefork server did not start")
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def call(self, request: dict, fds: list[int] = ()) -> dict:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            reply = self.sock.recv(_MAX_MESSAGE)
        if not reply:
            raise RuntimeError(f"the prefork server ended (exit {self.proc.poll()})")
        return json.loads(reply)


_server: _Server | None | bool = None  # False: it could not start (the commands are exec'd)
_server_lock = threading.Lock()
_Base = subprocess.Popen


def _get_server() -> _Server | None:
    global _server
    with _server_lock:
        if _server is None:
            try:
                _server = _Server()
            except (OSError, RuntimeError) as err:  # e.g. no pidfd_open (Linux < 5.3): exec as before
                _server = False
                warnings.warn(f"tests/prefork.py: no fork server ({err}); processes are exec'd", stacklevel=3)
        return _server or None


def enabled() -> bool:
    return os.environ.get("DEEPREC_TEST_PREFORK", "1") != "0"


def _eligible(args, executable, preexec_fn, close_fds, pass_fds, env, shell, gid, gids, uid, process_group):
    """The request for `python [-u] -m deeprec... ARGS` or a console script of this venv (bin/deeprec ARGS):
    {module or script, args, unbuffered}; None for anything else."""
    if shell or executable or preexec_fn or pass_fds or not close_fds or gid is not None or uid is not None or gids:
        return None
    if process_group not in (None, -1) or not isinstance(args, (list, tuple)) or not args:
        return None
    if "PYTHONHASHSEED" in (os.environ if env is None else env):
        return None
    args = [os.fsdecode(a) for a in args]
    if args[0] != sys.executable:
        return _console_script(args)
    unbuffered = len(args) > 1 and args[1] == "-u"
    rest = args[2:] if unbuffered else args[1:]
    if len(rest) < 2 or rest[0] != "-m" or rest[1].split(".")[0] not in MODULES:
        return None
    return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}


def _console_script(args: list[str]):
    """bin/deeprec ARGS: a script of this venv's bin whose interpreter is this one."""
    script = os.path.abspath(args[0])
    if os.path.dirname(script) != os.path.dirname(sys.executable) or os.path.basename(script) not in SCRIPTS:
        return None
    try:
        with open(script, "rb") as f:
            shebang = f.readline().decode(errors="replace").strip()
    except OSError:
        return None
    if shebang != f"#!{sys.executable}":
        return None
    return {"script": script, "args": args[1:], "unbuffered": False}


class Popen(_Base):
    _pidfd: int | None = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                       umask, start_new_session, process_group):
        how = enabled() and _eligible(args, executable, preexec_fn, close_fds, pass_fds, env, shell, gid, gids, uid,
                                      process_group)
        server = _get_server() if how else None
        if not server:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        env = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            reply = server.call({**how, "op": "spawn", "env": env,
                                 "cwd": os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd(),
                                 "new_session": bool(start_new_session), "umask": umask}, fds)
        finally:  # the child's ends, as Popen closes them after a fork
            if p2cread != -1 and p2cwrite != -1 and p2cread != getattr(self, "_devnull", None):
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1 and c2pwrite != getattr(self, "_devnull", None):
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != getattr(self, "_devnull", None):
                os.close(errwrite)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)
            self._closed_child_pipe_fds = True
        if "error" in reply:  # as Popen raises what the child's setup met (a missing cwd: FileNotFoundError)
            raise OSError(reply.get("errno") or 0, reply["error"])
        self.pid, self._server = reply["pid"], server
        self._child_created = True
        self._pidfd = os.pidfd_open(self.pid)  # before any reap: the server reaps only when asked

    def _exited(self, timeout: float | None) -> bool:
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def _reap(self) -> None:
        with self._waitpid_lock:
            if self.returncode is None:
                self.returncode = self._server.call({"op": "wait", "pid": self.pid})["returncode"]

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._pidfd is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._exited(0):
            self._reap()
        return self.returncode

    def _wait(self, timeout):
        if self._pidfd is None:
            return super()._wait(timeout)
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._reap()
        return self.returncode

    def __del__(self, *args, **kwargs):
        # a running child stays polled (Popen's __del__ keeps it in subprocess._active): its pidfd too
        if self._pidfd is not None and self.returncode is not None:
            os.close(self._pidfd)
        super().__del__(*args, **kwargs)


def install() -> None:
    """subprocess.Popen (and so subprocess.run) forks eligible commands from the server."""
    if enabled():
        subprocess.Popen = Popen


# -- the server ------------------------------------------------------------------------------------------
_DEFAULT_THREADS = 1


def _serve(fd: int) -> None:
    import gc
    import importlib

    import torch

    for name in PRELOAD:
        importlib.import_module(name)
    global _DEFAULT_THREADS
    _DEFAULT_THREADS = torch.get_num_threads()  # torch's own default: the server runs without OMP_NUM_THREADS
    gc.collect()
    gc.freeze()  # the children's collections then skip (and so never copy) the preloaded objects
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    if len(threads) - threads.count("jemalloc_bg_thd") != 1:  # pyarrow's jemalloc forks safely (atfork)
        raise RuntimeError(f"the prefork server must have one thread to fork, it has {threads}")
    sock = socket.socket(fileno=fd)
    base_path = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except ConnectionResetError:
            return
        if not message:
            return
        try:
            reply = _handle(json.loads(message), fds, sock, base_path)
        except Exception as err:  # noqa: BLE001  (the server outlives a failed request: fork's EAGAIN, ...)
            reply = {"error": f"prefork server: {type(err).__name__}: {err}", "errno": getattr(err, "errno", 0)}
        for f in fds:
            os.close(f)
        sock.send(json.dumps(reply).encode())


def _handle(request: dict, fds: list[int], sock, base_path: list[str]) -> dict:
    if request["op"] == "ready":
        return {"ready": True}
    if request["op"] == "wait":
        _, status = os.waitpid(request["pid"], 0)
        return {"returncode": os.waitstatus_to_exitcode(status)}
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        sock.close()
        os.close(ready_r)
        _child(request, fds, base_path, ready_w)  # never returns
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:  # the child's setup done (as Popen returns after exec)
        failed = ready.read()
    if failed:  # its setup failed: the error, as Popen raises it
        os.waitpid(pid, 0)
        error = json.loads(failed)
        return {"error": error["error"], "errno": error["errno"]}
    return {"pid": pid}


def _child(request: dict, fds: list[int], base_path: list[str], ready: int) -> None:
    code = 1
    try:
        try:
            _set_up_child(request, fds, base_path, keep=ready)
        except BaseException as err:  # noqa: BLE001  (reported to the client, as exec's errors are)
            os.write(ready, json.dumps({"error": f"{type(err).__name__}: {err}",
                                        "errno": getattr(err, "errno", 0) or 0}).encode())
            os._exit(1)
        os.close(ready)
        code = _run_child(request)
    except BaseException:  # noqa: BLE001  (the child must never return into the server's loop)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _set_up_child(request: dict, fds: list[int], base_path: list[str], keep: int) -> None:
    """A fresh interpreter's state, as `python` would start it with this request's argv, env and cwd."""
    import io
    import random
    import signal

    import numpy
    import torch

    if request["new_session"]:
        os.setsid()
    if request["umask"] is not None and request["umask"] >= 0:
        os.umask(request["umask"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, keep)  # as close_fds: only 0-2 (and `keep`, the setup's report to the server)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    unbuffered = request["unbuffered"] or bool(env.get("PYTHONUNBUFFERED"))
    encoding = env.get("PYTHONIOENCODING", "").split(":")[0] or sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=encoding, errors=sys.stdin.errors)
    for name, fd, line_buffered in (("stdout", 1, os.isatty(1)), ("stderr", 2, True)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding,
                                  errors=getattr(sys, name).errors, line_buffering=line_buffered,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    script = request.get("script")
    sys.path[:] = [os.path.dirname(script) if script else os.getcwd(), *extra, *base_path]
    threads = env.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() and int(threads) > 0 else _DEFAULT_THREADS)
    torch.seed()  # a fresh process seeds torch, numpy and random from the OS: each its own draws
    numpy.random.seed()
    random.seed()
    module = request.get("module")
    if module and module in sys.modules and not hasattr(sys.modules[module], "__path__"):
        # preloaded (deeprec.cli): runpy would warn and run a second copy; a fresh process has none
        del sys.modules[module]
        parent, _, name = module.rpartition(".")
        if parent in sys.modules:
            sys.modules[parent].__dict__.pop(name, None)


def _run_child(request: dict) -> int:
    import runpy
    import signal
    import types

    script = request.get("script")
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        if script:  # as `python SCRIPT ARGS` runs it
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
        else:  # as `python -m MODULE ARGS` runs it
            sys.argv = ["-m", *request["args"]]
            runpy._run_module_as_main(request["module"], alter_argv=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python does: exit by the signal
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001  (an uncaught error: its traceback, exit 1, as Python does)
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit, flush."""
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    sys.path.pop(0)  # tests/: not a path a deeprec process has
    _serve(int(sys.argv[1]))
