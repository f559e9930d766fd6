"""The two-host harness itself (tests/netns.py): two namespaces that reach each other over
their veth only, and nothing left behind, on success or failure. Skips without root or
iproute2 (CI sets ``KVFERRY_REQUIRE_NETNS=1``, which makes that a failure)."""

from __future__ import annotations

import os
import subprocess
import sys

import netns
import pytest
from netns import TwoHosts, unavailable

REASON = unavailable()
if REASON is not None and os.environ.get("KVFERRY_REQUIRE_NETNS"):
    raise RuntimeError(f"KVFERRY_REQUIRE_NETNS is set but two namespaces cannot be made here: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs network namespaces: {REASON}")

SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
conn, peer = s.accept()
conn.sendall(peer[0].encode())
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
    print(c.recv(64).decode())
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_two_namespaces_reach_each_other_over_the_veth_only() -> None:
    with TwoHosts() as hosts:
        assert hosts.a.namespace in _namespaces() and hosts.b.namespace in _namespaces()
        server = subprocess.Popen(
            hosts.command(hosts.b, [sys.executable, "-c", SERVER, hosts.b.ip]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            got = subprocess.run(
                hosts.command(hosts.a, [sys.executable, "-c", CLIENT, hosts.b.ip, port, "30"]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert got.returncode == 0, got.stderr
            assert got.stdout.strip() == hosts.a.ip  # the server saw host a's veth address
            server.wait(timeout=30)
        finally:
            server.kill()
        # Each namespace routes only its /30 (and its loopback): no way out to the machine.
        routes = (
            subprocess.run(hosts.command(hosts.a, ["ip", "route"]), capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()
        )
        assert (
            len(routes) == 1 and routes[0].startswith(hosts.a.ip.rsplit(".", 1)[0]) and hosts.a.device in routes[0]
        ), routes
        assert hosts.tx_bytes(hosts.a) > 0
    assert hosts.a.namespace not in _namespaces() and hosts.b.namespace not in _namespaces()


def test_a_failed_setup_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = netns._run

    def failing(argv: list[str]) -> subprocess.CompletedProcess[str]:
        if argv[:3] == ["ip", "link", "add"]:  # after both namespaces exist
            made.extend(n for n in _namespaces().split() if n.startswith(f"kvferry-{os.getpid() % 100000}"))
            raise subprocess.CalledProcessError(2, argv, "", "planted failure")
        return real(argv)

    monkeypatch.setattr(netns, "_run", failing)
    with pytest.raises(subprocess.CalledProcessError):
        TwoHosts()
    assert made
    left = _namespaces()
    assert not [n for n in made if n in left]
