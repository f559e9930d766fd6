"""The control channel: addresses (unix://, tcp:// over IPv4 and IPv6), the handshake, and
the frame codec's refusals at a live endpoint."""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import re
import secrets
import socket
import struct
from typing import Any

import numpy as np
import pytest
import torch
from helpers import POOLS, SLACK, serve, shm_endpoint, until
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, LeaseError
from kvferry.transports import wire
from kvferry.transports.base import Write
from kvferry.transports.frames import Challenge, Proof
from kvferry.transports.shm import ShmEndpoint, ShmTransport

TPB = POOLS.tpb


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "listen, host",
    [
        ("tcp://127.0.0.1:0", "127.0.0.1"),
        pytest.param(
            "tcp://[::1]:0", "[::1]", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
        ),
        ("unix://", None),
    ],
)
def test_a_transfer_over_each_address_family(listen: str, host: str | None) -> None:
    """The endpoint advertises the host it bound and the port it got; a sender connecting
    to that URL is served end to end (the blocks land, the request completes)."""
    from kvferry.sender import KVSender

    with shm_endpoint(listen) as (receiver, endpoint, authkey):
        if host is None:
            assert endpoint.address.startswith("unix:///") and endpoint.address.endswith("/notices.sock")
        else:
            prefix = f"tcp://{host}:"
            assert endpoint.address.startswith(prefix) and 0 < int(endpoint.address[len(prefix) :]) < 65536
        src = POOLS.random(7)
        transport = ShmTransport(endpoint.address, authkey=authkey)
        assert endpoint.address in transport.peer
        sender = KVSender(src, transport)
        dst = [5, 9, 2, 11]
        epoch = receiver.expect(1, 16)
        sender.add(1, 16, reused_len=0, epoch=epoch)
        sender.send_chunks([1], [0], [16], [list(range(4))], [dst])
        sender.flush(timeout=SLACK)
        receiver.wait(1, timeout=SLACK)
        for layer_src, layer_dst in zip(src.layers, receiver.pool.layers):
            assert torch.equal(layer_src[:4], layer_dst[dst])
        receiver.release(1)
        sender.remove(1)
        sender.close()


def test_a_wildcard_bind_advertises_the_host_it_is_told() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"invalid address='tcp://0.0.0.0:0': a wildcard bind needs advertise="
    ):
        with shm_endpoint("tcp://0.0.0.0:0"):
            pass
    with shm_endpoint("tcp://0.0.0.0:0", advertise="127.0.0.1") as (receiver, endpoint, authkey):
        assert endpoint.address.startswith("tcp://127.0.0.1:")
        transport = ShmTransport(endpoint.address, authkey=authkey)
        receiver.expect(1, 8)
        transport.post([Notice(1, 0, 0, 2, True)])
        receiver.wait(1, timeout=SLACK)
        transport.close()


@pytest.mark.parametrize(
    "text, why",
    [
        ("/tmp/x.sock", "expected unix:///path or tcp://host:port"),
        ("unix://relative.sock", "absolute path"),
        ("tcp://host", "expected tcp://host:port"),
        ("tcp://::1:5", "IPv6 in brackets"),
        ("tcp://[127.0.0.1]:5", "not an IPv6 address"),
        ("tcp://[::1]5", "written tcp://"),
        ("tcp://h:70000", r"port must be a number in \[0, 65535\]"),
        ("tcp://h:-1", "port must be a number"),
        ("tcp://h:5/x", "the port must be a number"),
        ("http://h:5", "expected unix:///path or tcp://host:port"),
    ],
)
def test_bad_addresses_are_refused_by_name(text: str, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"invalid address={re.escape(repr(text))}: .*{why}"):
        wire.parse_address(text)
    with pytest.raises(InvalidArgumentError, match=f"invalid address={re.escape(repr(text))}"):
        ShmTransport(text, authkey=secrets.token_bytes(32))


def test_address_round_trips() -> None:
    for text in ("unix:///run/k.sock", "tcp://10.0.0.5:7000", "tcp://[fe80::1]:0", "tcp://node-3.example:443"):
        assert wire.parse_address(text).url() == text
    assert wire.parse_address("tcp://:7000").url() == "tcp://127.0.0.1:7000"  # no host: loopback


def test_a_tcp_endpoint_without_a_host_binds_loopback() -> None:
    with shm_endpoint("tcp://:0") as (_, endpoint, _):
        address = wire.parse_address(endpoint.address)
        assert address.host == "127.0.0.1" and address.port > 0
        assert endpoint._listener.getsockname()[0] == "127.0.0.1"  # noqa: SLF001


def test_bad_handshake_timeout_is_refused() -> None:
    for bad in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(InvalidArgumentError, match="invalid handshake_timeout="):
            with shm_endpoint(handshake_timeout=bad):
                pass


# --- nothing from the wire is executed ---------------------------------------------------------


class _Touch:
    """Unpickling this creates ``path``: the proof that a pickle was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _closed_with(transport: ShmTransport, pattern: str) -> bool:
    def closed() -> bool:
        try:
            transport.check_peer()
        except TransferError as err:
            assert re.search(pattern, str(err)), str(err)
            return True
        return False

    return until(closed)


def _serves(receiver: KVReceiver, endpoint: ShmEndpoint, authkey: bytes, rid: int) -> None:
    """A good sender is served end to end after whatever came before."""
    good = ShmTransport(endpoint.address, authkey=authkey)
    receiver.expect(rid, 8)
    good.post([Notice(rid, 0, 0, 2, True)])
    receiver.wait(rid, timeout=SLACK)
    good.close()
    receiver.release(rid)


@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
def test_a_pickle_on_the_wire_executes_nothing(tmp_path: pathlib.Path, listen: str) -> None:
    """A pickle that would create a file when unpickled, sent at the port before the
    handshake (as multiprocessing would frame it) and by an authenticated sender inside a
    notices frame and bare: nothing is created, each connection is closed with a clear error
    (a goodbye for the authenticated one), and the endpoint serves a good sender after."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(str(marker)))
    pickle.loads(payload)  # the payload works: unpickling it does create the file
    assert marker.exists()
    marker.unlink()

    with shm_endpoint(listen) as (receiver, endpoint, authkey):
        address = wire.parse_address(endpoint.address)
        with wire.connect(address, SLACK) as raw:
            raw.sendall(struct.pack("!i", len(payload)) + payload)  # multiprocessing's framing
            raw.settimeout(SLACK)
            assert until(lambda: endpoint.error_count == 1)
        assert "refused: not a kvferry handshake: the peer's first bytes are not a kvferry frame" in str(
            endpoint.errors[-1]
        )

        # One request per rogue: a second rogue announcing the first's request could race the
        # first connection's end (which fails that request) and be refused for another reason.
        for rid, (raw_frame, why) in enumerate([
            (wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.NOTICES, len(payload)) + payload, "invalid frame"),
            (struct.pack("!i", len(payload)) + payload, "bad magic"),
        ], start=11):  # fmt: skip
            receiver.expect(rid, 8)
            rogue = ShmTransport(endpoint.address, authkey=authkey)
            rogue.announce([(rid, 0)])
            rogue._conn._channel.sock.sendall(raw_frame)  # noqa: SLF001  (a hostile key-holder)
            assert _closed_with(rogue, f"it closed the connection: disconnected: .*{why}")
            rogue.close()
            assert isinstance(endpoint.errors[-1], wire.ProtocolError)
            with pytest.raises(TransferError, match="went away.*broke the protocol"):
                receiver.wait(rid, timeout=SLACK)
            receiver.release(rid, timeout=SLACK)
        _serves(receiver, endpoint, authkey, 2)
    assert not marker.exists()


def test_garbage_at_the_port_is_refused_and_the_endpoint_serves_on() -> None:
    """Random bytes, an HTTP request, a header announcing a huge frame and a proof before
    any challenge: each refused in the handshake (recorded, nothing else changed)."""
    with shm_endpoint("tcp://127.0.0.1:0") as (receiver, endpoint, authkey):
        address = wire.parse_address(endpoint.address)
        garbage = [
            (secrets.token_bytes(4096), "first bytes are not a kvferry frame"),
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "first bytes are not a kvferry frame"),
            (wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.CHALLENGE, 1 << 30), "a malformed or oversized frame"),
            (wire.encode(Proof(bytes(32))), "a proof frame during the handshake, expected a challenge"),
        ]
        for n, (data, why) in enumerate(garbage, start=1):
            with wire.connect(address, SLACK) as raw:
                raw.sendall(data)
                assert until(lambda: endpoint.error_count == n)
            assert isinstance(endpoint.errors[-1], wire.AuthenticationError) and why in str(endpoint.errors[-1]), str(
                endpoint.errors[-1]
            )
        assert len(receiver) == 0 and receiver.refused_count == 0
        _serves(receiver, endpoint, authkey, 1)


def test_a_slow_handshake_is_dropped_within_its_timeout() -> None:
    """A peer that sends its challenge one byte at a time, never finishing: dropped once the
    whole handshake's timeout passed (each byte does not restart it)."""
    with shm_endpoint("tcp://127.0.0.1:0", handshake_timeout=0.5) as (receiver, endpoint, authkey):
        address = wire.parse_address(endpoint.address)
        with wire.connect(address, SLACK) as raw:
            challenge = wire.encode(Challenge(wire.ROLE_SENDER, secrets.token_bytes(32)))
            sent = 0
            for byte in challenge[:-1]:  # 44 bytes at least 0.1 s apart: over 4 s, against a 0.5 s bound
                if endpoint.error_count:
                    break
                try:
                    raw.sendall(bytes([byte]))
                except OSError:
                    break
                sent += 1
                until(lambda: endpoint.error_count > 0, timeout=0.1)  # paces the bytes
            assert until(lambda: endpoint.error_count == 1)
            assert sent < len(challenge) - 1  # dropped while bytes were still trickling in
        assert "no complete handshake within 0.5 s" in str(endpoint.errors[-1])
        _serves(receiver, endpoint, authkey, 1)


# --- leases: the receiver knows each request's blocks ---------------------------------------------


def test_a_one_sided_write_outside_the_lease_is_refused_before_it_counts() -> None:
    """Shared memory: a sender whose write names destination blocks other than the lease's
    gets its notice refused (nothing counts, the request fails), its connection closed with
    a goodbye; a write into the lease's blocks over another connection completes."""
    from kvferry.engine import ThreadCopyEngine

    engine = ThreadCopyEngine()
    try:
        with shm_endpoint("tcp://127.0.0.1:0") as (receiver, endpoint, authkey):
            src = POOLS.random(3)
            e1 = receiver.expect(1, 8, dst_blocks=[10, 11])
            rogue = ShmTransport(endpoint.address, authkey=authkey)
            notice = Notice(1, 0, 0, 2, True, e1)
            pending = rogue.write(
                engine, Write(src, np.array([0, 1]), np.array([10, 12]), [notice])
            )  # 12: another request's
            assert pending.wait(SLACK) and pending.error() is None
            rogue.post([notice])
            assert _closed_with(rogue, "it closed the connection: disconnected: .*wrote outside a request's lease")
            with pytest.raises(
                TransferError,
                match=(
                    r"request 1 failed: invalid dst_ids for request 1: .*wrote destination blocks \[10, 12\], the "
                    r"lease holds \[10, 11\]"
                ),
            ):
                receiver.wait(1, timeout=SLACK)
            refusal = receiver.refused()[-1]
            assert isinstance(refusal.error, LeaseError) and refusal.notice == notice
            rogue.close()
            assert receiver.release(1, timeout=SLACK).claimed_blocks == 0

            good = _lease_keeper_lands(
                ShmTransport(endpoint.address, authkey=authkey), engine, src, receiver, 2, [20, 21]
            )
            # A notice that names no blocks at all (a post without its write) is refused too.
            e3 = receiver.expect(3, 8, dst_blocks=[30, 31])
            good.post([Notice(3, 0, 0, 2, True, e3)])
            with pytest.raises(
                TransferError, match="request 3 failed: .*names no destination blocks, and the lease holds \\[30, 31\\]"
            ):
                receiver.wait(3, timeout=SLACK)
            good.close()
            receiver.release(2)
            receiver.release(3, timeout=SLACK)
    finally:
        engine.close()


def _lease_keeper_lands(good: Any, engine: Any, src: Any, receiver: KVReceiver, rid: int, dst: list[int]) -> Any:
    """After a rogue: a writer that keeps to its lease (request ``rid`` leased ``dst``) writes
    source blocks 0 and 1 there, and they land bit exact. Returns the writer, still open."""
    notice = Notice(rid, 0, 0, len(dst), True, receiver.expect(rid, 8, dst_blocks=dst))
    assert good.write(engine, Write(src, np.arange(len(dst)), np.array(dst), [notice])).wait(SLACK)
    good.post([notice])
    receiver.wait(rid, timeout=SLACK)
    for a, b in zip(src.layers, receiver.pool.layers):
        assert torch.equal(a[: len(dst)], b[dst])
    return good


def test_staging_copies_nothing_outside_the_lease() -> None:
    """Staging: the receiver copies from the ring itself, so a batch naming blocks outside
    its request's lease is refused before the copy: the pool's blocks keep their bytes."""
    from kvferry.engine import ThreadCopyEngine
    from kvferry.transports.staging import StagingTransport

    engine = ThreadCopyEngine()
    served = serve("staging", address="tcp://127.0.0.1:0", capacity_blocks=8)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        src = POOLS.random(5)
        e1 = receiver.expect(1, 8, dst_blocks=[4, 5])
        rogue = StagingTransport(endpoint.address, authkey=authkey)
        notice = Notice(1, 0, 0, 2, True, e1)
        assert rogue.write(engine, Write(src, np.array([0, 1]), np.array([4, 6]), [notice])).wait(SLACK)
        with contextlib.suppress(TransferError):  # post reads the frees after sending: the goodbye may be there already
            rogue.post([notice])
        assert _closed_with(rogue, "wrote outside a request's lease")
        with pytest.raises(TransferError, match="request 1 failed: invalid dst_ids"):
            receiver.wait(1, timeout=SLACK)
        for layer in receiver.pool.layers:
            assert not layer[[4, 5, 6]].any()  # not one byte of the batch landed
        rogue.close()
        receiver.release(1, timeout=SLACK)

        good = _lease_keeper_lands(
            StagingTransport(endpoint.address, authkey=authkey), engine, src, receiver, 2, [6, 7]
        )
        good.close()
        receiver.release(2)
    finally:
        endpoint.close()
        engine.close()


def _snapshot(pool: Any, blocks: list[int]) -> list[Any]:
    return [layer[blocks].clone() for layer in pool.layers]


def test_a_staged_write_past_its_lease_moves_no_byte_and_ends_the_connection() -> None:
    """Staging: a batch whose notice runs past its request's lease (request 1 holds blocks
    4 and 5; the notice covers 3 blocks, the third aimed at block 6 of request 2, which has
    completed) is refused before the copy, and its connection ends; request 2's blocks are
    bit-identical afterwards (issue 20 item 3: the range passed the lease check, the ring's
    bytes were copied over block 6, and only then did the ledger refuse, leaving the
    connection open)."""
    from kvferry.engine import ThreadCopyEngine
    from kvferry.transports.staging import StagingTransport

    engine = ThreadCopyEngine()
    served = serve("staging", address="tcp://127.0.0.1:0", capacity_blocks=8)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        good = _lease_keeper_lands(
            StagingTransport(endpoint.address, authkey=authkey), engine, POOLS.random(5), receiver, 2, [6, 7]
        )
        before = _snapshot(receiver.pool, [4, 5, 6, 7])
        e1 = receiver.expect(1, 8, dst_blocks=[4, 5])
        rogue = StagingTransport(endpoint.address, authkey=authkey)
        notice = Notice(1, 0, 0, 3, True, e1)
        assert rogue.write(engine, Write(POOLS.random(6), np.array([0, 1, 2]), np.array([4, 5, 6]), [notice])).wait(
            SLACK
        )
        with contextlib.suppress(TransferError):  # post reads the frees after sending: the goodbye may be there already
            rogue.post([notice])
        assert until(lambda: receiver.refused_count == 1)  # the batch was handled
        for a, b in zip(before, _snapshot(receiver.pool, [4, 5, 6, 7])):
            assert torch.equal(a, b)  # not one byte of the batch landed
        assert _closed_with(rogue, "wrote outside a request's lease")
        with pytest.raises(TransferError, match=r"request 1 failed: invalid dst_ids .*outside the lease's 2 blocks"):
            receiver.wait(1, timeout=SLACK)
        receiver.wait(2, timeout=SLACK)  # request 2 is untouched
        rogue.close()
        good.close()
        receiver.release(1, timeout=SLACK)
        receiver.release(2)
    finally:
        endpoint.close()
        engine.close()


def test_a_one_sided_notice_past_its_lease_ends_the_connection() -> None:
    """Shared memory: the sender's write lands before its notice (a one-sided copy), so the
    receiver checks the notice: one whose range runs past its request's lease is refused as
    outside the lease and its connection ends (issue 20 item 3: it was refused by the
    ledger only, and the connection stayed open to write again)."""
    from kvferry.engine import ThreadCopyEngine

    engine = ThreadCopyEngine()
    try:
        with shm_endpoint("tcp://127.0.0.1:0") as (receiver, endpoint, authkey):
            e1 = receiver.expect(1, 8, dst_blocks=[10, 11])
            rogue = ShmTransport(endpoint.address, authkey=authkey)
            notice = Notice(1, 0, 0, 3, True, e1)
            assert rogue.write(
                engine, Write(POOLS.random(3), np.array([0, 1, 2]), np.array([10, 11, 12]), [notice])
            ).wait(SLACK)
            rogue.post([notice])
            assert _closed_with(rogue, "it closed the connection: disconnected: .*wrote outside a request's lease")
            refusal = receiver.refused()[-1]
            assert isinstance(refusal.error, LeaseError) and refusal.notice == notice
            rogue.close()
            receiver.release(1, timeout=SLACK)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "dst_blocks, why",
    [
        ([1], "1 ids, the request has 2 blocks"),
        ([1, 1], "a destination block appears twice"),
        ([1, 999], "block 999 is outside the pool's"),
        ([-1, 2], "block -1 is outside the pool's"),
        ([[1, 2]], "a 1-d array of integer block ids"),
        ([1.0, 2.0], "a 1-d array of integer block ids"),
    ],
)
def test_bad_lease_blocks_are_refused_by_name(dst_blocks: object, why: str) -> None:
    receiver = KVReceiver(POOLS.random(0))
    with pytest.raises(InvalidArgumentError, match=f"invalid dst_blocks: .*{re.escape(why)}"):
        receiver.expect(1, 8, dst_blocks=dst_blocks)  # type: ignore[arg-type]
    assert len(receiver) == 0


def test_a_nixl_notification_outside_the_lease_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL: the notification names the destination ids its write used; ids other than the
    lease's are refused before the notice counts and end that agent's control connection
    (a goodbye saying why); a write into the lease's blocks still completes."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from kvferry.engine import ThreadCopyEngine
    from kvferry.transports.nixl import NixlTransport

    engine = ThreadCopyEngine()
    served = serve("nixl", address="tcp://127.0.0.1:0")
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        src = POOLS.random(6)
        e1 = receiver.expect(1, 8, dst_blocks=[4, 5])
        rogue = NixlTransport(endpoint.address, authkey=authkey, src=src)
        notice = Notice(1, 0, 0, 2, True, e1)
        rogue.announce([(1, e1)])
        pending = rogue.write(engine, Write(src, np.array([0, 1]), np.array([4, 6]), [notice]))
        assert pending.wait(SLACK) and pending.error() is None
        with pytest.raises(
            TransferError,
            match=r"request 1 failed: invalid dst_ids for request 1: .*\[4, 6\], the lease holds \[4, 5\]",
        ):
            receiver.wait(1, timeout=SLACK)
        assert _closed_with(rogue, "it closed the connection: disconnected: .*wrote outside a request's lease")
        rogue.close()
        receiver.release(1, timeout=SLACK)  # the agent's connection ended: fenced

        e2 = receiver.expect(2, 8, dst_blocks=[8, 9])
        good = NixlTransport(endpoint.address, authkey=authkey, src=src)
        notice = Notice(2, 0, 0, 2, True, e2)
        good.announce([(2, e2)])
        assert good.write(engine, Write(src, np.array([0, 1]), np.array([8, 9]), [notice])).wait(SLACK)
        receiver.wait(2, timeout=SLACK)
        for a, b in zip(src.layers, receiver.pool.layers):
            assert torch.equal(a[:2], b[[8, 9]])
        good.close()
        receiver.release(2)
    finally:
        endpoint.close()
        engine.close()


def _ended_with(conn: Any, pattern: str) -> bool:
    """Whether the endpoint ended ``conn`` (a `PeerConnection`) with a goodbye matching
    ``pattern``, read as it arrives."""

    def ended() -> bool:
        try:
            conn.check()
        except TransferError as err:
            assert re.search(pattern, str(err)), str(err)
            return True
        return False

    return until(ended)


def test_a_nixl_agent_name_is_bound_to_its_connection_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20 item 6: an ``agent`` frame binds its connection to the NIXL agent it names,
    once. A connection naming an agent another connection holds, a second ``agent`` frame, or
    an announce before any, ends that connection with a goodbye saying why; the holder keeps
    its agent and its requests (a thief's end fences nothing of theirs)."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from kvferry.transports.control import PeerConnection
    from kvferry.transports.frames import Agent, Announce

    served = serve("nixl", address="tcp://127.0.0.1:0")
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    conns: list[PeerConnection] = []

    def connect() -> PeerConnection:
        conns.append(PeerConnection(endpoint.address, authkey))
        return conns[-1]

    try:
        holder = connect()
        holder.send(Agent("kvferry-tx-holder"))
        e1 = receiver.expect(1, 8)
        holder.send(Announce([(1, e1)]))
        # The endpoint reads each connection on its own thread: the thief may connect only
        # once the holder's agent and announce were handled (request 1 is then the agent's).
        assert until(lambda: receiver.owns_unfinished("NIXL agent kvferry-tx-holder"))
        thief = connect()
        thief.send(Agent("kvferry-tx-holder"))
        assert _ended_with(thief, r"claims NIXL agent kvferry-tx-holder, which sender #\d+ .* holds")
        early = connect()
        early.send(Announce([(1, e1)]))
        assert _ended_with(early, "announce frame before its agent frame")
        # Both ends were handled (each ended its connection): request 1 is still the holder's.
        assert until(lambda: endpoint.error_count == 2)
        assert not receiver.fenced(1)
        holder.check()  # still connected
        holder.send(Agent("kvferry-tx-other"))
        bound = "a second agent frame .NIXL agent 'kvferry-tx-other'.: the connection is bound to NIXL agent"
        assert _ended_with(holder, f"{bound} kvferry-tx-holder")
        assert until(lambda: receiver.fenced(1))  # the holder's own end fences its requests
    finally:
        for conn in conns:
            conn.close()
        endpoint.close()


def test_every_frame_class_holds_its_records_fields() -> None:
    """The dataclasses of kvferry.transports.frames list the fields of the codec's records
    (rust/src/wire/), in wire order; the transports' set encodes and decodes only its own
    frames (the rendezvous's: tests/test_vllm_connector.py)."""
    from dataclasses import fields

    from kvferry import _core
    from kvferry.transports.frames import TRANSPORT, Hello, Revoke

    rendezvous = {"lookup", "destination", "refused", "abandon", "abandoned", "offer", "accepted"}
    assert set(TRANSPORT.classes) == set(_core.WIRE_FIELDS) - rendezvous | {"hello"}
    # The notices' checksums ride on the notices (`Notice.checksums`), not as a field.
    carried = {"notices": ("checksums",), "staged": ("checksums",)}
    for kind, cls in TRANSPORT.classes.items():
        if cls is not Hello:  # its Python form is the flat pool dict (rust/src/py/wire/hello.rs)
            names = tuple(f.name for f in fields(cls)) + carried.get(kind, ())
            assert names == _core.WIRE_FIELDS[kind], kind
    assert TRANSPORT.decode(wire.encode(Revoke(3, 2)), 16) == Revoke(3, 2)
    with pytest.raises(InvalidArgumentError, match='invalid kind="abandoned": not a frame of the transport channel'):
        _core.wire_encode("abandoned", {})
    with pytest.raises(InvalidArgumentError, match="invalid revoke: unknown field 'epcoh'"):
        _core.wire_encode("revoke", {"request_id": 1, "epcoh": 2})
    abandoned = _core.rendezvous_encode("abandoned", {"call": 1})
    with pytest.raises(InvalidArgumentError, match="a abandoned frame, which the transport channel does not take"):
        TRANSPORT.decode(abandoned, 4)


def test_the_wire_fuzz_corpus_seeds_every_frame_type() -> None:
    # rust/fuzz/seed_wire.py writes the rendezvous's seeds; the others came with their types.
    from kvferry import _core

    corpus = pathlib.Path(__file__).resolve().parent.parent / "rust" / "fuzz" / "corpus" / "wire"
    kinds = set()
    for path in corpus.iterdir():
        try:
            kinds.add(_core.wire_decode(path.read_bytes(), _core.WIRE_MAX_FRAME_BYTES)[0])
        except ValueError:
            pass  # a rendezvous frame, or an input the fuzzer kept for the refusals it reaches
        try:
            kinds.add(_core.rendezvous_decode(path.read_bytes(), _core.WIRE_MAX_FRAME_BYTES)[0])
        except ValueError:
            pass
    rendezvous = {"lookup", "destination", "refused", "abandon", "abandoned", "offer", "accepted"}
    assert rendezvous | {"challenge", "proof", "hello", "notices", "goodbye"} <= kinds, kinds


def _big_notices(tag: int, blocks: int) -> Any:
    from kvferry.transports.frames import Notices

    notice = Notice(tag, 0, 0, blocks, True, 1, 0, 1)
    return Notices([notice], np.arange(blocks, dtype=np.int64))


def test_try_send_never_waits_and_the_frame_it_began_goes_whole_before_later_ones() -> None:
    """`Channel.try_send_frame` on a socket whose peer reads nothing yet: a frame larger
    than the socket takes goes in part at once (the rest by the writer thread), a try
    while that rest waits sends nothing, and a blocking send made then goes only after
    that rest: the peer reads whole frames in order."""
    import threading

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    sender, reader = wire.Channel(a), wire.Channel(b)
    try:
        big = wire.encode(_big_notices(1, 1 << 17))  # 1 MiB of ids: more than the socket holds
        assert sender.try_send_frame(big)
        assert sender.waiting > 0  # the rest waits for the writer thread
        assert not sender.try_send_frame(wire.encode(_big_notices(2, 4)))
        after = threading.Thread(target=sender.send, args=(_big_notices(3, 4),))
        after.start()
        got = [reader.recv(SLACK) for _ in range(2)]
        after.join(SLACK)
        assert not after.is_alive()
        assert [f.notices[0].request_id for f in got] == [1, 3]
        assert np.array_equal(got[0].dst_ids, np.arange(1 << 17))
        assert sender.try_send_frame(wire.encode(_big_notices(4, 4)))  # room again: it goes
        assert reader.recv(SLACK).notices[0].request_id == 4
    finally:
        sender.close()
        reader.close()
