"""Every collective of collective training has a deadline: `--collective-timeout` seconds.

Why a stopped rank used to hang the others for 30 minutes: torch.distributed's `new_group()`
without `timeout=` takes `default_pg_timeout` (30 min), not the default group's; the embedding
exchange and the stop agreement run on groups of their own. gloo does honour a group's timeout for
a peer that is stopped (SIGSTOP keeps its sockets open): every send and recv waits at most that long
("Timed out waiting 10000ms for recv operation"), tested for all_reduce (sync and async work),
all_to_all_single and 40 MB all-reduces. So, in layers:

1. every group gets the timeout: `init_process_group`, the exchange's and the stop agreement's
   `new_group` (`timeout()` below);
2. `guard(what)` around each collective (and each wait on async work) turns its failure into one
   `CollectiveTimeout` line naming the rank that stopped answering, found by heartbeats: every rank
   bumps a counter in the rendezvous store (TCPStore, on rank 0) each second from a thread; a rank
   whose counter stands still is stopped, killed or cut off; a store that does not answer is rank 0;
3. a watchdog thread: a collective still pending `GRACE_S` past the deadline (NCCL without async
   error handling, anything that ignores its timeout) prints that line and ends the process with
   os._exit(1): no collective outlives timeout + GRACE_S + PROBE_S (naming the rank), under 30 s
   past the deadline. After a collective failed, the process ends within GRACE_S of its error line
   even if tearing the groups down hangs.

Without `install()` (a PS worker's dense all-reduce, unit tests of ShardedLookup) `guard` only
passes errors through.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from deeprec.errors import DeepRecError

DEFAULT_TIMEOUT_S = 120.0
HEARTBEAT_S = 1.0  # how often a rank bumps its counter
GRACE_S = 15.0  # the watchdog's margin over the timeout: gloo's own error comes first
STORE_TIMEOUT_S = 3.0  # the heartbeat store's answer (rank 0 stopped: it never comes)
PROBE_S = 2 * STORE_TIMEOUT_S + 2.5 * HEARTBEAT_S + 1  # the most naming the silent rank takes
_PREFIX = "deeprec/heartbeat/"


# what gloo/NCCL say when a peer stopped answering or went away; any other error is a bug: re-raised
_PEER_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer",
                  "socket", "aborted", "closed by", "nccl communicator")


def _peer_failure(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in _PEER_FAILURES) or isinstance(err, dist.DistBackendError)


def _next_step() -> str:
    """What happens after this rank gives up: an elastic agent's restart, or the user's --resume."""
    from deeprec.distributed.collective.elastic import max_restarts, restart_count

    left = max_restarts() - restart_count()
    if left > 0:
        return f"the agent restarts every rank from the last checkpoint ({left} of --max-restarts " \
               f"{max_restarts()} left)"
    return "restart the job with --resume"


class CollectiveTimeout(DeepRecError):
    """A collective of collective training did not complete: a rank stopped answering."""


class Deadline:
    """This process's deadline for collectives, its heartbeat and its watchdog."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, master_addr: str, master_port: int):
        self.timeout_s, self.rank, self.world_size = float(timeout_s), rank, world_size
        self.master = (master_addr, int(master_port))
        self.pending: tuple[str, float] | None = None  # (what, monotonic start) of the collective in flight
        self.exit_by: float | None = None  # a collective failed: the process ends by then, whatever hangs
        self.steps_done: int | None = None  # steps this rank completed (Collective.agree sets it each step)
        self._stop = threading.Event()
        self._beat_stop = threading.Event()  # set: the heartbeat stops (at exit: the watchdog goes on)
        self._heartbeat: threading.Thread | None = None
        self._store = None
        self._watchdog = threading.Thread(target=self._watch, name="deeprec-collective-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    # heartbeat
    def _client(self):
        import torch.distributed as dist

        return dist.TCPStore(self.master[0], self.master[1], is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))

    def start_heartbeat(self) -> None:
        """Once the process group stands (its store then serves every rank)."""
        try:
            self._store = self._client()
            self._store.set(f"{_PREFIX}{self.rank}", "0")
        except Exception:  # noqa: BLE001 - no heartbeat: errors name the collective, not the rank
            self._store = None
            return
        self._heartbeat = threading.Thread(target=self._beat, name="deeprec-collective-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self._end_heartbeat)

    def _end_heartbeat(self) -> None:
        """At exit, before the interpreter finalizes: the heartbeat thread ended and joined. A daemon
        thread still inside the store's client (C++, the GIL released) when the interpreter finalizes
        is ended on its way back through a noexcept frame: std::terminate, "terminate called without
        an active exception", and a rank that finished its run exits with SIGABRT."""
        self._beat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(STORE_TIMEOUT_S + 1)

    def _beat(self) -> None:
        count = 0
        while not self._beat_stop.wait(HEARTBEAT_S):  # set by stop() and at exit
            count += 1
            try:
                self._store.set(f"{_PREFIX}{self.rank}", str(count))
            except Exception:  # noqa: BLE001 - the store (rank 0) is gone: the job is ending
                return

    def silent_ranks(self) -> list[int] | None:
        """The other ranks whose heartbeat stands still over a few beats ([0] when the store on rank
        0 does not answer); None when it cannot be told. Takes at most PROBE_S: the store's client
        does not bound every wait (a stopped rank 0 accepts the connection and never answers), so the
        probe runs in a thread of its own."""
        others = [r for r in range(self.world_size) if r != self.rank]
        if self._store is None or not others:
            return None
        found: list = []

        def probe() -> None:
            try:
                # a cut link (no answer, no refusal): one bounded connect says so, without the store
                # client's C++ error and stack trace in the log
                socket.create_connection(self.master, timeout=STORE_TIMEOUT_S).close()
                store = self._client()
                first = {r: store.get(f"{_PREFIX}{r}") for r in others}
                time.sleep(2.5 * HEARTBEAT_S)
                second = {r: store.get(f"{_PREFIX}{r}") for r in others}
                found.append([r for r in others if first[r] == second[r]])
            except Exception:  # noqa: BLE001 - the store does not answer
                pass

        thread = threading.Thread(target=probe, name="deeprec-collective-probe", daemon=True)
        thread.start()
        thread.join(PROBE_S)
        if found:
            return found[0] or None
        return [0] if self.rank != 0 else None  # the store does not answer: rank 0, which holds it

    def message(self, what: str, cause: BaseException | None = None, waited: float | None = None) -> str:
        silent = self.silent_ranks()
        seconds = f"{self.timeout_s:g}"
        if silent:
            who = ("rank " if len(silent) == 1 else "ranks ") + ", ".join(str(r) for r in silent)
            after = f" after {waited:.0f} s" if waited is not None else ""
            step = f" of step {self.steps_done + 1}" if self.steps_done is not None else ""
            head = (f"collective training: {who} stopped answering (stopped, killed or cut off); "
                    f"rank {self.rank} gave up on {what}{step}{after} (--collective-timeout {seconds} s)")
        else:
            reason = f": {' '.join(str(cause).split()).rstrip('.')}" if cause is not None else ""
            head = (f"collective training: {what} did not complete on rank {self.rank} within "
                    f"--collective-timeout {seconds} s{reason}")
        return head + f". Every rank must run: {_next_step()}"

    # watchdog
    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.exit_by is not None and time.monotonic() > self.exit_by:
                os._exit(1)  # its error line is out; something on the way out (a group's teardown) hung
            pending = self.pending
            if pending is not None and time.monotonic() - pending[1] > self.timeout_s + GRACE_S:
                try:
                    line = self.message(pending[0], waited=time.monotonic() - pending[1])
                except Exception:  # noqa: BLE001 - the line must come out
                    line = f"collective training: {pending[0]} did not complete within --collective-timeout"
                sys.stdout.flush()
                os.write(2, f"error: {line}\n".encode())
                os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        self._beat_stop.set()


_deadline: Deadline | None = None


def install(timeout_s: float, rank: int, world_size: int, master_addr: str, master_port: int) -> Deadline:
    """This process's deadline (one per process: a collective training rank)."""
    global _deadline
    if _deadline is not None:
        _deadline.stop()
    _deadline = Deadline(timeout_s, rank, world_size, master_addr, master_port)
    return _deadline


def uninstall() -> None:
    global _deadline
    if _deadline is not None:
        _deadline.stop()
    _deadline = None


def current() -> Deadline | None:
    return _deadline


def timeout() -> datetime.timedelta | None:
    """The timeout for a new group (None: torch's default, when no deadline is installed)."""
    return _deadline.timedelta if _deadline is not None else None


class guard:
    """`with guard("the all-to-all of ..."):` around a collective: armed in the watchdog while it
    runs; its failure becomes one CollectiveTimeout line naming the silent rank."""

    __slots__ = ("what", "deadline", "owned", "started")

    def __init__(self, what: str):
        self.what, self.deadline, self.owned = what, _deadline, False

    def __enter__(self):
        self.started = time.monotonic()
        if self.deadline is not None and self.deadline.pending is None:  # the outermost guard times it
            self.deadline.pending, self.owned = (self.what, self.started), True
        return self

    def __exit__(self, kind, err, tb):
        deadline = self.deadline
        if deadline is None:
            return False
        try:
            if err is not None and isinstance(err, RuntimeError) and not isinstance(err, DeepRecError) \
                    and _peer_failure(err):
                line = deadline.message(self.what, err, waited=time.monotonic() - self.started)
                deadline.exit_by = time.monotonic() + GRACE_S  # the error's way out must not hang either
                raise CollectiveTimeout(line) from None
        finally:
            if self.owned:
                deadline.pending = None
        return False
