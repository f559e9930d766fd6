"""Faults with real processes: a receiver or a sender killed mid-transfer, a hung NIXL peer,
and cancellation at every stage of a request. Each test checks what was released on both
sides (book entries, in-flight writes, destination and source blocks) and that no thread or
process is left behind. Timeouts are generous and only bound how long a failure may take;
nothing here asserts how fast anything is.

The generation worker (`generation_worker`) and the context worker (`context_worker`) run
in spawned processes and take commands over a pipe; test_peer_auth.py uses them too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import pytest
from helpers import (
    POOLS,
    SLACK,
    Blocks,
    assert_nothing_leased,
    digest,
    kvferry_threads,
    reply_from,
    serve,
    tables,
    until,
)
from kvferry.copy import copy_blocks
from kvferry.engine import Pending, ThreadCopyEngine
from kvferry.errors import TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.sender import KVSender

TPB, LAYERS, NUM_BLOCKS, SHAPE = POOLS.tpb, POOLS.layers, POOLS.num_blocks, POOLS.shape
# SLACK (helpers) bounds how long a failure may take on a loaded 2-core machine. A test that
# proves "at once rather than at the timeout" compares against a much longer timeout.
REPLY_SECONDS = 60.0
LONG_TIMEOUT = 30.0


# --- the generation worker (receiver) -------------------------------------------------------


def generation_worker(conn: Any, authkey: bytes, kind: str) -> None:
    """A receiver process: a pool with its own free list, a receiver and an endpoint; serves
    commands until ``close``. Every reply is plain data."""
    pools = POOLS.but(shape=(NUM_BLOCKS, 2, TPB, 16 << 10)) if kind == "nixl-big" else POOLS  # 1 MiB blocks
    # A staging sender's ring is created when it connects: the test adds their names
    # (`StagingTransport.ring_name`) to `Generation.segments`.
    served = serve("nixl" if kind.startswith("nixl") else kind, authkey=authkey, pools=pools)
    receiver, endpoint = served.receiver, served.endpoint
    blocks = Blocks(NUM_BLOCKS)
    owned: dict[int, list[int]] = {}
    conn.send(("ready", endpoint.address, served.segment, os.getpid()))
    while True:
        command, *args = conn.recv()
        if command == "expect":
            rid, prompt_len = args
            owned[rid] = blocks.take(-(-prompt_len // TPB))
            receiver.expect(rid, prompt_len)
            conn.send(owned[rid])
        elif command == "wait":
            rid, timeout = args
            start = time.monotonic()
            try:
                receiver.wait(rid, timeout=timeout)
                conn.send(("ok", time.monotonic() - start, digest(receiver.pool, owned[rid])))
            except TransferError as err:
                conn.send((type(err).__name__, time.monotonic() - start, str(err), err.request_ids, err.peer))
        elif command == "release":
            (rid,) = args
            arrived = [n.as_tuple() for n in receiver.notices(rid)]
            receiver.release(rid)
            blocks.give(owned.pop(rid))
            conn.send(arrived)
        elif command == "status":
            conn.send(
                {
                    "requests": len(receiver),
                    "free": blocks.free,
                    "errors": [f"{type(e).__name__}: {e}" for e in endpoint.errors],
                    "refused": [(r.notice.as_tuple(), type(r.error).__name__) for r in receiver.refused()],
                    "threads": kvferry_threads(),
                }
            )
        elif command == "close":
            served.close()
            conn.send(kvferry_threads())
            return


class Generation:
    """The test's handle on a spawned generation worker."""

    def __init__(self, kind: str = "shm") -> None:
        ctx = mp.get_context("spawn")
        self.authkey = secrets.token_bytes(32)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=generation_worker, args=(child, self.authkey, kind), daemon=True)
        self.proc.start()
        _, self.address, segment, self.pid = self.recv()
        self.segments: list[str] = [] if segment is None else [segment]  # a kill leaves these behind

    def recv(self) -> Any:
        return reply_from(self._conn, self.proc, "generation worker")

    def call(self, *message: Any) -> Any:
        self._conn.send(message)
        return self.recv()

    def close(self) -> list[str]:
        """Stops the worker cleanly; returns the kvferry threads it still had after closing
        its endpoint."""
        left = self.call("close")
        self.proc.join(timeout=REPLY_SECONDS)
        assert self.proc.exitcode == 0
        return left

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.join(timeout=REPLY_SECONDS)
            self.unlink_orphans()

    def unlink_orphans(self) -> None:
        """A killed worker leaves its segments behind: remove them as their owner would have."""
        from kvferry.transports.shm import _attach_untracked

        for name in self.segments:
            try:
                segment = _attach_untracked(name)
            except FileNotFoundError:
                continue
            segment.close()
            segment.unlink()

    def cleanup(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=REPLY_SECONDS)
            self.unlink_orphans()


# --- the context worker (sender) ------------------------------------------------------------


def context_worker(conn: Any, address: str, authkey: bytes, kind: str) -> None:
    """A sender process with a random pool; runs the commands it is sent, replying after
    each; ``hold`` leaves the next write running (blocked) so the test can kill it mid-copy."""
    src = POOLS.random(7)
    engine = GatedEngine()
    if kind == "shm":
        from kvferry.transports.shm import ShmTransport

        transport: Any = ShmTransport(address, authkey=authkey)
    else:
        from kvferry.transports.nixl import NixlTransport

        transport = NixlTransport(address, authkey=authkey, src=src)
    sender = KVSender(src, transport, engine=engine)
    conn.send(("ready", os.getpid()))
    while True:
        command, *args = conn.recv()
        if command == "announce":
            transport.announce(args[0])
            conn.send("ok")
        elif command == "add":
            sender.add(*args[:2], reused_len=args[2])
            # The announce leaves from the sender's announcer thread: on the wire before the
            # reply, so a kill after it is a kill after the announce.
            sender.flush(timeout=REPLY_SECONDS)
            conn.send("ok")
        elif command == "digest":
            conn.send(digest(src, args[0]))
        elif command == "early":
            sender.send_early(*args)
            conn.send([n.as_tuple() for n in sender.flush(timeout=REPLY_SECONDS)])
        elif command == "chunk":
            sender.send_chunks(*args)
            conn.send([n.as_tuple() for n in sender.flush(timeout=REPLY_SECONDS)])
        elif command == "hold-chunk":  # the copy starts and stays blocked: killed mid-write
            engine.hold()
            sender.send_chunks(*args)
            conn.send(engine.wait_running(lambda n: n > 0, timeout=REPLY_SECONDS))


class GatedEngine(ThreadCopyEngine):
    """Real copies on the engine's real thread; after ``hold()`` each new copy waits for
    ``release()`` before it runs, so a test decides when a write is mid-flight."""

    def __init__(self) -> None:
        super().__init__()
        self._open = threading.Event()
        self._open.set()
        self.running = 0
        self.started = threading.Event()  # set once a copy started (and, held, waits)
        self._changed = threading.Condition()

    def hold(self) -> None:
        self._open.clear()

    def _count(self, step: int) -> None:
        with self._changed:
            self.running += step
            self._changed.notify_all()

    def wait_running(self, predicate: Callable[[int], bool], timeout: float = SLACK) -> bool:
        """Waits until ``predicate(running copies)`` holds (woken by each start and end)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self.running), timeout)

    def release(self) -> None:
        self._open.set()

    def submit(
        self,
        src: PagedKV,
        dst: PagedKV,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        *,
        after: Any = (),
        before: Optional[Callable[[], None]] = None,
    ) -> Pending:
        def copy() -> None:
            if before is not None:
                before()
            copy_blocks(src, dst, src_ids, dst_ids)

        return self.submit_call(copy, after=after)

    def submit_call(self, work: Callable[[], None], *, after: Any = (), nbytes: int = 0) -> Pending:
        gate = self._open

        def gated() -> None:
            self._count(+1)
            self.started.set()
            try:
                assert gate.wait(timeout=REPLY_SECONDS), "a held copy was never released"
                work()
            finally:
                self._count(-1)

        return super().submit_call(gated, after=after, nbytes=nbytes)


class Context:
    """The test's handle on a spawned context worker connected to ``address``."""

    def __init__(self, address: str, authkey: bytes, kind: str = "shm") -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=context_worker, args=(child, address, authkey, kind), daemon=True)
        self.proc.start()
        _, self.pid = self.recv()

    def recv(self) -> Any:
        return reply_from(self._conn, self.proc, "context worker")

    def call(self, *message: Any) -> Any:
        self._conn.send(message)
        return self.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=REPLY_SECONDS)
        assert self.proc.exitcode == -signal.SIGKILL

    def cleanup(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=REPLY_SECONDS)


def expect_failed_soon(call: Callable[[], Any], bound: float) -> tuple[TransferError, float]:
    """Calls ``call`` until it raises `TransferError` (at most ``bound`` seconds). The failure
    is one the sender finds by its own clock (a write past its timeout, the receiver's socket
    looked at every PEER_CHECK_SECONDS), so there is no event to wait on: ``bound`` only stops
    a test whose failure never comes."""
    start = time.monotonic()
    while True:
        try:
            call()
        except TransferError as err:
            return err, time.monotonic() - start
        assert time.monotonic() - start < bound, f"no failure within {bound} s"
        time.sleep(0.01)


# --- receiver killed --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "progress"),
    [("shm", False), ("shm", True), ("staging", False)],
    ids=["shm", "shm-progress-thread", "staging"],
)
def test_receiver_killed_mid_transfer_fails_and_releases_the_sender(kind: str, progress: bool) -> None:
    """SIGKILL the generation worker while a chunk's copy into its pool (or staging ring)
    is running: the sender fails every request within its timeout, names them and the
    receiver, releases its book entries and writes, refuses further sends, and closes
    without hanging."""
    from kvferry.transports.shm import ShmTransport
    from kvferry.transports.staging import StagingTransport

    before = set(threading.enumerate())
    gen = Generation(kind)
    try:
        src, src_blocks = POOLS.random(1), Blocks(NUM_BLOCKS)
        engine = GatedEngine()
        timeout = 5.0
        transport = (ShmTransport if kind == "shm" else StagingTransport)(gen.address, authkey=gen.authkey)
        if isinstance(transport, StagingTransport):
            gen.segments.append(transport.ring_name)
        sender = KVSender(src, transport, engine=engine, timeout=timeout, progress=progress)
        rows = {rid: (src_blocks.take(6), gen.call("expect", rid, 24)) for rid in (1, 2)}
        for rid in rows:
            sender.add(rid, 24, reused_len=9)
        src_t, dst_t = tables(*(rows[r][0] for r in rows)), tables(*(rows[r][1] for r in rows))
        sender.send_early([1, 2], src_t, dst_t)
        sender.flush(timeout=REPLY_SECONDS)
        engine.hold()
        sender.send_chunks([1, 2], [9, 9], [14, 14], src_t, dst_t)
        assert engine.wait_running(lambda n: n > 0)  # the chunk's copy is under way...
        gen.kill()  # ...when the receiver dies
        engine.release()

        err, _ = expect_failed_soon(sender.poll, timeout + SLACK)
        assert set(err.request_ids) == {1, 2}, err
        assert gen.address in str(err.peer) and f"pid {gen.pid}" in str(err.peer)
        assert "requests [1, 2] failed" in str(err)
        # Everything of the two requests is released: book, writes, revocations.
        assert len(sender.book) == 0
        assert not sender.in_flight(1) and not sender.in_flight(2)
        assert set(sender.failures()) == {1, 2}
        with pytest.raises(TransferError, match="requests \\[1, 2\\] failed"):
            sender.send_chunks([1], [14], [19], src_t[:1], dst_t[:1])
        for rid in rows:  # the executor acknowledges and frees the source blocks
            assert sender.cancel(rid).claimed_blocks == 3  # early [0, 2) and the chunk's block
            src_blocks.give(rows[rid][0])
        assert src_blocks.free == NUM_BLOCKS
        assert_nothing_leased(sender=sender)
        sender.close()
    finally:
        gen.cleanup()
    assert_nothing_leased(threads=before)
    assert mp.active_children() == []


def test_receiver_killed_between_writes_is_found_by_the_next_poll() -> None:
    """Nothing in flight when the receiver dies: the sender's next poll finds the socket
    closed and fails the requests it still holds; send_* refuses from then on."""
    from kvferry.transports.shm import ShmTransport

    gen = Generation("shm")
    try:
        sender = KVSender(POOLS.random(1), ShmTransport(gen.address, authkey=gen.authkey), timeout=5.0)
        dst = gen.call("expect", 5, 16)
        sender.add(5, 16, reused_len=8)
        sender.send_early([5], tables([0, 1, 2, 3]), tables(dst))
        sender.flush(timeout=REPLY_SECONDS)
        gen.kill()
        err, _ = expect_failed_soon(sender.poll, SLACK)
        assert err.request_ids == (5,) and "went away" in str(err)
        assert sender.poll() == []  # raised once; nothing left to post
        with pytest.raises(TransferError, match="went away"):
            sender.send_chunks([5], [8], [16], tables([0, 1, 2, 3]), tables(dst))
        assert sender.remove(5).claimed_blocks == 2
        assert_nothing_leased(sender=sender)
        sender.close()
    finally:
        gen.cleanup()


@pytest.fixture
def loopback_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # inherited by spawned workers


def test_nixl_receiver_killed_fails_the_sender(loopback_ucx: None) -> None:
    from kvferry.transports.nixl import NixlTransport

    before = set(threading.enumerate())
    gen = Generation("nixl")
    try:
        src = POOLS.random(1)
        sender = KVSender(src, NixlTransport(gen.address, authkey=gen.authkey, src=src), timeout=5.0)
        dst = gen.call("expect", 3, 16)
        sender.add(3, 16, reused_len=8)
        sender.send_early([3], tables([0, 1, 2, 3]), tables(dst))
        sender.flush(timeout=REPLY_SECONDS)
        gen.kill()

        def send_and_poll() -> None:  # the write may fail in NIXL or the socket may say first
            if 3 not in sender.failures():
                sender.send_chunks([3], [8], [16], tables([0, 1, 2, 3]), tables(dst))
            sender.poll()

        err, _ = expect_failed_soon(send_and_poll, 5.0 + SLACK)
        assert err.request_ids == (3,) and f"pid {gen.pid}" in str(err.peer)
        assert len(sender.book) == 0 and not sender.in_flight(3)
        assert sender.remove(3).claimed_blocks >= 2
        assert_nothing_leased(sender=sender)
        sender.close()
    finally:
        gen.cleanup()
    assert_nothing_leased(threads=before)


def test_nixl_hung_receiver_is_aborted_at_the_sender_timeout(
    loopback_ucx: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that stops answering (SIGSTOP: its socket stays open, so nothing but the
    clock can tell) over UCX's TCP transport, where a write needs the peer to progress: the
    sender aborts the write at its timeout, fails the requests it carried, releases them."""
    from kvferry.transports.nixl import NixlTransport

    monkeypatch.setenv("UCX_TLS", "tcp")
    gen = Generation("nixl-big")
    stopped = False
    try:
        src = POOLS.but(shape=(NUM_BLOCKS, 2, TPB, 16 << 10)).full(1.0)
        timeout = 1.0
        sender = KVSender(src, NixlTransport(gen.address, authkey=gen.authkey, src=src), timeout=timeout)
        warm = gen.call("expect", 5, 2 * TPB)  # one write while the peer runs: UCX connects
        sender.add(5, 2 * TPB)
        sender.send_chunks([5], [0], [2 * TPB], tables([0, 1]), tables(warm))
        sender.flush(timeout=REPLY_SECONDS)
        assert sender.remove(5).is_complete
        dst = gen.call("expect", 4, 62 * TPB)
        sender.add(4, 62 * TPB)
        gen.kill(signal.SIGSTOP)
        stopped = True
        sender.send_chunks([4], [0], [62 * TPB], tables(list(range(62))), tables(dst))  # 62 MiB
        err, _ = expect_failed_soon(sender.poll, timeout + SLACK)
        assert isinstance(err, TransferTimeoutError) and "aborted" in str(err), err
        assert err.request_ids == (4,) and f"pid {gen.pid}" in str(err.peer)
        assert len(sender.book) == 0 and not sender.in_flight(4)
        assert sender.cancel(4).claimed_blocks == 62
        gen.kill()
        stopped = False
        sender.close()
    finally:
        if stopped:
            os.kill(gen.pid, signal.SIGCONT)
        gen.cleanup()


# --- sender killed --------------------------------------------------------------------------


def test_sender_killed_mid_transfer_fails_its_requests_at_once() -> None:
    """SIGKILL the context worker while a chunk's write is under way: the endpoint sees the
    connection end and fails, at once rather than at their timeout, the requests that
    sender announced or sent notices for; a request it finished stays complete; a request it
    never mentioned is left to its own timeout. The destination blocks are then released."""
    before = set(threading.enumerate())
    served = serve("shm")
    receiver, endpoint, authkey = served.receiver, served.endpoint, served.authkey
    dst_blocks = Blocks(NUM_BLOCKS)
    ctx = Context(endpoint.address, authkey)
    try:
        dst = {rid: dst_blocks.take(6) for rid in (1, 2, 3, 4)}
        epochs = {rid: receiver.expect(rid, 24) for rid in dst}
        src = {1: [0, 1, 2, 3, 4, 5], 4: [10, 11, 12, 13, 14, 15]}
        assert ctx.call("add", 1, 24, 9) == "ok" and ctx.call("add", 4, 24, 0) == "ok"
        assert ctx.call("announce", [(2, epochs[2])]) == "ok"  # will send 2, has sent nothing for it yet
        ctx.call("early", [1], tables(src[1]), tables(dst[1]))  # request 1 is under way
        ctx.call("chunk", [4], [0], [24], tables(src[4]), tables(dst[4]))  # request 4 is done
        assert receiver.wait(4, timeout=LONG_TIMEOUT)
        assert ctx.call("hold-chunk", [1], [9], [14], tables(src[1]), tables(dst[1]))
        ctx.kill()

        for rid in (1, 2):
            start = time.monotonic()
            with pytest.raises(TransferError, match=f"request {rid} failed: .*went away") as info:
                receiver.wait(rid, timeout=LONG_TIMEOUT)
            assert time.monotonic() - start < LONG_TIMEOUT / 2  # the EOF, not the timeout
            assert info.value.request_ids == (rid,) and f"pid {ctx.pid}" in str(info.value.peer)
        assert receiver.wait(4, timeout=1)  # finished before the kill: still complete
        with pytest.raises(TransferTimeoutError):  # never mentioned: only its timeout ends it
            receiver.wait(3, timeout=0.2)
        assert [n.as_tuple() for n in receiver.notices(1)] == [(1, 0, 0, 2, False, 0, 0, 1)]
        for rid in (1, 2, 4):  # the dead sender's requests are fenced by its end: released at once
            receiver.release(rid, timeout=0)
            dst_blocks.give(dst[rid])
        # 3 was never mentioned: no sender can be known to have stopped writing it.
        with pytest.raises(TransferTimeoutError, match="no sender has announced it"):
            receiver.release(3, timeout=0.05)
        receiver.release_unfenced(3)  # the test never handed its blocks to anyone
        dst_blocks.give(dst[3])
        assert dst_blocks.free == NUM_BLOCKS
        # The dead sender's connection thread is gone without the endpoint closing.
        assert_nothing_leased(receiver, endpoint=endpoint)
        assert list(endpoint.errors) == []
    finally:
        ctx.cleanup()
        served.close()
    assert_nothing_leased(threads=before)
    assert mp.active_children() == []


def test_nixl_sender_killed_fails_by_the_receiver_timeout(loopback_ucx: None) -> None:
    """NIXL's notices do not travel on the socket, so its EOF does not fail requests (it may
    overtake the notifications of finished writes): the receiver's wait times out cleanly,
    the request is released, and nothing is left running."""
    before = set(threading.enumerate())
    served = serve("nixl")
    receiver = served.receiver
    ctx = Context(served.endpoint.address, served.authkey, kind="nixl")
    try:
        receiver.expect(1, 24)
        receiver.expect(2, 8)
        assert ctx.call("add", 1, 24, 9) == "ok" and ctx.call("add", 2, 8, 0) == "ok"
        ctx.call("early", [1], tables([0, 1, 2, 3, 4, 5]), tables([6, 7, 8, 9, 10, 11]))
        ctx.call("chunk", [2], [0], [8], tables([20, 21]), tables([20, 21]))
        assert receiver.wait(2, timeout=LONG_TIMEOUT)
        assert until(lambda: len(receiver.notices(1)) == 1)
        ctx.kill()
        timeout = 1.0
        start = time.monotonic()
        with pytest.raises(
            TransferTimeoutError, match=r"request 1: blocks \[BlockRange\(2, 6\)\] did not arrive"
        ) as info:
            receiver.wait(1, timeout=timeout)
        assert time.monotonic() - start < timeout + SLACK
        assert info.value.request_ids == (1,)
        assert receiver.wait(2, timeout=1)  # complete before the kill: stays complete
        receiver.release(1)
        receiver.release(2)
        assert_nothing_leased(receiver, endpoint=served.endpoint)
    finally:
        ctx.cleanup()
        served.close()
    assert_nothing_leased(threads=before)


# --- cancellation at every stage -------------------------------------------------------------

PROMPT, REUSED = 24, 9  # 6 blocks; early [0, 2); chunks of 5 tokens: [2, 3), [3, 4), last [4, 6)
CHUNKS = [(9, 14), (14, 19), (19, 24)]
STAGES = ["before-early", "after-early", "mid-chunk", "at-last-chunk", "during-final-copy"]
CLAIMED = {"before-early": 0, "after-early": 2, "mid-chunk": 3, "at-last-chunk": 4, "during-final-copy": 6}


def test_cancel_at_every_stage_leaks_nothing() -> None:
    """For each stage, request C is cancelled while request S, batched with it, carries on:
    C's notices after the cancel never arrive (not even those of a write carrying both),
    S arrives bit-exact (its destination blocks were C's in an earlier stage, so a stray
    write of C would show), and both pools get every block back. At the end no kvferry
    thread and no child process is left in either process."""
    from kvferry.transports.shm import ShmTransport

    before = set(threading.enumerate())
    gen = Generation("shm")
    try:
        src, src_blocks = POOLS.random(11), Blocks(NUM_BLOCKS)
        engine = GatedEngine()
        # No announcer: the notices C got before its cancel are exactly those the test's own
        # flushes returned (an announcer would post some of them on its own thread).
        sender = KVSender(
            src, ShmTransport(gen.address, authkey=gen.authkey), engine=engine, timeout=LONG_TIMEOUT, progress=False
        )
        for n, stage in enumerate(STAGES):
            c, s = 100 + 2 * n, 101 + 2 * n
            rows = {rid: (src_blocks.take(6), gen.call("expect", rid, PROMPT)) for rid in (c, s)}
            for rid in (c, s):
                sender.add(rid, PROMPT, reused_len=REUSED)
            src_t, dst_t = tables(rows[c][0], rows[s][0]), tables(rows[c][1], rows[s][1])
            posted: list[Notice] = []  # C's notices that left before the cancel

            def chunk(i: int, ids: tuple[int, ...] = (c, s)) -> None:
                pick = [(c, s).index(r) for r in ids]  # the table rows of those requests
                start, end = CHUNKS[i]
                sender.send_chunks(list(ids), [start] * len(ids), [end] * len(ids), src_t[pick], dst_t[pick])

            def cancel_while_copying() -> None:
                assert engine.wait_running(lambda n: n > 0)
                with pytest.raises(TransferTimeoutError, match=f"request {c}: copies reading its blocks"):
                    sender.cancel(c, timeout=0.05)  # the copy reads C's blocks: not yet
                with pytest.raises(ValueError, match=f"\\[{c}\\] were cancelled"):
                    chunk(1 if stage == "mid-chunk" else 2, (c,))
                engine.release()

            if stage != "before-early":
                sender.send_early([c, s], src_t, dst_t)
                posted += sender.flush(timeout=REPLY_SECONDS)
            if stage in ("at-last-chunk", "during-final-copy"):
                for i in (0, 1):
                    chunk(i)
                    posted += sender.flush(timeout=REPLY_SECONDS)
            if stage in ("mid-chunk", "during-final-copy"):
                engine.hold()
                chunk(0 if stage == "mid-chunk" else 2)
                cancel_while_copying()
            ledger = sender.cancel(c, timeout=REPLY_SECONDS)
            assert ledger.claimed_blocks == CLAIMED[stage], stage  # what had been sent or was being sent
            src_blocks.give(rows[c][0])  # the cancel returned: C's source blocks are free
            with pytest.raises(UnknownRequestError):
                chunk(2, (c,))
            # S carries on to the end.
            done = {"before-early": 0, "after-early": 0, "mid-chunk": 1, "at-last-chunk": 2, "during-final-copy": 3}[
                stage
            ]
            if stage == "before-early":
                sender.send_early([s], src_t[[1]], dst_t[[1]])
            for i in range(done, 3):
                chunk(i, (s,))
            posted += sender.flush(timeout=REPLY_SECONDS)
            status, _, remote = gen.call("wait", s, LONG_TIMEOUT)
            assert status == "ok", (stage, remote)
            assert remote == digest(src, rows[s][0]), stage
            # S's last notice came after every notice of C on the socket, so C's are all in.
            arrived = gen.call("release", c)
            assert arrived == [n.as_tuple() for n in posted if n.request_id == c], stage
            assert gen.call("release", s)
            assert sender.remove(s).is_complete
            src_blocks.give(rows[s][0])
            assert_nothing_leased(sender=sender)  # a stale record would drop a later request's notices
            state = gen.call("status")
            assert (state["requests"], state["free"], state["errors"]) == (0, NUM_BLOCKS, []), (stage, state)
            assert src_blocks.free == NUM_BLOCKS, stage
        sender.close()
        assert gen.close() == []  # no kvferry thread left in the generation worker
    finally:
        gen.cleanup()
    assert_nothing_leased(threads=before)
    assert mp.active_children() == []
