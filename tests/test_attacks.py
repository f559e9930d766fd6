"""Attacks on the control plane from raw sockets, against real endpoints: each attack, then a
legitimate transfer that must arrive bit exact, with the endpoint's threads and descriptors
back to what they were and nothing of kvferry's left in /dev/shm (docs/security.md)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Optional

import pytest
import torch
from helpers import (
    POOLS,
    SLACK,
    assert_nothing_leased,
    in_thread,
    left_in_shm,
    open_fds,
    serve,
    shm_endpoint,
    until,
)
from kvferry.errors import TransferError
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import guard, registry, wire
from kvferry.transports.frames import Announce, Challenge
from kvferry.transports.shm import ShmEndpoint, ShmTransport

LAYERS, SHAPE, TPB = POOLS.layers, POOLS.shape, POOLS.tpb


def transfer_bit_exact(
    receiver: KVReceiver, transport: Any, rid: int, src: Optional[PagedKV] = None, **sender_options: Any
) -> None:
    """A legitimate sender of ``src`` (random unless given) moves a request's blocks over
    ``transport``; they arrive bit exact, and the sender holds nothing of it afterwards."""
    src = src if src is not None else POOLS.random(rid)
    sender = KVSender(src, transport, **sender_options)
    try:
        dst = [5, 9, 2, 11]
        epoch = receiver.expect(rid, 4 * TPB)
        sender.add(rid, 4 * TPB, reused_len=0, epoch=epoch)
        sender.send_chunks([rid], [0], [4 * TPB], [list(range(4))], [dst])
        sender.flush(timeout=SLACK)
        receiver.wait(rid, timeout=SLACK)
        for layer_src, layer_dst in zip(src.layers, receiver.pool.layers):
            assert torch.equal(layer_src[:4], layer_dst[dst])
        receiver.release(rid, timeout=SLACK)
        sender.remove(rid)
        assert_nothing_leased(sender=sender)
    finally:
        sender.close()


def shm_transfer_bit_exact(receiver: KVReceiver, endpoint: Any, authkey: bytes, rid: int) -> None:
    transfer_bit_exact(receiver, ShmTransport(endpoint.address, authkey=authkey), rid)


class Relay:
    """A TCP forwarder: whoever is told its address reaches ``target`` through it. Keeps what
    the target sent, to show what the relay's owner could read."""

    def __init__(self, target: wire.Address) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.from_target = bytearray()
        self.relayed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = wire.connect(self.target, SLACK)
        self.relayed.set()

        def pipe(a: socket.socket, b: socket.socket, keep: bool) -> None:
            try:
                while data := a.recv(65536):
                    if keep:
                        self.from_target.extend(data)
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        self._threads = [
            threading.Thread(target=pipe, args=(client, upstream, False), daemon=True),
            threading.Thread(target=pipe, args=(upstream, client, True), daemon=True),
        ]
        for t in self._threads:
            t.start()
        for t in self._threads:
            t.join(SLACK)
        client.close()
        upstream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(SLACK)


def test_a_relayed_handshake_to_an_endpoint_fails() -> None:
    """A sender told a relay's address (as a forged kv_transfer_params.kvferry.peer would tell
    a prefill server) reaches a real endpoint through it: the handshake fails on both sides,
    the relay never sees the hello (the segment name), and a direct sender is served."""
    with shm_endpoint("tcp://127.0.0.1:0") as (receiver, endpoint, authkey):
        segment = endpoint._hello["segment"]["name"]  # noqa: SLF001
        before_errors = endpoint.error_count
        relay = Relay(wire.parse_address(endpoint.address))
        try:
            with pytest.raises(TransferError, match="cannot reach the receiver"):
                ShmTransport(relay.address, authkey=authkey)
            assert relay.relayed.is_set()
        finally:
            relay.close()
        assert segment.encode() not in relay.from_target
        assert until(lambda: endpoint.error_count > before_errors)
        assert "meant another endpoint" in str(endpoint.errors[-1])
        shm_transfer_bit_exact(receiver, endpoint, authkey, 1)


# -- pre-auth denial of service -----------------------------------------------------------------


def _connect_raw(address: str) -> socket.socket:
    where = wire.parse_address(address)
    if where.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where.path)  # blocking: waits for room in the backlog (with a timeout: EAGAIN)
        sock.settimeout(SLACK)
        return sock
    return socket.create_connection((where.host, where.port), timeout=SLACK)


def _notices_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvferry-notices")


@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
def test_a_thousand_idle_or_trickling_connections_lock_out_no_sender(listen: str) -> None:
    """1,000 connections held open in their handshake (every third has sent part of a frame
    header and stalls): the endpoint holds at most its bound of them (threads and
    descriptors), a legitimate sender connecting after them is served bit exact, and once
    they close, threads, descriptors and /dev/shm are back to what they were."""
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_fds() + 2 * n + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    fds_before = open_fds()
    threads_before = set(threading.enumerate())
    try:
        with shm_endpoint(listen) as (receiver, endpoint, authkey):
            segments = {endpoint._hello["segment"]["name"]}  # noqa: SLF001
            held = []
            try:
                for i in range(n):
                    sock = _connect_raw(endpoint.address)
                    if i % 3 == 0:
                        sock.sendall(wire.MAGIC[:2])  # a trickle: part of a header, then nothing
                    held.append(sock)
                bound = guard.MAX_PENDING
                # Every one of them was accepted; all but the newest `bound` were cut off.
                assert until(lambda: endpoint._admission.evicted >= n - bound)  # noqa: SLF001
                assert len(endpoint._admission) <= bound and _notices_threads() <= bound + 1  # noqa: SLF001
                shm_transfer_bit_exact(receiver, endpoint, authkey, 1)
            finally:
                for sock in held:
                    sock.close()
            assert until(lambda: _notices_threads() == 0)
        assert [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()] == []
        assert_nothing_leased(threads=threads_before, fds=fds_before, segments=segments)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_accept_loop_survives_failing_to_start_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads cannot be started for a while (a pids or memory limit): those connections are
    dropped, the accept loop backs off and serves on, and the next sender is served."""
    with shm_endpoint("unix://") as (receiver, endpoint, authkey):
        real = threading.Thread.start
        refused: list[str] = []

        def start(self: threading.Thread) -> None:
            if self.name == "kvferry-notices" and len(refused) < 3:
                refused.append(self.name)
                raise RuntimeError("can't start new thread")
            real(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        for _ in range(3):
            with _connect_raw(endpoint.address) as sock:
                assert sock.recv(1) == b""  # closed by the endpoint, no thread for it
        assert len(refused) == 3
        shm_transfer_bit_exact(receiver, endpoint, authkey, 1)


_SENDER = r"""
import sys
from kvferry.transports.shm import ShmTransport
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
transport = ShmTransport(sys.argv[1], authkey=bytes.fromhex(sys.argv[2]), handshake_timeout=float(sys.argv[3]))
transport.close()
sys.stdout.write("served\n"); sys.stdout.flush()
"""


def test_out_of_descriptors_the_oldest_handshake_gives_way() -> None:
    """The receiver's process is out of descriptors while a peer sits in its handshake (for
    an hour, as far as its timeout goes): accept fails with EMFILE, the endpoint cuts off the
    oldest handshake to get a descriptor back, and a sender (another process) is served."""
    with shm_endpoint("unix://") as (receiver, endpoint, authkey):
        endpoint._handshake_timeout = 3600.0  # noqa: SLF001  (the stalled peer would hold its slot)
        stalled = _connect_raw(endpoint.address)
        assert until(lambda: len(endpoint._peers) == 1)  # noqa: SLF001  (accepted, in its handshake)
        proc = subprocess.Popen(
            [sys.executable, "-c", _SENDER, endpoint.address, authkey.hex(), str(SLACK)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers: list[int] = []
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline() == "ready\n"
            # Fill every free descriptor below the highest open one (holes other tests' closes
            # left): then the limit sits above every open descriptor, the stalled connection's
            # too, and the one it frees when cut off is the only one below the limit.
            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            while (lowest := os.dup(0)) <= top:
                fillers.append(lowest)
            os.close(lowest)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # the next descriptor: EMFILE
            proc.stdin.write("go\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            for fd in fillers:
                os.close(fd)
            proc.wait(SLACK)
        assert answer == "served\n"
        assert any(isinstance(e, OSError) and e.errno == errno.EMFILE for e in endpoint.errors)
        stalled.settimeout(SLACK)
        got = b""
        while chunk := stalled.recv(4096):
            got += chunk
        assert len(got) == wire.HEADER.size + wire.HANDSHAKE_LIMIT  # its challenge, then the end: cut off
        stalled.close()
        shm_transfer_bit_exact(receiver, endpoint, authkey, 1)


def test_nixl_descriptor_rows_past_int32_are_refused() -> None:
    """A pool (its geometry from a peer's hello) whose descriptor rows pass int32: refused by
    name, where a cast would wrap the row to another block's descriptor."""
    import numpy as np
    from kvferry.errors import InvalidArgumentError
    from kvferry.transports import nixl

    ids = np.array([0, 1], dtype=np.int64)
    assert nixl.descriptor_indices(ids, (1, 2), 2, 4).tolist() == [8, 9, 12, 13]
    with pytest.raises(InvalidArgumentError, match="int32"):
        nixl.descriptor_indices(np.array([2**16 - 1], dtype=np.int64), (0, 2), 2**15, 2**16)
    with pytest.raises(InvalidArgumentError, match="int32"):
        nixl.offset_rows(np.array([5], dtype=np.int32), 2**31 - 3)


def nixl_hello(**changes: Any) -> dict[str, Any]:
    """A NIXL receiver's hello as the sender reads it: 2 layers of 2 segments of 8 blocks of
    64 bytes, packed, each layer registered as its own region; ``changes`` replace fields."""
    hello: dict[str, Any] = {
        "geometry": {
            "num_layers": 2,
            "tokens_per_block": 16,
            "dtype": "torch.bfloat16",
            "segments": 2,
            "segment_bytes": 64,
            "block_layout": "any",
        },
        "num_blocks": 8,
        "block_dim": 1,
        "kind": "nixl",
        "agent_name": "kvferry-rx-0",
        "agent_metadata": b"opaque",
        "mem_type": "DRAM",
        "device": 0,
        "bases": [0x10000, 0x20000],
        "segment_stride": 512,
        "block_stride": 64,
        "regions": [{"start": 0x10000, "length": 1024}, {"start": 0x20000, "length": 1024}],
    }
    hello.update(changes)
    return hello


ONE_REGION = [{"start": 0x10000, "length": 0x20000}]


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"block_stride": 32}, "segment_stride=512, block_stride=32: 2 segments of 64 bytes in 8 blocks .* overlap"),
        ({"segment_stride": 256}, "segment_stride=256, block_stride=64: .* overlap"),
        ({"bases": [0x10000, 0x10040], "regions": ONE_REGION}, r"bases=\[65536, 65600\], .*: two blocks overlap"),
        (
            {"bases": [0x10000, 0x20100]},
            "block 4 of segment 1 of layer 1 at address .* outside every registered region",
        ),
        ({"bases": [0x100, 0x20000]}, "block 0 of segment 0 of layer 0 at address 256 .* outside every registered"),
        (
            {"regions": [{"start": 0x10000, "length": 2048}, {"start": 0x10400, "length": 1024}]},
            "regions=.*: they overlap",
        ),
        ({"bases": [0x10000, 2**64 - 100]}, "bases up to .* pass the 64-bit address space"),
    ],
    ids=["blocks-overlap", "segments-overlap", "layers-overlap", "past-region", "before-region", "regions", "wrap"],
)
def test_a_nixl_hello_that_would_write_outside_the_receivers_regions_is_refused(changes: Any, why: str) -> None:
    """The sender checks the receiver's bases, strides and regions together before any
    descriptor reaches NIXL: every block inside a registered region, no two blocks over
    one another, no address past 64 bits; a hello that fails is refused by name."""
    import numpy as np
    from kvferry.transports import nixl

    rows = nixl._remote_pool(nixl_hello(), "peer x")
    assert len(rows) == 2 * 2 * 8 and rows[:, 1].tolist() == [64] * 32
    assert rows[:3, 0].tolist() == [0x10000, 0x10040, 0x10080]
    assert np.unique(rows[:, 0]).size == 32
    with pytest.raises(wire.ProtocolError, match="peer x: invalid NIXL hello: " + why):
        nixl._remote_pool(nixl_hello(**changes), "peer x")


@pytest.mark.parametrize(
    "changes, field",
    [({"segment_stride": 0}, "segment_stride"), ({"block_stride": 0}, "block_stride"), ({"regions": []}, "regions")],
)
def test_the_codec_refuses_a_nixl_hello_without_strides_or_regions(changes: Any, field: str) -> None:
    """Zero strides and an empty region list are refused by the codec itself (rust/src/wire),
    on both sides: the encoder refuses what the decoder would."""
    from kvferry.errors import InvalidArgumentError
    from kvferry.transports.frames import Hello

    assert wire.encode(Hello(nixl_hello()))
    with pytest.raises(InvalidArgumentError, match=f"invalid {field}="):
        wire.encode(Hello(nixl_hello(**changes)))


def test_a_nixl_receiver_whose_hello_lies_is_refused_before_any_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver whose hello's regions do not cover its blocks (a hostile or broken peer):
    the sender refuses it by name before it creates an agent, registers memory or adds the
    peer; the receiver's pool is untouched."""
    pytest.importorskip("nixl")
    from kvferry.transports import nixl, nixl_hub

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    src, dst = POOLS.random(3), POOLS.nan()
    served = serve("nixl", dst)
    made: list[str] = []
    real_agent = nixl_hub._agent
    monkeypatch.setattr(nixl_hub, "_agent", lambda role, **kw: made.append(role) or real_agent(role, **kw))
    try:
        hello = served.endpoint._hello
        first = hello["regions"][0]
        hello["regions"] = [dict(first, length=first["length"] // 2), *hello["regions"][1:]]
        with pytest.raises(wire.ProtocolError, match="invalid NIXL hello: block .* outside every registered region"):
            nixl.NixlTransport(served.endpoint.address, authkey=served.authkey, src=src)
        assert made == []
        assert all(bool(torch.isnan(layer).all()) for layer in dst.layers)
    finally:
        served.close()
    assert_nothing_leased(served.receiver)


# -- a key-holder that stops reading ------------------------------------------------------------


class Stalled:
    """A key-holder that stops reading: it authenticates to a staging endpoint on a Unix
    socket, takes its hello (and so a ring), and from then on only sends. Each staged frame
    with nothing in it is still answered with a free, so a flood of them fills the socket
    towards it (its receive buffer made small)."""

    def __init__(self, address: str, authkey: bytes) -> None:
        from kvferry.transports.frames import Hello

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(wire.parse_address(address).path)
        wire.handshake(self.sock, authkey, wire.ROLE_SENDER, SLACK, address)
        self.sock.settimeout(SLACK)
        hello, fds = wire.recv_frame_fds(self.sock)
        self.sock.settimeout(None)
        for fd in fds:
            os.close(fd)
        assert isinstance(hello, Hello)

    def send(self, frame: Any) -> None:
        self.sock.sendall(wire.encode(frame))

    def flood(self, endpoint: Any) -> None:
        """Sends empty staged frames until the endpoint's answers to it wait in a queue (the
        socket towards it is full), or, for an endpoint that sends on its own connection's
        thread, until that thread stopped reading (SLACK only bounds how long that takes to
        show). Returns early if the endpoint cut it off."""
        import numpy as np
        from kvferry.transports.frames import Staged

        empty = np.empty(0, dtype=np.int64)
        batch = wire.encode(Staged([], 0, 0, empty, empty)) * 512
        (peer,) = endpoint._peers  # noqa: SLF001
        poller = select_poll(self.sock)
        self.sock.setblocking(False)
        view = memoryview(b"")
        while not getattr(peer.channel, "waiting", 0):
            view = view or memoryview(batch)
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                if not poller.poll(SLACK * 1000):
                    return  # the endpoint no longer reads
            except OSError:
                return  # cut off
        self.sock.setblocking(True)

    def close(self) -> None:
        self.sock.close()


def select_poll(sock: socket.socket) -> Any:
    import select

    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return poller


def test_a_sender_that_stops_reading_cannot_hold_up_a_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key-holder announces a request, then floods the endpoint with staged frames and
    never reads the answers. Giving the request up (a decode engine's step: `release`) asks
    its sender to cancel, which used to be sent on the caller's thread and blocked it as
    long as the attacker kept its connection. Now the cancellation waits in the connection's
    queue, the release returns at once, the endpoint cuts the attacker off once nothing
    moved for its send timeout (made short here), and a legitimate sender is served."""
    from kvferry.errors import TransferTimeoutError
    from kvferry.transports.staging import StagingTransport

    monkeypatch.setattr(wire, "SEND_SECONDS", 1.0)
    served = serve("staging", POOLS.random(98), capacity_blocks=8)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    attacker = Stalled(endpoint.address, authkey)
    try:
        epoch = receiver.expect(7, 4 * TPB)
        attacker.send(Announce([(7, epoch)]))
        (peer,) = endpoint._peers  # noqa: SLF001
        assert until(lambda: receiver.owns_unfinished(peer.source))
        attacker.flood(endpoint)
        done, outcome = in_thread(lambda: receiver.release(7, timeout=0))
        assert done.wait(SLACK), "release blocked on a sender that does not read"
        assert isinstance(outcome[0], TransferTimeoutError), outcome  # asked to cancel; no fence yet
        assert until(lambda: any("stopped reading" in str(e) for e in list(endpoint.errors)))
        receiver.release(7, timeout=SLACK)  # its connection ended: fenced
        transfer_bit_exact(receiver, StagingTransport(endpoint.address, authkey=authkey), 1)
    finally:
        attacker.close()
        served.close()
    assert_nothing_leased(receiver)


def test_a_sender_that_stops_reading_cannot_hold_up_a_new_senders_connect() -> None:
    """The one ring is held by a key-holder that floods the endpoint and never reads. A new
    sender's connect makes room by closing it (idle_reclaim_s 0): the goodbye to it used to
    block under its connection's send lock, and the new sender's read of its hello had no
    deadline, so ``connect(..., handshake_timeout=3)`` never returned. Now goodbyes never
    block and the hello has the handshake's deadline: the connect returns, served."""
    served = serve("staging", POOLS.random(97), capacity_blocks=8, max_senders=1, idle_reclaim_s=0)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    attacker = Stalled(endpoint.address, authkey)
    try:
        attacker.flood(endpoint)
        url = f"staging+{endpoint.address}"
        done, outcome = in_thread(lambda: registry.connect(url, authkey=authkey, handshake_timeout=3))
        assert done.wait(SLACK), "connect blocked behind a sender that does not read"
        transport = outcome[0]
        assert not isinstance(transport, BaseException), transport
        transfer_bit_exact(receiver, transport, 1)
    finally:
        attacker.close()
        served.close()
    assert_nothing_leased(receiver)


def test_a_staged_write_admitted_before_a_release_never_lands_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging endpoint admits a write, then copies it outside the receiver's lock. The
    decode side gives the request up and releases it unfenced in between (as after an
    abandon, or past its fence timeout), and a new owner writes 0x11 into the blocks: the
    admitted copy used to land afterwards, over the new owner's bytes. Now the release does
    not forget the request while the copy it admitted is still landing (with a timeout of 0
    it says so), and once the copy landed nothing of the old request reaches the blocks."""
    import kvferry.transports.staging as staging
    from kvferry.errors import TransferTimeoutError

    real, copying, go = staging._unstage, threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        copying.set()
        assert go.wait(SLACK)
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "_unstage", held)
    served = serve("staging", capacity_blocks=8)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    sender = KVSender(POOLS.random(5), staging.StagingTransport(endpoint.address, authkey=authkey))
    try:
        dst = [5, 9, 2, 11]
        epoch = receiver.expect(3, 4 * TPB, dst_blocks=dst)
        sender.add(3, 4 * TPB, reused_len=0, epoch=epoch)
        sender.send_chunks([3], [0], [4 * TPB], [list(range(4))], [dst])
        assert copying.wait(SLACK)  # admitted; its copy not begun
        receiver.cancel(3, "the decode request was aborted")
        with pytest.raises(TransferTimeoutError, match="still copying"):
            receiver.release_unfenced(3, timeout=0)
        go.set()
        receiver.release_unfenced(3)  # returns once the admitted copy landed
        for layer in receiver.pool.layers:
            layer[dst] = 0x11  # the blocks' new owner
        with pytest.raises(TransferError, match="cancelled by the receiver"):
            sender.flush(timeout=SLACK)  # it hears of the cancel; what it still had is refused
        for layer in receiver.pool.layers:
            assert bool((layer[dst] == 0x11).all())
    finally:
        go.set()
        sender.close()
        served.close()


# -- idle authenticated peers -------------------------------------------------------------------


def _until_lost(transport: object) -> None:
    """Reads what the receiver sent until the connection's end raises (bounded by SLACK)."""
    assert not until(lambda: transport.check_peer() is not None, timeout=SLACK)  # type: ignore[attr-defined]


def test_idle_senders_do_not_lock_out_the_seventeenth() -> None:
    """16 authenticated senders hold every staging ring and stay silent: the 17th takes the
    place of the one silent longest that owns no unfinished request (the one that does is
    kept), is served bit exact, and the one closed is told why. Rings and threads come back."""
    from kvferry.transports.staging import StagingTransport

    served = serve("staging", POOLS.random(99), capacity_blocks=8, max_senders=16, idle_reclaim_s=0)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    rings: set[str] = set()
    try:
        busy = StagingTransport(endpoint.address, authkey=authkey)
        epoch = receiver.expect(50, 4 * TPB)
        busy.announce([(50, epoch)])  # owns an unfinished request: never reclaimed
        (peer,) = endpoint._peers  # noqa: SLF001
        assert until(lambda: receiver.owns_unfinished(peer.source))  # the announce was taken
        idle = [StagingTransport(endpoint.address, authkey=authkey) for _ in range(15)]
        rings = set(endpoint.ring_names())
        assert len(rings) == 16
        seventeenth = StagingTransport(endpoint.address, authkey=authkey)
        assert endpoint.reclaimed_count == 1
        with pytest.raises(TransferError, match="idle for .* while another sender needed its place"):
            _until_lost(idle[0])
        busy.check_peer()  # still connected
        transfer_bit_exact(receiver, seventeenth, 1)
        for t in idle[1:] + [busy]:
            t.close()
        idle[0].close()
        assert_nothing_leased(endpoint=endpoint, segments=rings)
    finally:
        served.close()
    assert endpoint.ring_names() == [] and left_in_shm(rings) == set()
    assert _notices_threads() == 0 or until(lambda: _notices_threads() == 0)


@pytest.mark.parametrize("idle_reclaim_s", [3600.0, 0.0])
def test_max_peers_bounds_authenticated_connections(idle_reclaim_s: float) -> None:
    """``max_peers=1``: a second authenticated sender is refused by name while the first has
    not been idle ``idle_reclaim_s``; once it has, the second takes its place."""
    with shm_endpoint(max_peers=1, idle_reclaim_s=idle_reclaim_s) as (receiver, endpoint, authkey):
        first = ShmTransport(endpoint.address, authkey=authkey)
        if idle_reclaim_s:
            with pytest.raises(TransferError, match=r"at most 1 senders at once \(max_peers\), none idle for 3600 s"):
                ShmTransport(endpoint.address, authkey=authkey)
            first.check_peer()
            first.close()
        else:
            second = ShmTransport(endpoint.address, authkey=authkey)
            with pytest.raises(TransferError, match="another sender needed its place"):
                _until_lost(first)
            first.close()
            second.close()
            assert endpoint.reclaimed_count == 1
        assert_nothing_leased(receiver, endpoint=endpoint)


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_peers", 0), ("max_peers", True), ("idle_reclaim_s", -1), ("idle_reclaim_s", float("inf"))],
)
def test_bad_connection_bounds_are_refused_by_name(option: str, value: object) -> None:
    from kvferry.errors import InvalidArgumentError

    shared = POOLS.shared()
    assert shared.pool is not None
    try:
        with pytest.raises(InvalidArgumentError, match=f"invalid {option}="):
            options: dict[str, Any] = {option: value}
            ShmEndpoint(KVReceiver(shared.pool), shared, authkey=secrets.token_bytes(32), **options)
    finally:
        shared.close()


# -- shared memory after a crash of both sides ------------------------------------------------

_RECEIVER = r"""
import sys, threading, torch
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.transports.shm import SharedPool, ShmEndpoint
from kvferry.transports.staging import StagingEndpoint
key, listen = bytes.fromhex(sys.argv[2]), sys.argv[3]
if sys.argv[1] == "staging":
    receiver = KVReceiver(PagedKV(tuple(torch.zeros(4, 2, 4, 8) for _ in range(2)), 4))
    endpoint = StagingEndpoint(receiver, authkey=key, capacity_blocks=4, address=listen)
    segment = "-"
else:
    shared = SharedPool.create(num_layers=2, shape=(4, 2, 4, 8), dtype=torch.float32, tokens_per_block=4)
    receiver = KVReceiver(shared.pool)
    endpoint = ShmEndpoint(receiver, shared, authkey=key, address=listen)
    segment = shared.descriptor["name"]
sys.stdout.write(endpoint.address + " " + segment + "\n"); sys.stdout.flush()
threading.Event().wait()
"""

_STAGER = r"""
import sys, threading
from kvferry.transports.shm import ShmTransport
from kvferry.transports.staging import StagingTransport
key = bytes.fromhex(sys.argv[3])
if sys.argv[1] == "staging":
    transport = StagingTransport(sys.argv[2], authkey=key)
    name = transport.ring_name
else:
    transport = ShmTransport(sys.argv[2], authkey=key)
    name = "-"
sys.stdout.write(name + "\n"); sys.stdout.flush()
threading.Event().wait()
"""


@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
@pytest.mark.parametrize("kind", ["staging", "shm"])
def test_a_sigkill_of_both_process_groups_leaves_no_segment(kind: str, listen: str) -> None:
    """A receiver (its endpoint, and the resource tracker its segments bring) and a connected
    sender, each in a process group of its own, both SIGKILLed: neither the staging ring the
    connection had nor the shm endpoint's pool is left in /dev/shm, over unix:// (the
    descriptor travels) and tcp:// (the sender opens it where the receiver holds it)."""
    authkey = secrets.token_bytes(32)
    procs: list[subprocess.Popen[str]] = []
    names: set[str] = set()
    try:
        argv = [sys.executable, "-c", _RECEIVER, kind, authkey.hex(), listen]
        receiver = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(receiver)
        assert receiver.stdout is not None
        address, segment = receiver.stdout.readline().split()
        assert address.startswith(listen.split(":")[0] + "://"), address
        argv = [sys.executable, "-c", _STAGER, kind, address, authkey.hex()]
        sender = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(sender)
        assert sender.stdout is not None
        ring = sender.stdout.readline().strip()
        names = {n for n in (segment, ring) if n != "-"}
        assert len(names) == 1 and all(n.startswith("kvferry-") for n in names), names
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(SLACK)
    left = left_in_shm(names)
    for name in left:  # the old code's leak: not left for the next test
        os.unlink(f"/dev/shm/{name}")
    assert left == set()


# -- the suite: every transport with an endpoint on CPU, over unix:// and tcp:// -----------------


def _attacks(address: str, authkey: bytes) -> None:
    """Raw attacks before the key: garbage, an HTTP request, a header announcing a huge
    frame, a trickled challenge, a wrong key, a reflected challenge; a relayed handshake."""
    garbage = [
        secrets.token_bytes(512),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.CHALLENGE, 1 << 30),
        wire.encode(Challenge(wire.ROLE_SENDER, secrets.token_bytes(32)))[:7],
        wire.encode(Challenge(wire.ROLE_ENDPOINT, secrets.token_bytes(32))),  # reflected
    ]
    for data in garbage:
        with _connect_raw(address) as raw:
            try:
                raw.sendall(data)
                raw.shutdown(socket.SHUT_WR)
            except OSError as err:  # it refused and closed before our bytes or our FIN went out: fine
                if err.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    raise
            got = b""
            with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread: a reset
                while chunk := raw.recv(4096):
                    got += chunk
            assert len(got) <= wire.HEADER.size + wire.HANDSHAKE_LIMIT  # its challenge at most
    with _connect_raw(address) as raw:  # a wrong key
        with pytest.raises(wire.AuthenticationError):
            wire.handshake(raw, secrets.token_bytes(32), wire.ROLE_SENDER, SLACK, address)
    where = wire.parse_address(address)
    if where.scheme == "tcp":
        relay = Relay(where)
        try:
            with _connect_raw(relay.address) as raw:
                with pytest.raises(wire.AuthenticationError):
                    wire.handshake(raw, authkey, wire.ROLE_SENDER, SLACK, relay.address)
        finally:
            relay.close()


@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
@pytest.mark.parametrize("name", [n for n in registry.names(device="cpu") if registry.spec(n).has_endpoint])
def test_each_transport_survives_the_attacks_and_serves_bit_exact(
    name: str, listen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attack against a real endpoint of each transport, then a legitimate transfer that
    arrives bit exact; the endpoint's threads end with it and none of its segments is left."""

    if name == "nixl":
        pytest.importorskip("nixl")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    threads_before = set(threading.enumerate())
    rpool = registry.receiver_pool(name, num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    receiver = KVReceiver(rpool.pool)
    authkey = secrets.token_bytes(32)
    served = registry.serve(name, receiver, authkey=authkey, address=listen, **rpool.serve_options)
    segments: set[str] = set()
    try:
        if rpool.shared is not None:
            segments.add(rpool.shared.descriptor["name"])
        _attacks(served.endpoint.address, authkey)
        src = POOLS.random(3)
        transport = registry.connect(served.url, authkey=authkey, src=src)
        segments.update(n for n in [getattr(transport, "ring_name", None)] if n)
        transfer_bit_exact(receiver, transport, 1, src, timeout=SLACK)
        assert served.endpoint.error_count >= 6  # each attack was refused and recorded
    finally:
        served.endpoint.close()
        del receiver
        rpool.close()

    assert_nothing_leased(threads=threads_before, segments=segments)


def test_an_shm_hello_over_tcp_opens_only_the_receivers_nameless_kvferry_segment(tmp_path: Any) -> None:
    """Over tcp:// the shm hello says where the receiver holds its nameless pool (pid, fd,
    inode); a hello pointing at anything else (a file of this process, a segment with a name,
    another inode) is refused by name before anything is mapped or written."""
    from kvferry.errors import TransferError
    from kvferry.transports import shm
    from kvferry.transports.shm import SharedPool

    shared = SharedPool.create(num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    other = open(tmp_path / "not-a-pool", "wb+")  # noqa: SIM115
    try:
        fd = shared.fileno()
        name = shared.descriptor["name"]
        holder = {"pid": os.getpid(), "fd": fd, "inode": os.fstat(fd).st_ino}
        with pytest.raises(TransferError, match="not the receiver's nameless segment"):
            shm._open_held(holder, shared.descriptor)  # still named: not what an endpoint hands out
        shared.remove_name()
        os.close(shm._open_held(holder, shared.descriptor))  # the real one opens
        with pytest.raises(TransferError, match="not the receiver's segment"):
            shm._open_held(dict(holder, inode=holder["inode"] + 1), shared.descriptor)
        with pytest.raises(TransferError, match="not the receiver's nameless segment"):
            shm._open_held(dict(holder, fd=other.fileno()), shared.descriptor)
        with pytest.raises(TransferError, match="cannot open the receiver's shared pool at /proc/"):
            shm._open_held(dict(holder, fd=2**20), shared.descriptor)
        with pytest.raises(TransferError, match="invalid segment name"):
            shm._open_held(holder, dict(shared.descriptor, name="../etc/passwd"))
        assert name not in os.listdir("/dev/shm")
    finally:
        other.close()
        shared.close()
