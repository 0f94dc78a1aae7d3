"""The multi-host harness itself (tests/cluster.py): hosts reach each other by address, a cut link
drops packets both ways until restored, and everything it made is gone after close."""
import subprocess
import sys
import time

import pytest

from cluster import Cluster, unavailable

pytestmark = pytest.mark.slow

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
"""

CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
c.sendall(b"ping"); print("got", c.recv(100).decode(), flush=True)
"""


def _ask(host, address: str, timeout: float) -> tuple[int, str]:
    proc = host.run([sys.executable, "-c", CLIENT, address, str(timeout)])
    code = proc.wait(timeout + 10)
    return code, proc.output()


def test_hosts_talk_by_address_and_a_cut_drops_packets_until_restored(cluster):
    server, client = cluster.host("server"), cluster.host("client")
    echo = server.run([sys.executable, "-c", ECHO_SERVER, server.address], name="echo")
    echo.wait_for("listening", 30)
    assert _ask(client, server.address, 5) == (0, "got ping\n")
    server.cut()
    started = time.monotonic()
    code, out = _ask(client, server.address, 2)
    assert code != 0 and "timed out" in out  # dropped, not refused: the client waits out its timeout
    assert time.monotonic() - started >= 1.5
    server.restore()
    assert _ask(client, server.address, 5) == (0, "got ping\n")
    # a host's own loopback is its own: the server is not on the client's 127.0.0.1
    code, out = _ask(client, "127.0.0.1", 2)
    assert code != 0 and "refused" in out


def _gone_or_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # after the command's name (may hold spaces)
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between two looks
        return True


def _commands(pids: list[str]) -> dict[str, str]:
    """{pid: its command line} of those still there."""
    commands = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                commands[pid] = f.read().replace(b"\0", b" ").decode().strip()
        except (FileNotFoundError, ProcessLookupError):
            pass
    return commands


def test_close_stops_every_process_and_removes_namespaces_and_links(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made = Cluster(tmp_path / "logs")
    host = made.host("a")
    sleeper = host.run([sys.executable, "-c", "import time; time.sleep(600)"])
    child = host.run(["bash", "-c", "sleep 600 & wait"])  # a grandchild in its group is stopped too
    host.run(["setsid", "-f", "sleep", "601"])  # a session of its own (as torchrun's ranks): stopped too
    deadline = time.monotonic() + 20  # all four started (bash's child, setsid's): a loaded machine takes its time
    while True:
        inside = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
        started = {"sleep 600", "sleep 601"} <= set(_commands(inside).values())  # both in the namespace
        if (len(inside) >= 4 and started) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(inside) >= 4 and started, _commands(inside)
    made.close()
    assert sleeper.returncode is not None and child.returncode is not None
    for pid in inside:
        assert _gone_or_zombie(pid), pid
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert host.netns not in names
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert made.bridge not in links and host.link not in links
    assert not subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True).stdout.strip()
