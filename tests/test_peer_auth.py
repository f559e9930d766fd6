"""Peer authentication: only peers holding the session's key get anything from an endpoint
(and a sender trusts only a receiver holding it); shared-memory segments and socket
directories are unguessable and private; the receiver checks every notice against the
request's own ledger and the sender it belongs to, so an authenticated but wrong (or
hostile) sender can fail only the requests it holds, and never make blocks count as arrived."""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
import tempfile
import threading
from typing import Iterator

import numpy as np
import pytest
import torch
from helpers import POOLS, SLACK, digest, shm_endpoint, tables, until
from kvferry.errors import (
    DuplicateTransferError,
    InvalidArgumentError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import wire
from kvferry.transports.frames import Freed, Goodbye, Notices, Revoke
from kvferry.transports.shm import SharedPool, ShmEndpoint, ShmTransport
from kvferry.transports.wire import AuthenticationError
from test_faults import TPB, Generation

# "kvferry-" and 32 hex digits: 128 random bits (secrets.token_hex(16)).
SEGMENT_NAME = re.compile(r"kvferry-[0-9a-f]{32}")


def _path(address: str) -> str:
    assert address.startswith("unix://"), address
    return address[len("unix://") :]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_wrong_key_is_refused_and_the_endpoint_keeps_serving() -> None:
    """Against a generation worker in its own process: a client that connects and stalls
    in the handshake, a client with a wrong key, and a raw client that shows nothing but the
    endpoint's challenge and an end of connection ever reaches a peer without the key (no
    proof from the endpoint, no hello, so no segment name or IPC handle); meanwhile the
    right key is served end to end."""
    gen = Generation("shm")
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stalled.connect(_path(gen.address))  # never answers the challenge, stays connected
        with pytest.raises(
            TransferError, match="cannot reach the receiver.*refused our proof: it does not hold our key"
        ):
            ShmTransport(gen.address, authkey=secrets.token_bytes(32))

        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(_path(gen.address))
        raw.settimeout(SLACK)
        challenge = _recv_exact(raw, wire.HEADER.size + 1 + wire.NONCE_BYTES)
        magic, version, kind, length = wire.HEADER.unpack(challenge[: wire.HEADER.size])
        assert (magic, version, kind, length) == (wire.MAGIC, wire.VERSION, wire.CHALLENGE, 1 + wire.NONCE_BYTES)
        assert challenge[wire.HEADER.size] == wire.ROLE_ENDPOINT and gen.segments[0].encode() not in challenge
        mine = secrets.token_bytes(wire.NONCE_BYTES)
        raw.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.CHALLENGE, 33) + bytes([wire.ROLE_SENDER]) + mine)
        raw.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.PROOF, 32) + b"\0" * 32)  # a wrong proof
        refusal = wire.encode(Goodbye(wire.REFUSED_PROOF))
        assert _recv_exact(raw, len(refusal)) == refusal  # its refusal of the proof, said,
        assert _recv_exact(raw, 1) == b""  # then closed without another byte: no proof, no hello
        raw.close()

        src = POOLS.random(3)
        sender = KVSender(src, ShmTransport(gen.address, authkey=gen.authkey))
        dst = gen.call("expect", 1, 24)
        sender.add(1, 24, reused_len=9)
        sender.send_early([1], tables(list(range(6))), tables(dst))
        sender.send_chunks([1], [9], [24], tables(list(range(6))), tables(dst))
        sender.flush(timeout=SLACK)
        status, _, remote = gen.call("wait", 1, SLACK)
        assert status == "ok" and remote == digest(src, range(6))
        gen.call("release", 1)
        sender.remove(1)
        sender.close()

        # Both wrong keys were recorded (the stalled peer too, should its bound have passed).
        refused = [
            e for e in gen.call("status")["errors"] if e.startswith("AuthenticationError") and "proof is wrong" in e
        ]
        assert len(refused) == 2 and all("refused" in e for e in refused), refused
        assert gen.close() == []  # the stalled peer's thread ended with the endpoint
    finally:
        stalled.close()
        gen.cleanup()


def test_a_stalled_handshake_is_dropped_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvferry.transports.control

    monkeypatch.setattr(kvferry.transports.control, "HANDSHAKE_SECONDS", 0.2)
    with shm_endpoint() as (receiver, endpoint, _):
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.connect(_path(endpoint.address))
        assert until(lambda: len(endpoint.errors) == 1)
        assert isinstance(
            endpoint.errors[0], AuthenticationError
        ) and "refused: no complete handshake within 0.2 s" in str(endpoint.errors[0])
        assert until(lambda: "kvferry-notices" not in {t.name for t in threading.enumerate()})
        assert _recv_exact(stalled, 4096)[: len(wire.MAGIC)] == wire.MAGIC  # its challenge, then EOF
        assert len(receiver) == 0 and receiver.refused_count == 0
        stalled.close()


def test_the_sender_refuses_a_receiver_without_the_key() -> None:
    """Mutual: a listener that cannot prove it holds the key gets no connection (the sender
    raises before reading a hello), and nothing it sent is decoded past the handshake."""
    with tempfile.TemporaryDirectory() as tmp:
        address = os.path.join(tmp, "fake.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        outcome: list[BaseException] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                wire.handshake(conn, secrets.token_bytes(32), wire.ROLE_ENDPOINT, SLACK, f"unix://{address}")
            except wire.AuthenticationError as err:
                outcome.append(err)  # the sender's proof does not match this key
            finally:
                conn.close()

        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(TransferError, match="cannot reach the receiver"):
            ShmTransport(f"unix://{address}", authkey=secrets.token_bytes(32))
        thread.join(timeout=SLACK)
        listener.close()
        assert len(outcome) == 1 and "proof is wrong" in str(outcome[0])


def test_a_short_key_is_refused() -> None:
    with shm_endpoint() as (_, endpoint, _):
        with pytest.raises(InvalidArgumentError, match="invalid authkey: 31 bytes, need at least 32"):
            ShmTransport(endpoint.address, authkey=b"k" * 31)
    shared = SharedPool.create(num_layers=1, shape=(4, 8), dtype=torch.float32, tokens_per_block=TPB)
    try:
        assert shared.pool is not None
        with pytest.raises(InvalidArgumentError, match="invalid authkey: 16 bytes"):
            ShmEndpoint(KVReceiver(shared.pool), shared, authkey=b"k" * 16)
    finally:
        shared.close()


def test_segment_names_are_unguessable_and_segments_private() -> None:
    """The segment's name carries 128 random bits; the name alone is no protection (any
    local user can list /dev/shm), so the segment must also be the owner's alone (0600), as
    must the directory of the notice socket (0700); a staging ring has no name at all once its
    sender mapped it."""
    from kvferry.transports.staging import StagingEndpoint

    pools = [SharedPool.create(num_layers=1, shape=(4, 8), dtype=torch.float32, tokens_per_block=TPB) for _ in range(8)]
    receiver = KVReceiver(POOLS.random(0))
    from kvferry.transports.staging import StagingTransport

    authkey = secrets.token_bytes(32)
    staging = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=4)
    senders = [StagingTransport(staging.address, authkey=authkey) for _ in range(2)]  # a ring each
    try:
        names = [p.descriptor["name"] for p in pools] + [s.ring_name for s in senders]
        assert sorted(staging.ring_names()) == sorted(s.ring_name for s in senders)
        assert all(SEGMENT_NAME.fullmatch(n) for n in names), names
        assert len(set(names)) == len(names)
        assert len({n[8:16] for n in names}) == len(names)  # no shared prefix: not a counter
        for name in names[: len(pools)]:
            mode = os.stat(f"/dev/shm/{name}").st_mode
            assert stat.S_IMODE(mode) == 0o600, (name, oct(mode))
        # A ring's name is gone once its sender mapped it: nobody else can open it by name.
        assert [n for n in names[len(pools) :] if os.path.exists(f"/dev/shm/{n}")] == []
        directory = os.path.dirname(_path(staging.address))
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert re.fullmatch(r"kvferry-\w{8,}", os.path.basename(directory))
    finally:
        for s in senders:
            s.close()
        staging.close()
        for p in pools:
            p.close()


# --- the receiver's checks, over a real socket ------------------------------------------------


@pytest.fixture
def rig() -> Iterator[tuple[KVReceiver, ShmEndpoint, bytes]]:
    with shm_endpoint() as parts:
        yield parts


def test_notices_outside_the_request_are_refused_and_mark_nothing(rig: tuple[KVReceiver, ShmEndpoint, bytes]) -> None:
    """An authenticated sender announces an unknown request, blocks past the request's end,
    no blocks, a negative or an unrepresentable range, and blocks that already arrived:
    each notice is refused whole and recorded, nothing of it counts as arrived, the request
    it names fails at once (its wait raises, no timeout needed) and can be released; good
    notices on the same connection still count."""
    receiver, endpoint, authkey = rig
    for rid in (1, 2, 3, 4, 5, 6, 7):
        receiver.expect(rid, 24)  # 6 blocks each
    rogue = ShmTransport(endpoint.address, authkey=authkey)
    bad = [
        (Notice(99, 0, 0, 1, False), UnknownRequestError, None),
        (Notice(1, 0, 4, 8, True), InvalidArgumentError, 1),  # past block 6
        (Notice(3, 0, 2, 2, False), InvalidArgumentError, 3),  # no blocks
        (Notice(4, 0, -1, 1, False), InvalidArgumentError, 4),
    ]
    # A value no frame can carry never leaves the sender (nothing of it reaches request 5).
    with pytest.raises(
        InvalidArgumentError, match=r"invalid end=1180591620717411303424: must be in \[-2\*\*63, 2\*\*63\)"
    ):
        rogue.post([Notice(5, 0, 0, 2**70, True)])
    rogue.post([Notice(2, 0, 0, 2, False)])  # accepted...
    rogue.post([Notice(2, 1, 1, 3, False)])  # ...then blocks 1-2: block 1 arrived already
    for notice, _, _ in bad:
        rogue.post([notice])
    rogue.post([Notice(6, 0, 0, 6, True)])  # a good notice after all that
    assert until(lambda: receiver.refused_count == len(bad) + 1)
    assert receiver.wait(6, timeout=SLACK)

    refused = receiver.refused()
    assert [r.notice for r in refused] == [Notice(2, 1, 1, 3, False)] + [n for n, _, _ in bad]
    assert [type(r.error) for r in refused] == [DuplicateTransferError] + [e for _, e, _ in bad]
    assert all(r.source is not None and r.source.startswith("sender #") for r in refused)
    assert len(endpoint.errors) == len(refused)  # the endpoint records them too

    arrived = {}
    for rid, kind in [(1, "invalid range"), (2, "already claimed"), (3, "no blocks"), (4, "invalid start")]:
        with pytest.raises(TransferError, match=f"request {rid} failed: .*{kind}") as info:
            receiver.wait(rid, timeout=SLACK)  # fails now, not at a timeout
        assert info.value.request_ids == (rid,)
        arrived[rid] = receiver.notices(rid)
    for rid in (5, 7):  # never named: untouched
        with pytest.raises(TransferTimeoutError):
            receiver.wait(rid, timeout=0.05)
    # The rogue is still connected and could still write: a failed request's blocks are not
    # handed back until it is fenced (here by the rogue's connection ending).
    with pytest.raises(TransferTimeoutError, match="request 1 .*no fence"):
        receiver.release(1, timeout=0.05)
    rogue.close()
    for rid in (1, 2, 3, 4):
        ledger = receiver.release(rid, timeout=SLACK)
        if rid == 2:  # only the first, good notice counts
            assert arrived[rid] == [Notice(2, 0, 0, 2, False)] and ledger.claimed_blocks == 2
        else:
            assert arrived[rid] == [] and ledger.claimed_blocks == 0
    receiver.release(6)  # complete: fenced
    # No sender ever named 5 or 7, so nothing fences them; the test never handed their blocks out.
    for rid in (5, 7):
        with pytest.raises(TransferTimeoutError, match="no sender has announced it"):
            receiver.release(rid, timeout=0.05)
        receiver.release_unfenced(rid)
    assert len(receiver) == 0


def test_a_request_belongs_to_the_sender_that_announced_it(rig: tuple[KVReceiver, ShmEndpoint, bytes]) -> None:
    """Two senders with the key: a notice for a request the other one announced (or sent
    first) is refused and recorded with its sender, and changes nothing of the request: its
    own sender still completes it (issue 20 item 4; it used to fail the request)."""
    receiver, endpoint, authkey = rig
    epochs = {rid: receiver.expect(rid, 8) for rid in (5, 6, 7)}  # 2 blocks each
    a = ShmTransport(endpoint.address, authkey=authkey)
    b = ShmTransport(endpoint.address, authkey=authkey)
    a.announce([(5, epochs[5])])
    a.post([Notice(7, 0, 0, 2, True)])
    assert receiver.wait(7, timeout=SLACK)  # a's connection is past its announce
    b.post([Notice(6, 0, 0, 1, False)])  # 6 is b's from its first notice
    b.post([Notice(5, 0, 0, 2, True)])  # 5 is a's
    assert until(lambda: receiver.refused_count == 1)
    a.post([Notice(6, 1, 1, 2, True)])  # 6 is b's
    assert until(lambda: receiver.refused_count == 2)

    first, second = receiver.refused()
    assert first.notice == Notice(5, 0, 0, 2, True) and "belongs to sender #" in str(first.error)
    assert second.notice == Notice(6, 1, 1, 2, True) and first.source != second.source
    a.post([Notice(5, 0, 0, 2, True)])
    b.post([Notice(6, 1, 1, 2, True)])
    for rid in (5, 6):
        receiver.wait(rid, timeout=SLACK)
        assert receiver.notices(rid)[-1].end == 2
    a.close()
    b.close()
    for rid in (5, 6, 7):
        assert receiver.release(rid, timeout=SLACK).claimed_blocks == 2


def test_only_the_connection_holding_a_request_may_announce_revoke_or_fail_it(
    rig: tuple[KVReceiver, ShmEndpoint, bytes],
) -> None:
    """A second authenticated connection's ``announce(rid, 0)`` (epoch 0 passes every
    staleness check), its fence and its notices for requests the first connection holds, a
    completed one and a pending one, are refused and recorded; neither request is failed or
    fenced, and the pending one completes from its own connection (issue 20 item 4: each of
    these used to fail the request, the completed one included)."""
    receiver, endpoint, authkey = rig
    epochs = {rid: receiver.expect(rid, 8) for rid in (1, 2)}  # 2 blocks each
    owner = ShmTransport(endpoint.address, authkey=authkey)
    other = ShmTransport(endpoint.address, authkey=authkey)
    owner.announce([(1, epochs[1]), (2, epochs[2])])
    owner.post([Notice(1, 0, 0, 2, True, epochs[1])])
    receiver.wait(1, timeout=SLACK)  # complete, and the owner's announce of 2 was taken first
    other.announce([(1, 0), (2, 0)])
    other.revoke(1, epochs[1])
    other.revoke(2, epochs[2])
    other.post([Notice(1, 0, 0, 2, True, 0), Notice(2, 0, 0, 1, False, epochs[2])])
    assert until(lambda: receiver.refused_count == 2)  # its last frame: the others were taken before
    assert all("belongs to sender #" in str(r.error) for r in receiver.refused())
    # Two announces, two fences, two notices: each recorded by the endpoint too.
    assert sum("belongs to sender #" in str(err) for err in endpoint.errors) == 6
    receiver.wait(1, timeout=SLACK)  # still complete, not failed
    assert not receiver.fenced(2) and receiver.notices(2) == []
    other.close()  # its end owns nothing: fences and fails nothing
    owner.post([Notice(2, 0, 0, 2, True, epochs[2])])
    receiver.wait(2, timeout=SLACK)
    owner.close()
    for rid in (1, 2):
        assert receiver.release(rid, timeout=SLACK).claimed_blocks == 2


def test_a_malformed_frame_drops_only_that_sender(rig: tuple[KVReceiver, ShmEndpoint, bytes]) -> None:
    """A frame that breaks the protocol (a body that does not decode, a frame of a kind a
    sender never sends, a version this side does not speak) ends that sender's connection
    with a goodbye saying why, and fails the requests it owned; other senders are served on."""
    receiver, endpoint, authkey = rig
    for rid in (1, 2, 3, 4):
        receiver.expect(rid, 8)
    good = ShmTransport(endpoint.address, authkey=authkey)
    frames = [
        (1, wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.NOTICES, 3) + b"\1\2\3", "truncated frame"),
        (2, wire.encode(Freed(3)), "a freed frame, which a sender does not send"),
        (
            3,
            wire.HEADER.pack(wire.MAGIC, wire.VERSION + 1, wire.NOTICES, 0),
            f"unsupported wire version {wire.VERSION + 1} .this side speaks {wire.VERSION}.",
        ),
    ]
    for rid, raw, why in frames:
        rogue = ShmTransport(endpoint.address, authkey=authkey)
        rogue.announce([(rid, 0)])
        rogue._conn._channel.sock.sendall(raw)  # noqa: SLF001  (a hostile peer writes what it likes)
        with pytest.raises(TransferError, match=f"request {rid} failed: .*went away.*{why}"):
            receiver.wait(rid, timeout=SLACK)
        assert until(lambda: _closed(rogue))  # the endpoint hung up on it, saying why
        with pytest.raises(TransferError, match=f"it closed the connection: disconnected: .*{why}"):
            rogue.check_peer()
        rogue.close()
        assert isinstance(endpoint.errors[-1], wire.ProtocolError) and re.search(why, str(endpoint.errors[-1]))
    good.post([Notice(4, 0, 0, 2, True)])
    assert receiver.wait(4, timeout=SLACK)
    good.close()


def _closed(transport: ShmTransport) -> bool:
    try:
        transport.check_peer()
    except TransferError:
        return True
    return False


def test_malformed_nixl_notifications_are_refused_not_crashing_the_poller() -> None:
    from kvferry.transports.nixl import _decode_notification, _encode, _encode_revoke

    frame = _decode_notification(_encode([Notice(1, 0, 0, 2, True)], np.array([4, 9])))
    assert isinstance(frame, Notices) and frame.notices == [Notice(1, 0, 0, 2, True)]
    assert frame.dst_ids is not None and frame.dst_ids.tolist() == [4, 9]
    assert _decode_notification(_encode_revoke(3, 2)) == Revoke(3, 2)
    truncated = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.NOTICES, 3) + b"\1\2\3"
    for message in (b"junk", truncated, bytes(41), wire.encode(Freed(1))):
        with pytest.raises(TransferError):
            _decode_notification(message)
