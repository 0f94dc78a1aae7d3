"""Several hosts on one machine, for the fault tests of issue 28.

    test process (root namespace, 10.A.B.1 on the bridge)
        │
    bridge drb<id> ──veth── host "ps"     (netns drt-<pid>-<id>-ps,     10.A.B.2)
                   ──veth── host "worker" (netns drt-<pid>-<id>-worker, 10.A.B.3)
                   ──veth── ...

Each host is a Linux network namespace with its own address and loopback; the processes a test
starts in a host reach the others only through those addresses. `host.cut()` takes the host's link
down (packets are dropped, as in a partition: nothing answers, nothing is refused), `host.restore()`
brings it back. Every process is started in its own session and stopped by its PID (the whole
group) when the test ends, pass or fail; the namespaces, links and bridge are deleted then too, and
any left behind by a test process that was itself killed are deleted by the next one.

Needs root and `ip netns`: `cluster` skips a test with one line saying which is missing.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import secrets
import time
from pathlib import Path

import pytest

PREFIX = "drt-"  # namespaces: drt-<pid of the test process>-<cluster>-<host>
COMMAND_TIMEOUT_S = 20
_clusters = itertools.count()


def unavailable() -> str | None:
    """Why multi-host tests cannot run here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "multi-host fault tests need root (network namespaces): run as root"
    if shutil.which("ip") is None:
        return "multi-host fault tests need iproute2's `ip` (ip netns): install iproute2"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"multi-host fault tests need `ip netns add` to work: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Namespaces and links of test processes that are gone (killed before they could clean up)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.match(rf"{PREFIX}(\d+)-", name)
        if match and not _alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(r"\d+: (dr[bv](\d+)x[^:@]*)", line)
        if match and not _alive(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)


class Proc:
    """A process started in a host; its output (stdout and stderr) goes to `log`."""

    def __init__(self, name: str, host: "Host", popen: subprocess.Popen, log: Path):
        self.name, self.host, self.popen, self.log = name, host, popen, log

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of `pattern` in the output, waited for at most `timeout` s (fails if the
        process ends without it)."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output())
            if match:
                return match
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) without {pattern!r}:\n"
                                     f"{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {pattern!r} within {timeout:.0f}s:\n{self.output()[-4000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout:.0f}s:\n{self.output()[-4000:]}") from None

    def signal(self, sig: int = signal.SIGKILL) -> None:
        """`sig` to the process's whole group (its own session), if it still runs."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> int:
        self.signal(signal.SIGKILL)
        return self.popen.wait(COMMAND_TIMEOUT_S)


class Host:
    def __init__(self, cluster: "Cluster", name: str, index: int):
        self.cluster, self.name = cluster, name
        self.netns = f"{PREFIX}{os.getpid()}-{cluster.id}-{name}"
        self.address = f"{cluster.subnet}.{index + 2}"
        self.link = f"drv{os.getpid()}x{cluster.id}h{index}"  # the root side of its veth: <= 15 characters
        inner = f"drv{os.getpid()}x{cluster.id}i{index}"
        if len(self.link) > 15:
            raise RuntimeError(f"interface name {self.link!r} is too long")
        _ip("netns", "add", self.netns)
        cluster.hosts[name] = self  # from here on, close() removes it, even if the rest fails
        _ip("link", "add", self.link, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.netns)
        _ip("link", "set", self.link, "master", cluster.bridge, "up")
        self._in("link", "set", inner, "name", "eth0")
        self._in("addr", "add", f"{self.address}/24", "dev", "eth0")
        self._in("link", "set", "eth0", "up")
        self._in("link", "set", "lo", "up")
        self.is_cut = False

    def _in(self, *args: str) -> None:
        _ip("netns", "exec", self.netns, "ip", *args)

    def run(self, argv: list[str], name: str | None = None, env: dict | None = None, cwd: str | None = None) -> Proc:
        """Start `argv` inside this host (its own session; output to a log file of the cluster)."""
        name = name or f"{self.name}-{len(self.cluster.procs)}"
        log = self.cluster.log_dir / f"{name}.log"
        environment = {**os.environ, **self.cluster.env, **(env or {})}
        with open(log, "ab") as out:
            popen = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=environment, cwd=cwd, start_new_session=True)
        proc = Proc(name, self, popen, log)
        self.cluster.procs.append(proc)
        return proc

    def cut(self) -> None:
        """Take this host's link down: its packets to and from every other host are dropped."""
        _ip("link", "set", self.link, "down")
        self.is_cut = True

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")
        self.is_cut = False


class Cluster:
    """Hosts joined by a bridge; `close` stops everything it started."""

    def __init__(self, log_dir: Path):
        remove_stale()
        self.id = next(_clusters)
        pid = os.getpid()
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50 + self.id * 7) % 250}"
        self.bridge = f"drb{pid}x{self.id}"
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {"DEEPREC_PS_TOKEN": secrets.token_hex(16), "PYTHONUNBUFFERED": "1"}
        self.hosts: dict[str, Host] = {}
        self.procs: list[Proc] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)  # the test process reaches the hosts here
            _ip("link", "set", self.bridge, "up")
        except RuntimeError:
            self.close()
            raise

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            Host(self, name, len(self.hosts))  # adds itself to self.hosts
        return self.hosts[name]

    def close(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.popen.wait(COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts.values():
            _kill_inside(host.netns)
        for host in self.hosts.values():
            _ip("link", "del", host.link, check=False)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)


def _kill_inside(netns: str) -> None:
    """SIGKILL to every process still in `netns`, by PID: those that left the session the test
    started (torchrun starts its ranks in sessions of their own) would outlive the namespace's name."""
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while time.monotonic() < deadline:
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path):
    """A Cluster for one test, closed after it however it ends; skipped where namespaces cannot be made."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made = Cluster(tmp_path / "cluster-logs")
    try:
        yield made  # a host whose setup fails mid-way is in made.hosts already: closed below
    finally:
        made.close()
