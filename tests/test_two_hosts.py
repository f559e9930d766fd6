"""Two hosts, as CI can have them: two network namespaces joined by a veth pair
(tests/netns.py), the receiver in one and the sender in the other, each its own process
(tests/two_hosts_worker.py) started with ``ip netns exec``. They share no socket path and
no shared-memory name: control over ``tcp://`` to the receiver's veth address, data over NIXL
with ``UCX_TLS=tcp`` on the veth (with UCX's defaults both sides count as one node and the
bytes would go by cross-memory attach instead: the veth's byte counter checks they did not).

Faults are forced at known points: the sender stops after its early sends landed and tells
the test, the test takes the link down (or kills a process), then lets it go on. Every wait
is bounded; afterwards neither side holds a block and the endpoint serves a good sender.

Without root or iproute2 these tests skip, saying why; CI sets ``KVFERRY_REQUIRE_NETNS=1``,
which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pytest
from netns import Side, TwoHosts, unavailable
from two_hosts_worker import LAYERS, SHAPE, TPB, digest, source_pool

REASON = unavailable()
if os.environ.get("KVFERRY_REQUIRE_NETNS"):  # CI: these tests must run
    if REASON is not None:
        raise RuntimeError(f"KVFERRY_REQUIRE_NETNS is set but two namespaces cannot be made here: {REASON}")
    import nixl  # noqa: F401
else:
    pytest.importorskip("nixl")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-host tests need network namespaces: {REASON}")

WORKER = str(Path(__file__).with_name("two_hosts_worker.py"))
REQUESTS = [(11, 30, 13), (12, 17, 0), (13, 40, 32), (14, 9, 5)]  # (id, prompt, reused)
REPLY_SECONDS = 120.0  # a worker that does not answer within this is hung: the test fails
BLOCK_BYTES = 4 * 2 * TPB * SHAPE[3] * LAYERS  # fp32, every layer


class Worker:
    """A worker process in one namespace, driven over its stdin/stdout."""

    def __init__(self, hosts: TwoHosts, side: Side, *argv: str) -> None:
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=side.device, OMP_NUM_THREADS="1")
        env.pop("UCX_MEMTYPE_CACHE", None)
        self.proc = hosts.popen(side, [sys.executable, WORKER, *argv], env=env)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_SECONDS)
        assert ready, f"worker pid {self.proc.pid} did not answer within {REPLY_SECONDS} s"
        line = self.proc.stdout.readline()
        assert line, f"worker pid {self.proc.pid} exited (status {self.proc.poll()})"
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.send({"op": op, **fields})
        return self.reply()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "stop"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    with TwoHosts() as h:
        yield h


class Pair:
    """The receiver on host b, a sender on host a, the key they share."""

    def __init__(self, hosts: TwoHosts) -> None:
        self.hosts = hosts
        self.key = secrets.token_hex(32)
        self.receiver = Worker(hosts, hosts.b, "receiver", f"tcp://{hosts.b.ip}:0")
        self.receiver.send({"key": self.key})
        self.url = self.receiver.reply()["url"]
        assert self.url.startswith(f"nixl+tcp://{hosts.b.ip}:")
        self.sender = Worker(hosts, hosts.a, "sender")

    def close(self) -> None:
        self.sender.stop()
        self.receiver.stop()


@pytest.fixture
def pair(hosts: TwoHosts) -> Iterator[Pair]:
    p = Pair(hosts)
    try:
        yield p
    finally:
        p.close()


def tables(seed: int, base: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Disjoint random blocks per request on each side (-1 past a request's blocks)."""
    rng = np.random.default_rng(seed)
    widths = [-(-p // TPB) for _, p, _ in REQUESTS]
    src, dst = rng.permutation(SHAPE[0]), rng.permutation(SHAPE[0])
    at = np.cumsum([0, *widths])
    width = max(widths)
    pad = lambda row: [int(b) for b in row] + [-1] * (width - len(row))  # noqa: E731
    return [pad(src[at[i] : at[i + 1]]) for i in range(len(REQUESTS))], [
        pad(dst[at[i] : at[i + 1]]) for i in range(len(REQUESTS))
    ]


def start(
    pair: Pair, offset: int, seed: int, mode: str = "early", timeout: Optional[float] = None
) -> tuple[list[int], list[list[int]], list[list[int]], dict[str, Any]]:
    """Connects the sender, has the receiver expect ``REQUESTS`` (ids shifted by ``offset``),
    and returns the ids, the tables and the `run` command for them."""
    rids = [rid + offset for rid, _, _ in REQUESTS]
    got = pair.receiver.call("expect", requests=[[rid + offset, prompt] for rid, prompt, _ in REQUESTS])
    assert got["ok"], got
    reply = pair.sender.call("connect", url=pair.url, key=pair.key, mode=mode, timeout=timeout)
    assert reply["ok"], reply
    src, dst = tables(seed)
    run = {
        "requests": [[rid + offset, p, r, got["epochs"][str(rid + offset)]] for rid, p, r in REQUESTS],
        "src": src,
        "dst": dst,
    }
    return rids, src, dst, run


def check_arrived(pair: Pair, rids: list[int], src: list[list[int]], dst: list[list[int]]) -> None:
    """Every request complete at the receiver, bit exact, each (layer, block) once; then
    released by both sides, and nothing left on either."""
    pool = source_pool(7)
    for i, rid in enumerate(rids):
        n = -(-REQUESTS[i][1] // TPB)
        got = pair.receiver.call("wait", rid=rid, dst=dst[i][:n], timeout=60)
        assert got["ok"], got
        assert got["digest"] == digest(pool, src[i][:n]), f"request {rid}: bytes differ"
        assert got["once"], f"request {rid}: a (layer, block) arrived other than once"
    settle(pair, rids)


def settle(pair: Pair, rids: list[int], release_timeout: float = 30.0) -> dict[str, Any]:
    held = pair.sender.call("settle", rids=rids)
    assert held["ok"] and held["leased"] == [] and held["book"] == 0, held
    for rid in rids:
        got = pair.receiver.call("release", rid=rid, timeout=release_timeout)
        assert got["ok"], got
    state = pair.receiver.call("state")
    assert state["live"] == 0, state
    return held


def payload(rids: list[int]) -> int:
    return sum(-(-prompt // TPB) for _, prompt, _ in REQUESTS) * BLOCK_BYTES


@pytest.mark.parametrize("mode", ["early", "chunk", "layer"])
def test_sender_and_receiver_on_two_hosts_bit_exact(pair: Pair, hosts: TwoHosts, mode: str) -> None:
    rids, src, dst, run = start(pair, 0, 1, mode)
    sent_before = hosts.tx_bytes(hosts.a)
    got = pair.sender.call("run", **run)
    assert got["ok"], got
    # The blocks crossed the veth (UCX over TCP), not a shortcut between the processes.
    assert hosts.tx_bytes(hosts.a) - sent_before >= payload(rids)
    check_arrived(pair, rids, src, dst)


def test_link_down_mid_transfer_fails_in_bounded_time_and_leaks_nothing(pair: Pair, hosts: TwoHosts) -> None:
    rids, src, dst, run = start(pair, 100, 2, timeout=2.0)
    pair.sender.send({"op": "run", **run, "pause": True})
    assert pair.sender.reply() == {"paused": True}  # the early blocks landed
    hosts.set_link(False)
    pair.sender.send({"op": "go"})
    got = pair.sender.reply()
    # The chunks' write outlived the sender's timeout on the dead link: aborted, its requests failed.
    assert not got["ok"] and got["type"] == "TransferTimeoutError", got
    assert set(got["request_ids"]) <= set(rids) and got["request_ids"], got
    waited = pair.receiver.call("wait", rid=got["request_ids"][0], dst=[0], timeout=1.0)
    assert not waited["ok"] and waited["type"] in ("TransferTimeoutError", "TransferError"), waited
    hosts.set_link(True)
    # With the link back the fences arrive: every block is released on both sides.
    held = settle(pair, rids)
    assert set(held["failed"]) == set(got["request_ids"])
    pair.sender.call("close")
    rids, src, dst, run = start(pair, 200, 3)
    assert pair.sender.call("run", **run)["ok"]
    check_arrived(pair, rids, src, dst)


def test_killed_sender_fails_its_requests_in_bounded_time_and_the_endpoint_serves_the_next(
    pair: Pair, hosts: TwoHosts
) -> None:
    rids, src, dst, run = start(pair, 300, 4)
    pair.sender.send({"op": "run", **run, "pause": True})
    assert pair.sender.reply() == {"paused": True}
    pair.sender.kill()
    for rid in rids:
        # NIXL notices travel apart from the socket, so its end cannot say which blocks a dead
        # sender still owed: the wait's own timeout fails the request (kvferry.transports.nixl)...
        got = pair.receiver.call("wait", rid=rid, dst=[0], timeout=2.0)
        assert not got["ok"] and got["type"] == "TransferTimeoutError" and "did not arrive" in got["error"], got
        # ...and the socket's end fences it: released as soon as the end is seen.
        assert pair.receiver.call("release", rid=rid, timeout=30)["ok"]
    assert pair.receiver.call("state")["live"] == 0
    pair.sender = Worker(hosts, hosts.a, "sender")
    rids, src, dst, run = start(pair, 400, 5)
    assert pair.sender.call("run", **run)["ok"]
    check_arrived(pair, rids, src, dst)


def test_killed_receiver_fails_the_senders_requests_in_bounded_time(pair: Pair) -> None:
    rids, src, dst, run = start(pair, 500, 6, timeout=5.0)
    pair.sender.send({"op": "run", **run, "pause": True})
    assert pair.sender.reply() == {"paused": True}
    pair.receiver.kill()
    pair.sender.send({"op": "go"})
    got = pair.sender.reply()
    assert not got["ok"] and "TransferError" in got["error"], got
    held = pair.sender.call("settle", rids=rids)
    assert held["ok"] and held["leased"] == [] and held["book"] == 0, held


def test_wrong_key_is_refused_and_the_endpoint_serves_good_peers(pair: Pair) -> None:
    got = pair.sender.call("connect", url=pair.url, key=secrets.token_hex(32), mode="early")
    assert not got["ok"] and "cannot reach the receiver" in got["error"], got
    state = pair.receiver.call("state")
    assert state["error_count"] >= 1 and any("refused" in e for e in state["errors"]), state
    rids, src, dst, run = start(pair, 600, 7)
    assert pair.sender.call("run", **run)["ok"]
    check_arrived(pair, rids, src, dst)


PROBE = """
import socket, sys
host, port, garbage = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
s = socket.create_connection((host, port), timeout=60)
s.sendall(garbage)
s.settimeout(60)
try:
    while s.recv(4096):  # until the endpoint drops the connection
        pass
except ConnectionResetError:
    pass
print("dropped")
"""


def test_garbage_and_silence_at_the_port_are_dropped_and_good_peers_served(pair: Pair, hosts: TwoHosts) -> None:
    host, _, port = pair.url.removeprefix("nixl+tcp://").rpartition(":")
    for garbage in (secrets.token_bytes(4096), b"GET / HTTP/1.1\r\n\r\n", b""):  # b"": connects, says nothing
        probe = subprocess.run(
            hosts.command(hosts.a, [sys.executable, "-c", PROBE, host, port, garbage.hex()]),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert probe.returncode == 0 and probe.stdout.strip() == "dropped", probe.stderr
    state = pair.receiver.call("state")
    assert state["error_count"] >= 3, state
    rids, src, dst, run = start(pair, 700, 8)
    assert pair.sender.call("run", **run)["ok"]
    check_arrived(pair, rids, src, dst)
