"""The staging endpoint with several senders: each connection has a ring of its own.

The receiver (a `StagingEndpoint` over a NaN-poisoned CPU pool) lives in the test process;
every sender is a spawned process driven by commands over a pipe, so the test forces the
order of their writes and posts (no sleeps). What is checked: two or three senders whose
writes are all staged before any is posted land every block bit exact, exactly once (one
shared ring gave them the same slots: the last write won); concurrent `KVSender`s through
one endpoint; a sender killed with a staged write leaves no segment in /dev/shm and the
endpoint serves the others on; ``max_senders`` refuses one more by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from helpers import TRANSFER_POOLS as POOLS
from helpers import reply_from, serve
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports.base import Write
from kvferry.transports.staging import StagingEndpoint, StagingTransport
from test_transfer import LAYERS, SHAPE, TPB

SLACK = 30.0
BLOCKS = 6  # blocks per request
CAPACITY = 8  # ring slots: one request's write fits, two do not


def _sender_process(conn: Any, address: str, authkey: bytes, seed: int, go: Any, device: str) -> None:
    """A sender at the transport level: ``write`` stages one request's blocks (copy
    finished, notice not posted), ``post`` posts it, ``drive`` runs requests through a
    `KVSender`. Replies are plain data."""
    from kvferry.engine import ThreadCopyEngine
    from kvferry.sender import KVSender

    src = POOLS.random(seed, device)
    engine: Any = ThreadCopyEngine()
    if device == "cuda":
        from kvferry.engine import CudaCopyEngine

        engine = CudaCopyEngine(torch.device("cuda"))
    transport = StagingTransport(address, authkey=authkey)
    conn.send(("ready", transport.ring_name))
    staged: list[Notice] = []
    while True:
        command, *args = conn.recv()
        if command == "write":
            rid, epoch, src_ids, dst_ids = args
            notice = Notice(rid, 0, 0, len(dst_ids), True, epoch)
            transport.announce([(rid, epoch)])
            done = transport.write(engine, Write(src, np.asarray(src_ids), np.asarray(dst_ids), [notice])).wait(SLACK)
            staged.append(notice)
            conn.send(("written", bool(done)))
        elif command == "post":
            transport.post([staged.pop(0)])
            conn.send(("posted", None))
        elif command == "drive":
            (requests,) = args  # (rid, epoch, prompt, src row, dst row) each
            sender = KVSender(src, transport, engine=engine, timeout=SLACK)
            for rid, epoch, prompt, _, _ in requests:
                sender.add(rid, prompt, epoch=epoch)
            conn.send(("added", None))
            go.wait(SLACK)  # every sender starts its sends together
            src_t = np.array([r[3] for r in requests])
            dst_t = np.array([r[4] for r in requests])
            ids = np.array([r[0] for r in requests])
            prompt = requests[0][2]
            for start in range(0, prompt, 2 * TPB):  # chunks of two blocks: many staged batches
                end = min(start + 2 * TPB, prompt)
                sender.send_chunks(ids, np.full(len(ids), start), np.full(len(ids), end), src_t, dst_t)
                sender.poll()
            sender.flush(timeout=SLACK)
            sender.close()
            engine.close()
            conn.send(("driven", None))
            return
        elif command == "close":
            transport.close()
            engine.close()
            conn.send(("closed", None))
            return


class Sender:
    """The test's handle on one sender process."""

    def __init__(self, ctx: Any, address: str, authkey: bytes, seed: int, go: Any = None, device: str = "cpu") -> None:
        self.seed = seed
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_process, args=(child, address, authkey, seed, go, device), daemon=True)
        self.proc.start()
        self.ring_name = self.expect("ready")

    def expect(self, what: str) -> Any:
        kind, value = reply_from(self._conn, self.proc, f"sender {self.seed} (waiting for {what!r})")
        assert kind == what, (kind, value)
        return value

    def call(self, reply: str, *message: Any) -> Any:
        self._conn.send(message)
        return self.expect(reply)

    def close(self) -> None:
        self.call("closed", "close")
        self.proc.join(timeout=SLACK)
        assert self.proc.exitcode == 0

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(timeout=SLACK)


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


@pytest.fixture
def staging(request: pytest.FixtureRequest) -> Iterator[tuple[KVReceiver, StagingEndpoint, bytes, Any]]:
    """A receiver over a NaN-poisoned pool on the test's ``device`` parameter (CPU when it
    has none), its staging endpoint, the key, the spawn context."""
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device", "cpu") if callspec is not None else "cpu"
    served = serve("staging", POOLS.nan(device), capacity_blocks=CAPACITY)
    try:
        yield served.receiver, served.endpoint, served.authkey, mp.get_context("spawn")  # type: ignore[misc]
    finally:
        served.close()


def _blocks(pool: PagedKV, ids: np.ndarray) -> list[torch.Tensor]:
    return [layer[torch.from_numpy(ids).to(layer.device)].cpu() for layer in pool.layers]


def _check_bit_exact(receiver: KVReceiver, rid: int, seed: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """Every block of the request holds its sender's bytes (NaN-poisoned blocks differ from
    any bytes a write could leave); its one notice arrived once."""
    for got, want in zip(_blocks(receiver.pool, dst_ids), _blocks(POOLS.random(seed), src_ids)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
            f"request {rid}: blocks differ from sender {seed}'s"
        )
    assert len(receiver.notices(rid)) == 1


@DEVICES
@pytest.mark.parametrize("senders", [2, 3])
def test_senders_staging_before_any_posts_land_every_block_bit_exact(staging: Any, senders: int, device: str) -> None:
    """Every sender stages a write (its device-to-host copy finished) before any of them
    posts, then they post in reverse order. Sharing one ring, each sender's first write
    took slots [0, 6), so every request but the last staged got the last one's bytes
    (fails on the single-ring endpoint); with a ring per connection each lands exact."""
    receiver, endpoint, authkey, ctx = staging
    procs = [Sender(ctx, endpoint.address, authkey, seed=10 + i, device=device) for i in range(senders)]
    try:
        rows = []
        for i, proc in enumerate(procs):
            rid = 100 + i
            dst_ids = np.arange(BLOCKS) + i * BLOCKS + 3  # distinct destination blocks
            src_ids = np.arange(BLOCKS) + 2 * i  # and differing sources
            epoch = receiver.expect(rid, BLOCKS * TPB, dst_blocks=dst_ids)
            assert proc.call("written", "write", rid, epoch, src_ids, dst_ids)
            rows.append((rid, proc, src_ids, dst_ids))
        for _, proc, _, _ in reversed(rows):
            proc.call("posted", "post")
        for rid, proc, src_ids, dst_ids in rows:
            receiver.wait(rid, timeout=SLACK)
            _check_bit_exact(receiver, rid, proc.seed, src_ids, dst_ids)
            assert receiver.release(rid).is_complete
        for proc in procs:
            proc.close()
    finally:
        for proc in procs:
            if proc.proc.is_alive():
                proc.proc.kill()


@DEVICES
@pytest.mark.parametrize("senders", [2, 3])
def test_concurrent_kvsenders_through_one_endpoint_bit_exact(staging: Any, senders: int, device: str) -> None:
    """Several `KVSender`s, started together, each streams two requests of 12 blocks in
    two-block chunks through its 8-slot ring (wrap-arounds and waits for frees) while the
    others do: every block arrives bit exact, every notice once."""
    receiver, endpoint, authkey, ctx = staging
    go = ctx.Event()
    procs = [Sender(ctx, endpoint.address, authkey, seed=20 + i, go=go, device=device) for i in range(senders)]
    dst_perm, expected = np.random.default_rng(5).permutation(SHAPE[0]), []  # distinct destinations, interleaved
    try:
        for i, proc in enumerate(procs):
            requests = []
            for k in range(2):
                rid, j = 200 + 10 * i + k, 2 * i + k
                dst, src = dst_perm[12 * j : 12 * j + 12], np.arange(12 * k, 12 * k + 12) + i
                requests.append((rid, receiver.expect(rid, 12 * TPB, dst_blocks=dst), 12 * TPB, src, dst))
                expected.append((rid, proc.seed, src, dst))
            proc.call("added", "drive", requests)
        go.set()
        for proc in procs:
            proc.expect("driven")
            proc.proc.join(timeout=SLACK)
            assert proc.proc.exitcode == 0
        for rid, seed, src, dst in expected:
            receiver.wait(rid, timeout=SLACK)
            for got, want in zip(_blocks(receiver.pool, dst), _blocks(POOLS.random(seed), src)):
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"request {rid}"
            notices = receiver.notices(rid)
            covered = np.zeros(12, dtype=np.int64)
            for n in notices:
                covered[n.start : n.end] += 1
            assert (covered == 1).all(), (rid, covered.tolist())  # every block exactly once
    finally:
        for proc in procs:
            if proc.proc.is_alive():
                proc.proc.kill()


def test_batches_posted_before_the_sender_closed_all_land() -> None:
    """A sender posts two staged batches and closes its transport before the endpoint
    handled the first (held at a gate): replying with the first batch's frees then finds
    the sender's end closed, and the second batch must still be applied (it was posted
    before the close), not lost with the connection."""
    import threading

    gate = threading.Event()

    class Gated(StagingEndpoint):
        def stage(self, *args: Any) -> None:
            assert gate.wait(SLACK), "the gate was never opened"
            super().stage(*args)

    receiver = KVReceiver(POOLS.nan())
    authkey = secrets.token_bytes(32)
    endpoint = Gated(receiver, authkey=authkey, capacity_blocks=CAPACITY)
    proc = Sender(mp.get_context("spawn"), endpoint.address, authkey, seed=40)
    try:
        rows = [(1, np.arange(3), np.arange(3) + 30), (2, np.arange(3) + 3, np.arange(3) + 40)]
        for rid, src_ids, dst_ids in rows:
            epoch = receiver.expect(rid, 3 * TPB, dst_blocks=dst_ids)
            assert proc.call("written", "write", rid, epoch, src_ids, dst_ids)
        for _ in rows:
            proc.call("posted", "post")
        proc.close()  # the sender's end is closed before the endpoint takes the first batch
        gate.set()
        for rid, src_ids, dst_ids in rows:
            receiver.wait(rid, timeout=SLACK)
            _check_bit_exact(receiver, rid, proc.seed, src_ids, dst_ids)
    finally:
        gate.set()
        if proc.proc.is_alive():
            proc.proc.kill()
        endpoint.close()
    assert not os.path.exists(f"/dev/shm/{proc.ring_name}")


def test_a_killed_sender_leaves_no_ring_and_the_others_are_served(staging: Any) -> None:
    """A sender killed with a write staged and not posted: its connection's end removes its
    ring (gone from /dev/shm since the sender mapped it), the other sender's staged write
    still lands exact, and a sender connecting afterwards gets a fresh ring and is served."""
    receiver, endpoint, authkey, ctx = staging
    doomed, survivor = Sender(ctx, endpoint.address, authkey, seed=30), Sender(ctx, endpoint.address, authkey, seed=31)
    late = None
    try:
        assert doomed.ring_name != survivor.ring_name
        assert sorted(endpoint.ring_names()) == sorted([doomed.ring_name, survivor.ring_name])
        assert not os.path.exists(f"/dev/shm/{doomed.ring_name}")  # nameless once its sender mapped it
        e1 = receiver.expect(1, BLOCKS * TPB, dst_blocks=np.arange(BLOCKS))
        e2 = receiver.expect(2, BLOCKS * TPB, dst_blocks=np.arange(BLOCKS) + 10)
        assert doomed.call("written", "write", 1, e1, np.arange(BLOCKS), np.arange(BLOCKS))
        assert survivor.call("written", "write", 2, e2, np.arange(BLOCKS), np.arange(BLOCKS) + 10)
        doomed.kill()
        with pytest.raises(TransferError, match="went away"):
            receiver.wait(1, timeout=SLACK)  # the ring is removed before the requests fail
        assert not os.path.exists(f"/dev/shm/{doomed.ring_name}")
        assert endpoint.ring_names() == [survivor.ring_name]
        receiver.release(1, timeout=SLACK)  # fenced by the connection's end: released at once
        for layer in receiver.pool.layers:
            assert torch.isnan(layer[:BLOCKS]).all()  # nothing of the dead sender's batch landed
        survivor.call("posted", "post")
        receiver.wait(2, timeout=SLACK)
        _check_bit_exact(receiver, 2, survivor.seed, np.arange(BLOCKS), np.arange(BLOCKS) + 10)

        late = Sender(ctx, endpoint.address, authkey, seed=32)
        assert late.ring_name not in (doomed.ring_name, survivor.ring_name)
        e3 = receiver.expect(3, BLOCKS * TPB, dst_blocks=np.arange(BLOCKS) + 20)
        assert late.call("written", "write", 3, e3, np.arange(BLOCKS) + 1, np.arange(BLOCKS) + 20)
        late.call("posted", "post")
        receiver.wait(3, timeout=SLACK)
        _check_bit_exact(receiver, 3, late.seed, np.arange(BLOCKS) + 1, np.arange(BLOCKS) + 20)
        survivor.close()
        late.close()
    finally:
        for proc in (doomed, survivor, late):
            if proc is not None and proc.proc.is_alive():
                proc.proc.kill()
    names = [doomed.ring_name, survivor.ring_name, late.ring_name]
    endpoint.close()  # joins the connection threads: every ring is gone
    assert endpoint.ring_names() == []
    assert [n for n in names if os.path.exists(f"/dev/shm/{n}")] == []


def test_max_senders_refuses_one_more_by_name_and_frees_its_place() -> None:
    """With ``max_senders=2`` a third sender is refused after its handshake, by a goodbye
    naming the bound and the ring's cost (recorded at the endpoint); it creates no ring.
    Once a connected sender's connection ended, a new one is served."""
    served = serve("staging", POOLS.nan(), capacity_blocks=CAPACITY, max_senders=2)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        assert endpoint.ring_bytes == CAPACITY * LAYERS * receiver.pool.block_bytes
        first, second = (
            StagingTransport(endpoint.address, authkey=authkey),
            StagingTransport(endpoint.address, authkey=authkey),
        )
        with pytest.raises(
            TransferError,
            match=(
                "refused the connection: refused: this staging endpoint serves at most 2 senders at once "
                f"\\(max_senders\\), each with its own ring of {CAPACITY} blocks \\({endpoint.ring_bytes} bytes\\)"
            ),
        ):
            StagingTransport(endpoint.address, authkey=authkey)
        assert any("at most 2 senders" in str(e) for e in endpoint.errors)
        assert sorted(endpoint.ring_names()) == sorted([first.ring_name, second.ring_name])
        e = receiver.expect(7, TPB)
        first.announce([(7, e)])
        first.close()
        with pytest.raises(TransferError, match="went away"):
            receiver.wait(7, timeout=SLACK)  # its connection ended: its ring is gone, its place free
        assert endpoint.ring_names() == [second.ring_name]
        third = StagingTransport(endpoint.address, authkey=authkey)
        assert sorted(endpoint.ring_names()) == sorted([second.ring_name, third.ring_name])
        second.close()
        third.close()
    finally:
        endpoint.close()
    assert endpoint.ring_names() == []


@pytest.mark.parametrize(
    ("option", "value"), [("capacity_blocks", 0), ("capacity_blocks", 2.5), ("max_senders", 0), ("max_senders", True)]
)
def test_bad_ring_options_are_refused_by_name(option: str, value: object) -> None:
    options: dict[str, Any] = {"capacity_blocks": 4, option: value}
    with pytest.raises(InvalidArgumentError, match=f"invalid {option}={value!r}: must be an int > 0"):
        StagingEndpoint(KVReceiver(POOLS.nan()), authkey=secrets.token_bytes(32), **options)


# Each side's legs (`KVFERRY_STAGING_LEGS`): through a scratch pool (and the copy engine on
# CUDA), or one copy between the pool and the ring (the fused kernel over PCIe on CUDA). Every
# other staging test runs each device's default: direct on CPU; auto on CUDA, which takes the
# direct leg for writes as small as these tests' (a test below checks its choice).
LEGS = pytest.mark.parametrize(
    ("device", "legs"),
    [
        ("cpu", "dma"),
        ("cpu", "direct"),
        pytest.param("cuda", "dma", marks=pytest.mark.cuda),
        pytest.param("cuda", "direct", marks=pytest.mark.cuda),
    ],
)


def test_legs_default_by_device_and_a_bad_setting_is_refused_by_name_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvferry.transports import staging as staging_mod

    monkeypatch.delenv(staging_mod.LEGS_ENV, raising=False)
    assert staging_mod.staging_legs(torch.device("cpu")) == "direct"
    assert staging_mod.staging_legs(torch.device("cuda", 0)) == "auto"
    small, large = staging_mod.DIRECT_WRITE_BYTES, staging_mod.DIRECT_WRITE_BYTES + 1
    assert [staging_mod.write_legs("auto", n) for n in (small, large)] == ["direct", "dma"]
    assert [staging_mod.write_legs(legs, large) for legs in ("dma", "direct")] == ["dma", "direct"]
    monkeypatch.setenv(staging_mod.LEGS_ENV, "dma")
    assert staging_mod.staging_legs(torch.device("cpu")) == "dma"
    monkeypatch.setenv(staging_mod.LEGS_ENV, "fast")
    with pytest.raises(InvalidArgumentError, match="KVFERRY_STAGING_LEGS='fast': must be one of dma, direct, auto"):
        StagingEndpoint(KVReceiver(POOLS.nan()), authkey=secrets.token_bytes(32), capacity_blocks=CAPACITY)
    with pytest.raises(InvalidArgumentError, match="KVFERRY_STAGING_LEGS='fast'"):
        StagingTransport("ipc:///nowhere", authkey=secrets.token_bytes(32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_auto_legs_take_the_direct_leg_for_a_small_write_and_dma_for_a_large_one_on_both_sides(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """With "auto" legs (CUDA's default) each side picks a write's legs by its bytes: a write
    of 2 blocks, under the bound of 3 blocks' bytes, is one copy between each pool and the
    ring (no scratch pool on either side); one of 7 goes through the scratch pools (a planned
    gather at the sender, a planned scatter at the receiver) and no direct copy. Both land bit
    exact."""
    from kvferry.engine import CudaCopyEngine, ThreadCopyEngine
    from kvferry.transports import staging as staging_mod

    monkeypatch.setenv(staging_mod.LEGS_ENV, "auto")
    src, dst = POOLS.random(5, device), POOLS.nan(device)
    monkeypatch.setattr(staging_mod, "DIRECT_WRITE_BYTES", 3 * src.block_bytes * LAYERS)
    direct: list[str] = []
    planned: list[int] = []
    copy_blocks, block_copies = staging_mod.copy_blocks, staging_mod.BlockCopies

    def counted_copy(a: PagedKV, b: PagedKV, *args: Any) -> None:
        direct.append("sender" if a is src else "receiver")
        copy_blocks(a, b, *args)

    def counted_copies(copies: Any) -> Any:
        planned.append(len(copies))
        return block_copies(copies)

    monkeypatch.setattr(staging_mod, "copy_blocks", counted_copy)
    monkeypatch.setattr(staging_mod, "BlockCopies", counted_copies)
    engine: Any = CudaCopyEngine(torch.device("cuda")) if device == "cuda" else ThreadCopyEngine()
    served = serve("staging", dst, capacity_blocks=16)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        tx = StagingTransport(endpoint.address, authkey=authkey)
        rng = np.random.default_rng(5)
        src_ids, dst_ids = rng.permutation(src.num_blocks)[:9], rng.permutation(dst.num_blocks)[:9]
        for rid, (lo, hi) in ((1, (0, 2)), (2, (2, 9))):
            epoch = receiver.expect(rid, (hi - lo) * TPB, dst_blocks=dst_ids[lo:hi])
            tx.announce([(rid, epoch)])
            notices = [Notice(rid, 0, 0, hi - lo, True, epoch)]
            direct.clear()
            planned.clear()
            assert tx.write(engine, Write(src, src_ids[lo:hi], dst_ids[lo:hi], notices)).wait(SLACK)
            tx.post(notices)
            receiver.wait(rid, timeout=SLACK)
            if hi - lo == 2:
                assert (sorted(direct), planned) == (["receiver", "sender"], [])
            else:
                assert (direct, len(planned)) == ([], 2)
            for s_layer, d_layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32)):
                got = d_layer[:, torch.from_numpy(dst_ids[lo:hi]).to(device)]
                assert torch.equal(got, s_layer[:, torch.from_numpy(src_ids[lo:hi]).to(device)])
            receiver.release(rid)
        tx.close()
    finally:
        endpoint.close()
        engine.close()


@pytest.mark.parametrize("block_dim", [0, 1])
@LEGS
def test_a_batch_of_several_pieces_lands_bit_exact_and_a_revoked_requests_blocks_stay_out(
    monkeypatch: pytest.MonkeyPatch, device: str, legs: str, block_dim: int
) -> None:
    """A batch larger than the scratch pool crosses in pieces on both sides (pieces of two
    blocks here, an odd count of blocks, scattered source and destination ids, one and two
    segments per block): every kept block lands bit exact, and the blocks of the request
    revoked before the post (the picked path: its slots are skipped) keep their poison.
    With direct legs there are no pieces: one kernel each way, the same checks."""
    from kvferry.engine import CudaCopyEngine, ThreadCopyEngine
    from kvferry.transports import staging as staging_mod

    monkeypatch.setenv(staging_mod.LEGS_ENV, legs)

    pools = POOLS.but(shape=(40, 2, TPB, 8) if block_dim == 0 else (2, 40, TPB, 8), block_dim=block_dim)
    src, dst = pools.random(3, device), pools.nan(device)
    monkeypatch.setattr(staging_mod, "STAGE_CHUNK_BYTES", 2 * src.block_bytes * LAYERS + 1)
    engine: Any = CudaCopyEngine(torch.device("cuda")) if device == "cuda" else ThreadCopyEngine()
    served = serve("staging", dst, capacity_blocks=16)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        tx = StagingTransport(endpoint.address, authkey=authkey)
        # Writes of half the ring at most; with dma legs, where a write's own cost is one of
        # these blocks, these 7 blocks go in 4 equal writes (sqrt(7) = 2); direct legs: one.
        monkeypatch.setattr(staging_mod, "WRITE_OVERHEAD_BYTES", src.block_bytes * src.num_layers)
        assert tx.max_write_blocks == 8
        assert tx.write_blocks(7, src.device) == (2 if legs == "dma" else 8)
        src_ids = np.array([31, 2, 17, 5, 38, 11, 0])
        dst_ids = np.array([9, 33, 1, 20, 14, 7, 26])
        kept, dropped = (dst_ids[:3], dst_ids[3:])  # request 2's three blocks, then request 1's four
        e2 = receiver.expect(2, 3 * TPB, dst_blocks=kept)
        notices = [Notice(2, 0, 0, 3, True, e2), Notice(1, 0, 0, 4, True, 1)]
        tx.announce([(2, e2), (1, 1)])
        assert tx.write(engine, Write(src, src_ids, dst_ids, notices)).wait(SLACK)
        tx.post(notices, revoked=frozenset({1}))
        receiver.wait(2, timeout=SLACK)
        for s_layer, d_layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32)):
            assert torch.equal(
                d_layer[:, torch.from_numpy(kept).to(device)], s_layer[:, torch.from_numpy(src_ids[:3]).to(device)]
            )
        for layer in dst.layers:
            assert torch.isnan(layer.index_select(block_dim, torch.from_numpy(dropped).to(device))).all()
        tx.close()
    finally:
        endpoint.close()
        engine.close()


@LEGS
def test_a_plan_goes_in_the_writes_its_legs_ask_for_and_lands_bit_exact(
    monkeypatch: pytest.MonkeyPatch, device: str, legs: str
) -> None:
    """A `KVSender` plan of 12 blocks through a 16-slot ring, a write's own cost set to one
    block: with dma legs it goes in 6 equal writes of 2 (sqrt(12) = 3, rounded down to a whole
    fraction of the ring), with direct legs in writes of half the ring (8 and 4); either way
    every block lands bit exact, once, and the rest of the pool keeps its poison."""
    from kvferry.engine import CudaCopyEngine, ThreadCopyEngine
    from kvferry.sender import KVSender
    from kvferry.transports import staging as staging_mod

    monkeypatch.setenv(staging_mod.LEGS_ENV, legs)
    pools = POOLS.but(shape=(40, 2, TPB, 8))
    src, dst = pools.random(7, device), pools.nan(device)
    monkeypatch.setattr(staging_mod, "WRITE_OVERHEAD_BYTES", src.block_bytes * src.num_layers)
    engine: Any = CudaCopyEngine(torch.device("cuda")) if device == "cuda" else ThreadCopyEngine()
    served = serve("staging", dst, capacity_blocks=16)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        tx = StagingTransport(endpoint.address, authkey=authkey)
        src_ids = np.random.default_rng(7).permutation(40)[:12]
        dst_ids = np.random.default_rng(8).permutation(40)[:12]
        epoch = receiver.expect(5, 12 * TPB, dst_blocks=dst_ids)
        sender = KVSender(src, tx, engine=engine, timeout=SLACK, record=True)
        sender.add(5, 12 * TPB, epoch=epoch)
        sender.send_chunks([5], [0], [12 * TPB], src_ids[None, :], dst_ids[None, :])
        sender.flush(timeout=SLACK)
        receiver.wait(5, timeout=SLACK)
        assert sender.records is not None
        writes = sorted((sum(n.end - n.start for n in r.notices) for r in sender.records), reverse=True)
        assert writes == ([2] * 6 if legs == "dma" else [8, 4])
        assert sum(n.end - n.start for n in receiver.notices(5)) == 12
        for s_layer, d_layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32)):
            got = d_layer[:, torch.from_numpy(dst_ids).to(device)]
            assert torch.equal(got, s_layer[:, torch.from_numpy(src_ids).to(device)])
        rest = np.setdiff1d(np.arange(40), dst_ids)
        for layer in dst.layers:
            assert torch.isnan(layer.index_select(0, torch.from_numpy(rest).to(device))).all()
        sender.close()
        tx.close()
    finally:
        endpoint.close()
        engine.close()


@pytest.mark.parametrize(
    "capacity, limit, overhead", [(256, 128, 16), (16, 8, 16), (4160, 128, 16), (10, 5, 1), (64, 32, 4)]
)
def test_dma_legs_split_every_plan_in_equal_writes_that_fit_the_ring_whole(
    capacity: int, limit: int, overhead: int
) -> None:
    """Every plan size up to eight writes' worth: writes of at most ``limit``, equal within a
    block; where a quarter of the ring is worth its own cost, at most that (four fit in the
    ring at once), and a plan larger than that cost goes in more than one write, so its two
    legs overlap; where it is not (a small ring), writes of ``limit`` as before."""
    from kvferry.transports.staging import RING_DEPTH, split_write_blocks

    for total in range(1, 8 * limit + 3):
        cap = split_write_blocks(total, limit, overhead, capacity)
        writes = -(-total // cap)
        assert 1 <= cap <= limit, (total, cap)
        assert cap * writes - total < writes, (total, cap)  # equal writes, within a block
        if capacity // RING_DEPTH >= overhead:
            assert capacity // cap >= RING_DEPTH, (total, cap)  # the ring holds four writes at once
            if total > overhead:  # sqrt(total x overhead) < total: more than one write
                assert writes > 1, (total, cap)
        else:  # a quarter of the ring would cost more than it overlaps: as without splitting
            assert writes == -(-total // limit), (total, cap)
    # Through a 1 GiB ring of 4 MiB blocks with a 64 MiB overhead: a 512 MiB plan in 4
    # writes of 128 MiB; 4 GiB in 16 of 256 MiB (4 in the ring at once).
    assert split_write_blocks(128, 128, 16, 256) == 32
    assert split_write_blocks(1024, 128, 16, 256) == 64


@pytest.mark.cuda
def test_a_receiver_on_a_second_gpu_takes_every_block_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's pool on cuda:0, the receiver's on cuda:1 (each leg across its own GPU's
    link, as `kvferry bench copy --receiver-device cuda:1` runs them), dma legs, a batch of
    several pieces: every block lands bit exact on cuda:1, the rest stays poison."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from kvferry.engine import CudaCopyEngine
    from kvferry.transports import staging as staging_mod

    monkeypatch.setenv(staging_mod.LEGS_ENV, "dma")
    pools = POOLS.but(shape=(40, 2, TPB, 8))
    src, dst = pools.random(5, "cuda:0"), pools.nan("cuda:1")
    monkeypatch.setattr(staging_mod, "STAGE_CHUNK_BYTES", 2 * src.block_bytes * LAYERS + 1)
    engine = CudaCopyEngine(torch.device("cuda:0"))
    served = serve("staging", dst, capacity_blocks=16)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    try:
        tx = StagingTransport(endpoint.address, authkey=authkey)
        src_ids, dst_ids = np.array([31, 2, 17, 5, 38, 11, 0]), np.array([9, 33, 1, 20, 14, 7, 26])
        epoch = receiver.expect(4, 7 * TPB, dst_blocks=dst_ids)
        notices = [Notice(4, 0, 0, 7, True, epoch)]
        tx.announce([(4, epoch)])
        assert tx.write(engine, Write(src, src_ids, dst_ids, notices)).wait(SLACK)
        tx.post(notices)
        receiver.wait(4, timeout=SLACK)
        for s_layer, d_layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32)):
            got = d_layer[:, torch.from_numpy(dst_ids).to("cuda:1")].cpu()
            assert torch.equal(got, s_layer[:, torch.from_numpy(src_ids).to("cuda:0")].cpu())
        rest = np.setdiff1d(np.arange(40), dst_ids)
        for layer in dst.layers:
            assert torch.isnan(layer.index_select(0, torch.from_numpy(rest).to("cuda:1"))).all()
        tx.close()
    finally:
        endpoint.close()
        engine.close()


@LEGS
def test_writes_posted_back_to_back_land_in_order_and_a_fence_acts_after_them(
    monkeypatch: pytest.MonkeyPatch, device: str, legs: str
) -> None:
    """Five writes of two-block pieces (both scratch pools of each side in turn) staged and
    posted one after another without waiting for the receiver, then a fence (revoke) of the
    last request: the receiver queues each write's copies behind the previous one's (on
    CUDA) and delivers them in order, and the fence acts only after the writes read before
    it: request 5, complete before its fence was read, stays complete (a fence acting first
    would have discarded its notice as stale). Every request lands bit exact, once; nothing
    stays leased."""
    from helpers import assert_nothing_leased
    from kvferry.engine import CudaCopyEngine, ThreadCopyEngine
    from kvferry.transports import staging as staging_mod

    monkeypatch.setenv(staging_mod.LEGS_ENV, legs)
    src, dst = POOLS.random(11, device), POOLS.nan(device)
    monkeypatch.setattr(staging_mod, "STAGE_CHUNK_BYTES", 2 * src.block_bytes * LAYERS)
    engine: Any = CudaCopyEngine(torch.device("cuda")) if device == "cuda" else ThreadCopyEngine()
    served = serve("staging", dst, capacity_blocks=30)
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    rng = np.random.default_rng(3)
    src_ids, dst_ids = rng.permutation(src.num_blocks)[:25], rng.permutation(dst.num_blocks)[:25]
    try:
        tx = StagingTransport(endpoint.address, authkey=authkey)
        rids = [1, 2, 3, 4, 5]
        epochs = [receiver.expect(rid, 5 * TPB, dst_blocks=dst_ids[5 * i : 5 * i + 5]) for i, rid in enumerate(rids)]
        tx.announce(list(zip(rids, epochs)))
        for i, (rid, epoch) in enumerate(zip(rids, epochs)):
            notices = [Notice(rid, 0, 0, 5, True, epoch)]
            write = Write(src, src_ids[5 * i : 5 * i + 5], dst_ids[5 * i : 5 * i + 5], notices)
            assert tx.write(engine, write).wait(SLACK)
            tx.post(notices)
        tx.revoke(5, epochs[4])
        for i, rid in enumerate(rids):
            receiver.wait(rid, timeout=SLACK)
            assert len(receiver.notices(rid)) == 1
            for s_layer, d_layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32)):
                got = d_layer[:, torch.from_numpy(dst_ids[5 * i : 5 * i + 5]).to(device)]
                assert torch.equal(got, s_layer[:, torch.from_numpy(src_ids[5 * i : 5 * i + 5]).to(device)])
        for rid in rids:
            receiver.release(rid)
        tx.close()
        assert_nothing_leased(receiver)
    finally:
        endpoint.close()
        engine.close()
