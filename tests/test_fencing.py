"""Fenced ownership: leases on source blocks, epochs on destination blocks, and the fence that
ends a transfer (docs/faults.md, "Leases, epochs and fences").

Each known failure is reproduced and shown not to happen:

* a reused block evicted from the prefix cache between the early send and its copy
  (`test_a_reused_block_cannot_be_evicted_while_its_early_copy_is_queued`, with a control in
  which an engine that drops its references early does get wrong bytes delivered);
* a source freed on timeout while the copy still reads it
  (`test_a_timed_out_copy_keeps_its_source_leased_and_its_destination_unfenced`);
* an aborted request's destination blocks reused while a late write is in flight
  (`test_release_waits_for_the_fence_of_a_write_still_in_flight` over shared memory, with a
  control in which skipping the fence lets the late write overwrite the new owner's bytes;
  `test_staging_never_applies_ring_data_the_receiver_would_not_take`,
  `test_nixl_fences_travel_with_the_notifications`), request ids reused included.

Copies are gated, so every interleaving is forced, not hoped for: `ManualEngine` (tests/helpers.py)
runs a copy when the test opens it; `GatedEngine` (test_faults) runs real copies on the engine
thread and holds them at will. Receivers that need a peer live in a spawned process
(`fencing_worker`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FakeClock
from helpers import (
    POOLS,
    SLACK,
    Blocks,
    ManualEngine,
    assert_nothing_leased,
    digest,
    in_process_pair,
    kvferry_threads,
    reply_from,
    serve,
    shm_endpoint,
    tables,
    until,
)
from kvferry.engine import Pending
from kvferry.errors import InvalidArgumentError, TransferError, TransferTimeoutError, UnknownRequestError
from kvferry.hook import TransferHook
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, ReceiverStage
from kvferry.refengine.model import TinyLlama, new_kv_pool
from kvferry.refengine.soak import SOAK_MODEL
from kvferry.refengine.worker import Worker
from kvferry.sender import KVSender, SenderStage
from kvferry.transports.base import Write
from kvferry.transports.inprocess import InProcessTransport
from test_faults import NUM_BLOCKS, REPLY_SECONDS, TPB, GatedEngine, expect_failed_soon

# --- a receiver in its own process -----------------------------------------------------------


def fencing_worker(conn: Any, authkey: bytes, kind: str) -> None:
    """A generation worker: a pool with its own free list, a receiver and an endpoint (shm,
    staging or NIXL); runs the test's commands until ``close``. Every reply is plain data."""
    served = serve(kind, authkey=authkey)  # a staging ring of 12 blocks
    receiver, endpoint = served.receiver, served.endpoint
    pool = receiver.pool
    blocks = Blocks(NUM_BLOCKS)
    owned: dict[int, list[int]] = {}
    conn.send((endpoint.address, os.getpid()))
    while True:
        command, *args = conn.recv()
        try:
            if command == "expect":  # -> (destination blocks, epoch)
                rid, prompt_len = args
                owned[rid] = blocks.take(-(-prompt_len // TPB))
                conn.send((owned[rid], receiver.expect(rid, prompt_len)))
            elif command == "release":  # -> ("ok", seconds) or ("TransferTimeoutError", seconds, message)
                rid, timeout = args
                start = time.monotonic()
                try:
                    receiver.release(rid, timeout=timeout)
                except TransferTimeoutError as err:
                    conn.send(("TransferTimeoutError", time.monotonic() - start, str(err)))
                    continue
                blocks.give(owned.pop(rid))  # only now: the blocks are fenced
                conn.send(("ok", time.monotonic() - start))
            elif command == "wait":  # -> ("ok", digest) or (error class, message)
                rid, timeout = args
                try:
                    receiver.wait(rid, timeout=timeout)
                    conn.send(("ok", digest(pool, owned[rid])))
                except TransferError as err:
                    conn.send((type(err).__name__, str(err)))
            elif command == "cancel":
                conn.send(receiver.cancel(args[0]))
            elif command == "release_unfenced":  # the test vouches nothing writes the blocks
                receiver.release_unfenced(args[0])
                blocks.give(owned.pop(args[0]))
                conn.send("ok")
            elif command == "fill":  # the blocks' new owner writes them
                ids, value = args
                for layer in pool.layers:
                    layer[torch.tensor(ids)] = value
                conn.send(digest(pool, ids))
            elif command == "digest":
                conn.send(digest(pool, args[0]))
            elif command == "request":  # -> (fenced, complete, notices as tuples)
                rid = args[0]
                conn.send(
                    (receiver.fenced(rid), receiver.is_complete(rid), [n.as_tuple() for n in receiver.notices(rid)])
                )
            elif command == "status":
                conn.send(
                    {
                        "requests": len(receiver),
                        "free": blocks.free,
                        "discarded": [(d.kind, d.request_id, d.epoch, d.reason) for d in receiver.discarded()],
                        "refused": [(r.notice.as_tuple(), type(r.error).__name__) for r in receiver.refused()],
                        "errors": [f"{type(e).__name__}: {e}" for e in endpoint.errors],
                    }
                )
            elif command == "close":
                served.close()
                conn.send(kvferry_threads())
                return
        except Exception as err:  # reported to the test, which fails with it
            conn.send(("error", repr(err)))


class Remote:
    """The test's handle on a spawned `fencing_worker`."""

    def __init__(self, kind: str) -> None:
        ctx = mp.get_context("spawn")
        self.authkey = secrets.token_bytes(32)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=fencing_worker, args=(child, self.authkey, kind), daemon=True)
        self.proc.start()
        self.address, self.pid = self._recv()

    def _recv(self) -> Any:
        return reply_from(self._conn, self.proc, "receiver process")

    def call(self, *message: Any) -> Any:
        self._conn.send(message)
        reply = self._recv()
        assert not (isinstance(reply, tuple) and reply and reply[0] == "error"), reply
        return reply

    def close(self) -> list[str]:
        left = self.call("close")
        self.proc.join(timeout=REPLY_SECONDS)
        assert self.proc.exitcode == 0
        return left

    def cleanup(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=REPLY_SECONDS)

    def close_after(self, sender: KVSender) -> None:
        """The end of a clean run: the receiver holds no request and has every block back,
        refused nothing and recorded no error; the sender leaks nothing; both close, and no
        kvferry thread is left in the worker."""
        state = self.call("status")
        assert (state["requests"], state["free"], state["refused"], state["errors"]) == (0, NUM_BLOCKS, [], []), state
        assert_nothing_leased(sender=sender)
        sender.close()
        assert self.close() == []


@pytest.fixture
def loopback_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # inherited by spawned workers


# --- (a) source blocks: a reused block and the prefix cache -----------------------------------

P1 = list(range(1, 14))  # 13 tokens: 3 full blocks and one partial, all cached after turn 1
P2 = P1 + [20, 21, 22]  # the next turn: reuses the 3 full blocks and 1 token of the partial one
FRESH = [40 + i % 20 for i in range(40)]  # 10 blocks of a prompt that shares nothing


def _context_rig() -> tuple[Worker, TransferHook, KVReceiver, ManualEngine]:
    model = TinyLlama(SOAK_MODEL)
    ctx = Worker(model, num_blocks=12, tokens_per_block=TPB)
    receiver = KVReceiver(new_kv_pool(model.cfg, 12, TPB, "cpu"))
    engine = ManualEngine()
    hook = TransferHook(KVSender(ctx.pool, InProcessTransport(receiver), engine=engine))
    ctx.leased = hook.leased  # as Disaggregated does: blocks stay referenced while leased
    ctx.admit(1, P1)
    ctx.forward(1, len(P1))
    ctx.finish(1, cache_tokens=len(P1))  # all four blocks cached, none referenced
    return ctx, hook, receiver, engine


def _early(ctx: Worker, hook: TransferHook, receiver: KVReceiver) -> tuple[list[int], list[int], str]:
    """Admits turn 2 and queues its early slice (the copy waits on its gate); returns the
    reused source blocks, the destination blocks and the digest the copy must deliver."""
    state = ctx.admit(2, P2)
    reused = state.blocks[:3]
    assert state.shared == 3 and state.reused_len == 13
    epoch = receiver.expect(2, len(P2))
    dst = [8, 9, 10, 11]
    hook.add_request(2, len(P2), reused_len=state.reused_len, src_blocks=state.blocks, dst_blocks=dst, epoch=epoch)
    assert [(n.start, n.end, n.epoch) for n in hook.before_forward([2])] == [(0, 3, epoch)]
    return reused, dst, digest(ctx.pool, reused)


def test_a_reused_block_cannot_be_evicted_while_its_early_copy_is_queued() -> None:
    """Turn 2 reuses three cached blocks and sends them early; before the copy runs, another
    request needs ten blocks. The reused blocks are referenced by turn 2, so the allocator
    cannot evict them: the pool is exhausted instead. A request that fits takes only other
    blocks, its forward writes them, and the copy then delivers the reused blocks' bytes."""
    ctx, hook, receiver, engine = _context_rig()
    reused, dst, want = _early(ctx, hook, receiver)
    assert hook.leased(2) and all(ctx.alloc.refs[b] == 1 for b in reused)
    with pytest.raises(MemoryError, match="KV pool exhausted: 10 blocks wanted, 8 available"):
        ctx.admit(3, FRESH)  # would have to evict the reused blocks
    state = ctx.admit(3, FRESH[:32])  # eight blocks: the free ones and the idle partial block
    assert not set(state.blocks) & set(reused)
    ctx.forward(3, 32)  # writes its blocks while the early copy is still queued
    engine.gates[0].opened = True
    hook.poll()
    assert digest(receiver.pool, dst[:3]) == want
    assert [(n.start, n.end) for n in receiver.notices(2)] == [(0, 3)]


def test_an_engine_that_drops_its_reference_early_gets_wrong_bytes_delivered() -> None:
    """The control: the same scenario, but the engine gives the reused blocks back while the
    copy is queued (what an abort that ignores the lease would do). The next admission
    evicts them from the prefix cache, its forward overwrites them, and the queued copy
    delivers the new request's KV as turn 2's prefix."""
    ctx, hook, receiver, engine = _context_rig()
    reused, dst, want = _early(ctx, hook, receiver)
    ctx.alloc.release(reused, [True] * 3)  # the bug: references dropped under a queued copy
    state = ctx.admit(3, FRESH)
    assert set(state.blocks) & set(reused)  # evicted and handed out again
    ctx.forward(3, len(FRESH))
    engine.gates[0].opened = True
    hook.poll()
    assert digest(receiver.pool, dst[:3]) != want


def test_an_aborted_request_keeps_its_reused_blocks_until_the_copy_ends() -> None:
    """Turn 2 is aborted on the context side while its early copy is queued: the cancel
    cannot return (the copy reads the blocks), so the worker's finish parks the blocks with
    their references; no allocation can take them. Once the copy ran, the cancel returns,
    the receiver gets the fence, and the parked blocks go back to the prefix cache, where
    the next turn finds them."""
    ctx, hook, receiver, engine = _context_rig()
    reused, _, want = _early(ctx, hook, receiver)
    with pytest.raises(TransferTimeoutError, match="request 2: copies reading its blocks"):
        hook.cancel(2, timeout=0.01)
    ctx.finish(2)  # the scheduler drops the request...
    assert list(ctx.parked) == [2] and set(reused) <= set(ctx.parked[2])  # ...but its blocks stay
    with pytest.raises(MemoryError, match="KV pool exhausted"):
        ctx.admit(3, FRESH)
    assert not receiver.fenced(2)  # the copy still writes its destination blocks
    engine.gates[0].opened = True
    hook.cancel(2, timeout=1)
    assert not hook.leased(2) and receiver.fenced(2)
    assert receiver.notices(2) == []  # the copy's notice was dropped with the revocation
    receiver.release(2, timeout=0)
    state = ctx.admit(4, P2)  # admit reaps the parked blocks first
    assert ctx.parked == {} and state.blocks[:3] == reused and digest(ctx.pool, reused) == want


# --- (b) source blocks: a copy past the sender's timeout --------------------------------------


def test_a_timed_out_copy_keeps_its_source_leased_and_its_destination_unfenced(sender_clock: FakeClock) -> None:
    """A copy into a receiver in another process outlives the sender's timeout. The sender
    reports it but cannot call a local copy off: the request stays leased (its source
    blocks may not be freed), a cancel raises and keeps it revoked, and the receiver's
    release waits, since the copy still writes there. When the copy ends, the cancel
    returns, the lease ends, the fence arrives, the release returns; the copy read intact
    source blocks throughout."""
    remote = Remote("shm")
    from kvferry.transports.shm import ShmTransport

    try:
        src, src_blocks = POOLS.random(3), Blocks(NUM_BLOCKS)
        engine = GatedEngine()
        sender = KVSender(src, ShmTransport(remote.address, authkey=remote.authkey), engine=engine, timeout=0.05)
        rows = src_blocks.take(6)
        dst, epoch = remote.call("expect", 3, 24)
        sender.add(3, 24, reused_len=9, epoch=epoch)
        want = digest(src, rows[:2])
        engine.hold()
        sender.send_early([3], tables(rows), tables(dst))
        assert engine.started.wait(SLACK)
        sender_clock.advance(0.1)  # the copy is held: now past the sender's 0.05 s timeout
        with pytest.raises(TransferTimeoutError, match=r"copies for requests \[3\] still running .* cancel them"):
            sender.poll()
        with pytest.raises(TransferTimeoutError, match="request 3: copies reading its blocks still running"):
            sender.cancel(3, timeout=0.05)
        assert sender.leased(3)  # so the engine keeps the source blocks
        with pytest.raises(ValueError, match=r"\[3\] were cancelled"):
            sender.send_chunks([3], [9], [24], tables(rows), tables(dst))
        status, _, message = remote.call("release", 3, 0.3)
        assert status == "TransferTimeoutError" and "no fence" in message
        engine.release()
        assert sender.cancel(3, timeout=SLACK).claimed_blocks == 2
        assert not sender.leased(3)
        src_blocks.give(rows)  # only now
        for layer in src.layers:  # ... and reused at once: nothing reads them any more
            layer[torch.tensor(rows)] = -1.0
        assert remote.call("release", 3, SLACK)[0] == "ok"
        assert remote.call("digest", dst[:2]) == want  # what the copy read was intact
        remote.close_after(sender)
    finally:
        remote.cleanup()


# --- (c) destination blocks: late writes, revocation fences, epochs ---------------------------


def test_release_waits_for_the_fence_of_a_write_still_in_flight() -> None:
    """The generation side gives up on request 7 while a chunk's write into its blocks is
    under way. `release` does not hand the blocks back: it asks the sender to cancel (over
    the socket) and waits for the fence, which the sender can post only once that write
    ended. Then request id 7 is reused for a new request on the same blocks: a late notice
    of the old epoch is discarded (neither counted nor failing the new request), and the
    new request arrives bit-exact."""
    from kvferry.transports.shm import ShmTransport

    before = set(threading.enumerate())
    remote = Remote("shm")
    try:
        src = POOLS.random(7)
        engine = GatedEngine()
        sender = KVSender(src, ShmTransport(remote.address, authkey=remote.authkey), engine=engine, timeout=30)
        rows = list(range(6))
        dst, old = remote.call("expect", 7, 24)
        sender.add(7, 24, reused_len=9, epoch=old)
        sender.send_early([7], tables(rows), tables(dst))
        sender.flush(timeout=SLACK)
        # The notice crosses the socket on its own: it must have been taken in before the
        # receiver gives up below (the release comes down another pipe, and could overtake it).
        assert until(lambda: len(remote.call("request", 7)[2]) == 1)
        engine.hold()
        sender.send_chunks([7], [9], [24], tables(rows), tables(dst))
        assert engine.wait_running(lambda n: n == 1)  # the write is under way

        status, waited, message = remote.call("release", 7, 0.3)
        assert status == "TransferTimeoutError" and waited >= 0.3 and "epoch" in message
        # The sender hears of it at its next call: the request fails and is revoked, but the
        # running write still holds it: no fence yet.
        with pytest.raises(TransferError, match=r"requests \[7\] cancelled by the receiver") as info:
            sender.poll()
        assert info.value.request_ids == (7,) and sender.leased(7)
        assert remote.call("release", 7, 0.2)[0] == "TransferTimeoutError"
        fenced, complete, arrived = remote.call("request", 7)
        assert (fenced, complete) == (False, False) and [a[:4] for a in arrived] == [(7, 0, 0, 2)]

        engine.release()
        # The write ended (the engine counts it done a moment before its future says so: flush
        # waits for that): its notice is dropped, the fence posted.
        sender.flush(timeout=SLACK)
        assert not sender.leased(7)
        assert remote.call("release", 7, SLACK)[0] == "ok"
        assert sender.cancel(7).claimed_blocks == 6  # acknowledges the failure

        # Request id 7 again, on the same destination blocks (the free list gives them back).
        dst2, new = remote.call("expect", 7, 24)
        assert sorted(dst2) == sorted(dst) and new > old
        late = ShmTransport(remote.address, authkey=remote.authkey)  # a sender that never heard
        late.post([Notice(7, 1, 2, 6, True, old)])
        assert until(
            lambda: any(
                d[3].startswith(f"epoch {old} of request 7, which is now epoch {new}")
                for d in remote.call("status")["discarded"]
            )
        )
        assert remote.call("request", 7) == (False, False, [])
        late.close()
        sender.add(7, 24, reused_len=9, epoch=new)
        sender.send_early([7], tables(rows), tables(dst2))
        sender.send_chunks([7], [9], [24], tables(rows), tables(dst2))
        sender.flush(timeout=SLACK)
        assert remote.call("wait", 7, SLACK) == ("ok", digest(src, rows))
        assert remote.call("release", 7, 0)[0] == "ok"
        assert sender.remove(7).is_complete
        remote.close_after(sender)
    finally:
        remote.cleanup()
    assert_nothing_leased(threads=before)


def test_without_the_fence_a_late_one_sided_write_lands_in_the_new_owners_blocks() -> None:
    """The control: the generation side skips the fence (`release_unfenced`) while a write
    into request 7's blocks is under way, and gives id 7 and the blocks to a new request.
    Nothing of the old request counts for the new one, but a one-sided write cannot be
    stopped at the receiver: it overwrites the new owner's bytes. That is why `release`
    waits for the fence."""
    from kvferry.transports.shm import ShmTransport

    remote = Remote("shm")
    try:
        engine = GatedEngine()
        sender = KVSender(POOLS.random(8), ShmTransport(remote.address, authkey=remote.authkey), engine=engine)
        dst, old = remote.call("expect", 7, 8)
        sender.add(7, 8, epoch=old)
        engine.hold()
        sender.send_chunks([7], [0], [8], tables([0, 1]), tables(dst))
        assert engine.wait_running(lambda n: n == 1)
        # The receiver knows its sender (the announce crossed the socket), so the release's
        # cancellation goes to it.
        assert until(lambda: "its sender is" in remote.call("wait", 7, 0)[1])
        assert remote.call("release_unfenced", 7) == "ok"  # the bug: no fence awaited
        dst2, new = remote.call("expect", 7, 8)
        assert sorted(dst2) == sorted(dst)
        owner = remote.call("fill", dst2, 42.0)
        engine.release()
        assert engine.wait_running(lambda n: n == 0)
        # The receiver's cancellation crosses its socket; the reply on the pipe may overtake it.
        assert until(lambda: 7 in sender.failures())
        with pytest.raises(TransferError, match="cancelled by the receiver"):
            sender.poll()  # it heard of the cancellation: too late for a write under way
        sender.flush(timeout=SLACK)
        assert remote.call("request", 7) == (False, False, [])  # nothing counted for the new 7...
        assert remote.call("digest", dst2) != owner  # ...but the old write's bytes landed
        sender.close()
        remote.call("release_unfenced", 7)
        assert remote.close() == []
    finally:
        remote.cleanup()


def test_staging_never_applies_ring_data_the_receiver_would_not_take() -> None:
    """On the staging path the receiver copies every write from the ring itself, so it
    checks each one: ring data of a request it cancelled, or of an old epoch that arrives
    after the request was fenced, released and its id and blocks reused, never reaches the
    pool (the blocks keep the new owner's bytes) and its notice is discarded. The sender
    here is a bare transport that ignores fences and cancellations: the receiver does not
    rely on it."""
    from kvferry.engine import ThreadCopyEngine
    from kvferry.transports.staging import StagingTransport

    remote = Remote("staging")
    engine = ThreadCopyEngine()
    try:
        src = POOLS.random(9)
        rogue = StagingTransport(remote.address, authkey=remote.authkey)

        def write(notice: Notice, dst: list[int]) -> Pending:
            pending = rogue.write(
                engine,
                Write(src, np.arange(notice.start, notice.end), np.array(dst[notice.start : notice.end]), [notice]),
            )
            assert pending.wait(SLACK) and pending.error() is None
            return pending

        # Request 8: cancelled at the receiver, then its data arrives.
        dst8, e8 = remote.call("expect", 8, 8)
        assert remote.call("cancel", 8) is True
        write(Notice(8, 0, 0, 2, True, e8), dst8)
        rogue.post([Notice(8, 0, 0, 2, True, e8)])
        assert until(lambda: any(d[:2] == ("notice", 8) for d in remote.call("status")["discarded"]))
        assert remote.call("digest", dst8) == digest(POOLS.zeros(), range(2))  # still zeros

        # Request 5: its old write is staged, the sender fences it, the receiver releases it
        # and gives id 5 and its blocks to a new owner; then the old write is posted.
        dst5, old = remote.call("expect", 5, 16)
        stale = Notice(5, 0, 0, 4, True, old)
        write(stale, dst5)
        rogue.revoke(5, old)
        assert remote.call("release", 5, SLACK)[0] == "ok"
        dst5b, new = remote.call("expect", 5, 16)
        assert sorted(dst5b) == sorted(dst5)
        owner = remote.call("fill", dst5b, 42.0)
        rogue.post([stale])
        assert until(lambda: any(d[:3] == ("notice", 5, old) for d in remote.call("status")["discarded"]))
        assert remote.call("digest", dst5b) == owner  # not one byte of the old write landed
        assert remote.call("request", 5) == (False, False, [])
        # A good write of the new epoch still goes through (the ring slots were freed).
        notice = Notice(5, 0, 0, 4, True, new)
        write(notice, dst5b)
        rogue.post([notice])
        assert remote.call("wait", 5, SLACK) == ("ok", digest(src, range(4)))
        state = remote.call("status")
        assert state["refused"] == [] and state["errors"] == []
        rogue.close()
        remote.call("release", 8, SLACK)  # the rogue's end fenced 8
        remote.call("release", 5, 0)
        assert remote.close() == []
    finally:
        engine.close()
        remote.cleanup()


def test_nixl_fences_travel_with_the_notifications(loopback_ucx: None) -> None:
    """NIXL: the fence is a notification of its own, posted after the request's writes
    ended; a cancellation from the receiver comes back over the socket; a late notification
    of an old epoch is discarded after the request id was reused."""
    from kvferry.transports.nixl import NixlTransport, _encode

    remote = Remote("nixl")
    try:
        src = POOLS.random(4)
        transport = NixlTransport(remote.address, authkey=remote.authkey, src=src)
        # progress=False: the receiver's cancellation below is heard at the executor's next
        # poll, not by the announcer, so the first release times out for sure.
        sender = KVSender(src, transport, timeout=30, progress=False)
        # Cancelled by the sender after its early slice landed: the fence lets the receiver
        # release at once, while the sender is still connected.
        dst, old = remote.call("expect", 1, 24)
        sender.add(1, 24, reused_len=9, epoch=old)
        sender.send_early([1], tables(list(range(6))), tables(dst))
        sender.flush(timeout=SLACK)
        assert sender.cancel(1).claimed_blocks == 2
        status, waited = remote.call("release", 1, SLACK)
        assert status == "ok" and waited < SLACK
        # Given up by the receiver: the sender hears of it at its next poll and fences.
        dst2, e2 = remote.call("expect", 2, 8)
        sender.add(2, 8, epoch=e2)
        assert remote.call("release", 2, 0.1)[0] == "TransferTimeoutError"
        err, _ = expect_failed_soon(sender.poll, SLACK)
        assert err.request_ids == (2,) and "cancelled by the receiver" in str(err)
        assert remote.call("release", 2, SLACK)[0] == "ok"
        sender.cancel(2)
        # Id 1 again: a late notification of the old epoch is discarded.
        dst3, new = remote.call("expect", 1, 24)
        transport.agent.send_notif(transport._remote_name, _encode([Notice(1, 1, 2, 6, True, old)]))
        assert until(lambda: any(d[:3] == ("notice", 1, old) for d in remote.call("status")["discarded"]))
        assert remote.call("request", 1) == (False, False, [])
        assert remote.call("release_unfenced", 1) == "ok"  # nothing was sent for it
        state = remote.call("status")
        assert state["refused"] == [] and state["errors"] == [], state
        sender.close()
        remote.close()
    finally:
        remote.cleanup()


# --- epochs and fences at the receiver, in one process ----------------------------------------


def _pair(timeout: float | None = None, progress: bool = True) -> tuple[KVSender, KVReceiver, ManualEngine]:
    engine = ManualEngine()
    return (*in_process_pair(engine=engine, timeout=timeout, progress=progress), engine)


def test_epochs_are_issued_per_receiver_and_stale_notices_are_discarded() -> None:
    receiver = KVReceiver(POOLS.random(0))
    e1 = receiver.expect(1, 16)
    e2 = receiver.expect(2, 16)
    assert 0 < e1 < e2 and receiver.epoch(2) == e2
    receiver.release_unfenced(1)  # nothing was ever sent for it
    e3 = receiver.expect(1, 16)  # the id again, a new epoch
    assert e3 > e2
    assert not receiver.deliver(Notice(1, 0, 0, 2, False, e1))  # the old epoch: discarded
    (discard,) = receiver.discarded()
    assert (discard.kind, discard.request_id, discard.epoch) == (
        "notice",
        1,
        e1,
    ) and f"now epoch {e3}" in discard.reason
    assert receiver.notices(1) == [] and receiver.refused() == []
    assert not receiver.deliver(Notice(1, 0, 0, 2, False, e3))  # the current one counts
    assert receiver.notices(1) == [Notice(1, 0, 0, 2, False, e3)]
    with pytest.raises(InvalidArgumentError, match="invalid epoch=99 for request 2: never issued"):
        receiver.deliver(Notice(2, 0, 0, 2, False, 99))
    with pytest.raises(TransferError, match="never issued"):  # refused: the request fails
        receiver.wait(2, timeout=0)
    # A fence of an old epoch changes nothing either.
    assert not receiver.revoked(1, e1)
    assert not receiver.fenced(1) and [d.kind for d in receiver.discarded()] == ["notice", "revoke"]
    # Released ids: stale, not unknown.
    receiver.release_unfenced(2)
    assert not receiver.deliver(Notice(2, 0, 0, 1, False, e2))
    assert receiver.discarded_count == 3 and receiver.refused_count == 1


def test_a_receiver_cancel_reaches_an_in_process_sender_and_the_fence_comes_back() -> None:
    """The receiver gives up while a copy is queued: release asks, times out (the copy may
    still write), the sender's next poll revokes the request and raises its failure once,
    and the fence follows the copy's end. (No announcer: the test reads what the executor's
    own polls post, which an announcer could post first.)"""
    sender, receiver, engine = _pair(progress=False)
    epoch = receiver.expect(1, 16)
    other = receiver.expect(2, 16)
    sender.add(1, 16, reused_len=8, epoch=epoch)
    sender.add(2, 16, reused_len=8, epoch=other)
    table = np.arange(8).reshape(2, 4)
    sender.send_early([1, 2], table, table)  # one write carries both
    with pytest.raises(TransferTimeoutError, match="request 1 .*no fence"):
        receiver.release(1, timeout=0.01)
    with pytest.raises(TransferError, match=r"requests \[1\] cancelled by the receiver in this process") as info:
        sender.poll()
    assert info.value.request_ids == (1,) and set(sender.failures()) == {1} and sender.leased(1)
    assert sender.poll() == []  # raised once
    engine.gates[0].opened = True
    posted = sender.poll()
    assert [n.request_id for n in posted] == [2]  # 1's notice dropped, 2's went
    assert receiver.fenced(1) and not sender.leased(1)
    assert receiver.release(1, timeout=0).claimed_blocks == 0
    assert sender.cancel(1).claimed_blocks == 2  # acknowledged
    sender.send_chunks([2], [8], [16], table[1:], table[1:])
    engine.gates[1].opened = True
    sender.flush(timeout=1)
    assert receiver.wait(2, timeout=1) and receiver.release(2, timeout=0).is_complete
    # A cancellation meant for an older request with the same id is ignored.
    e_new = receiver.expect(1, 16)
    sender.add(1, 16, epoch=e_new)
    sender.transport._cancels.append((1, epoch))  # type: ignore[attr-defined]  (a late one)
    assert sender.poll() == [] and sender.failures() == {}
    sender.cancel(1)
    sender.close()


def test_sender_cancel_remove_and_close_post_fences() -> None:
    """Every way the sender gives a request up before its last notice fences it, once its
    copies ended: cancel (at once when nothing is queued), removal of an incomplete request,
    close; a complete request needs no fence."""
    sender, receiver, engine = _pair()
    epochs = {rid: receiver.expect(rid, 16) for rid in (1, 2, 3, 4)}
    for rid in epochs:
        sender.add(rid, 16, reused_len=8, epoch=epochs[rid])
    table = np.arange(4)[None, :]
    sender.cancel(1)
    assert receiver.fenced(1) and receiver.release(1, timeout=0).claimed_blocks == 0
    sender.send_early([2], table, table)
    engine.gates[0].opened = True
    sender.flush(timeout=1)
    assert sender.remove(2).claimed_blocks == 2  # incomplete: fenced
    with pytest.raises(TransferError, match="request 2: revoked by its sender before all its blocks arrived"):
        receiver.wait(2, timeout=0)
    assert receiver.release(2, timeout=0).claimed_blocks == 2
    sender.send_chunks([3], [8], [16], table, table)
    engine.gates[1].opened = True
    sender.flush(timeout=1)
    assert sender.remove(3).is_complete and receiver.wait(3, timeout=0)
    assert receiver.release(3, timeout=0).is_complete
    assert not receiver.fenced(4)
    sender.close()  # 4 is still registered: its fence goes out
    assert receiver.fenced(4) and receiver.release(4, timeout=0).claimed_blocks == 0
    assert receiver.discarded() == [] and receiver.refused() == []


# --- follow-ups: writes that fail, the transport interface, announce on add ---------------------


class _BrokenWrite(InProcessTransport):
    """An in-process transport whose receiver vanishes at the n-th write."""

    def __init__(self, receiver: KVReceiver, fail_at: int) -> None:
        super().__init__(receiver)
        self.writes = 0
        self.fail_at = fail_at

    def write(self, engine: Any, job: Write) -> Pending:
        self.writes += 1
        if self.writes == self.fail_at:
            raise TransferError("staging ring: the receiver closed its socket", peer=self.peer)
        return super().write(engine, job)


def test_a_write_that_loses_the_receiver_fails_every_request_and_claims_nothing() -> None:
    """A `TransferError` from `transport.write` (the staging ring reading a closed socket)
    is the receiver gone: every request fails at once, with its id, and no slice stays
    claimed without a write; the sender refuses to send from then on."""
    receiver = KVReceiver(POOLS.random(1))
    for rid in (1, 2):
        receiver.expect(rid, 16)
    transport = _BrokenWrite(receiver, fail_at=2)
    transport.max_write_blocks = 2  # the plan below needs two writes: the second one fails
    sender = KVSender(POOLS.random(0), transport)
    for rid in (1, 2):
        sender.add(rid, 16, reused_len=8)
    table = np.arange(8).reshape(2, 4)
    with pytest.raises(TransferError, match=r"requests \[1, 2\] failed and were released") as info:
        sender.send_early([1, 2], table, table)
    assert info.value.request_ids == (1, 2)
    assert len(sender.book) == 0 and set(sender.failures()) == {1, 2}
    assert not sender.leased(1) and not sender.leased(2)
    with pytest.raises(TransferError, match="receiver closed its socket"):
        sender.add(3, 16)
    assert sender.cancel(1).claimed_blocks == 2 and sender.cancel(2).claimed_blocks == 2
    assert_nothing_leased(sender=sender)
    sender.close()


def test_the_transport_interface_needs_no_optional_methods() -> None:
    """A transport that implements only `post` and `revoke` works: the base class declares
    `peer`, `check_peer`, `announce` and `cancel_requests`, and `Pending.abort` says no."""
    from kvferry.transports.base import Transport

    class Minimal(Transport):
        def __init__(self, receiver: KVReceiver) -> None:
            self.receiver, self.dst = receiver, receiver.pool

        def post(self, batch: Any, revoked: Any = frozenset()) -> None:
            for notice in batch:
                if notice.request_id not in revoked:
                    self.receiver.deliver(notice)

        def revoke(self, request_id: int, epoch: int) -> None:
            self.receiver.revoked(request_id, epoch)

    receiver = KVReceiver(POOLS.random(1))
    epoch = receiver.expect(1, 16)
    sender = KVSender(POOLS.random(0), Minimal(receiver))
    sender.add(1, 16, epoch=epoch)
    table = np.arange(4)[None, :]
    sender.send_chunks([1], [0], [16], table, table)
    sender.flush(timeout=10)
    assert receiver.wait(1, timeout=10) and sender.remove(1).is_complete
    assert ManualEngine().submit_call(lambda: None).abort() is False
    assert Minimal(receiver).peer == "receiver" and Minimal(receiver).cancel_requests() == []
    sender.close()


def test_add_announces_so_a_dead_sender_fails_its_requests_at_once() -> None:
    """`KVSender.add` announces the request with its epoch: a sender killed before it sent
    anything fails the request at once (not at its timeout), and fences it."""
    from test_faults import Context

    served = serve("shm")
    receiver = served.receiver
    ctx = Context(served.endpoint.address, served.authkey)
    try:
        receiver.expect(1, 24)
        assert ctx.call("add", 1, 24, 9) == "ok"  # no notice, only the announce
        ctx.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match="request 1 failed: .*went away"):
            receiver.wait(1, timeout=SLACK * 2)
        assert time.monotonic() - start < SLACK and receiver.fenced(1)
        receiver.release(1, timeout=0)
        assert_nothing_leased(receiver, endpoint=served.endpoint)
    finally:
        ctx.cleanup()
        served.close()


def test_endpoint_errors_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that keeps sending refused notices cannot grow the endpoint: it keeps the
    last few errors and counts them all. Stale notices are no errors at all."""
    import kvferry.transports.control
    from kvferry.transports.shm import ShmTransport

    monkeypatch.setattr(kvferry.transports.control, "ERRORS_KEPT", 8)
    with shm_endpoint() as (receiver, endpoint, authkey):
        rogue = ShmTransport(endpoint.address, authkey=authkey)
        old = receiver.expect(1, 8)
        receiver.release_unfenced(1)
        for i in range(20):
            rogue.post([Notice(100 + i, 0, 0, 1, True)])  # unknown requests: refused
            rogue.post([Notice(1, i, 0, 1, True, old)])  # a released epoch: discarded
        assert until(lambda: endpoint.error_count == 20 and receiver.discarded_count == 20)
        assert len(endpoint.errors) == 8 and receiver.refused_count == 20
        assert all(isinstance(e, UnknownRequestError) for e in endpoint.errors)
        rogue.close()
        assert_nothing_leased(receiver, endpoint=endpoint)


def test_a_cancel_before_any_announce_reaches_the_sender_that_announces_later() -> None:
    """The receiver may give up before the request's announce arrived: nobody to ask but
    in-process senders then; the sender that announces it later is asked at once, and
    only once."""
    receiver = KVReceiver(POOLS.random(0))
    asked: list[tuple[Any, int, int]] = []
    receiver.on_cancel(lambda source, rid, epoch: asked.append((source, rid, epoch)))
    epoch = receiver.expect(1, 16)
    assert receiver.cancel(1) and asked == [(None, 1, epoch)]
    receiver.bind(1, "sender A", epoch)
    receiver.bind(1, "sender A", epoch)
    assert asked == [(None, 1, epoch), ("sender A", 1, epoch)]
    assert not receiver.deliver(Notice(1, 0, 0, 2, False, epoch), "sender A")  # discarded: cancelled
    assert receiver.revoked(1, epoch, "sender A")
    assert receiver.release(1, timeout=0).claimed_blocks == 0


def test_release_returns_once_the_fence_arrives() -> None:
    """A release of an unfenced request asks its sender to cancel and waits: another
    sender's fence does not end the wait, its own sender's does (well before the release's
    own timeout, which would raise instead)."""
    receiver = KVReceiver(POOLS.random(0))
    epoch = receiver.expect(1, 16)
    receiver.bind(1, "sender A", epoch)
    asked = threading.Event()
    receiver.on_cancel(lambda source, rid, e: asked.set())
    released: list[Any] = []
    thread = threading.Thread(target=lambda: released.append(receiver.release(1, timeout=SLACK)))
    thread.start()
    assert asked.wait(SLACK)  # the release has begun: it asked sender A, and waits for the fence
    assert not released and len(receiver) == 1  # the blocks are not handed back
    with pytest.raises(TransferError, match="revoked by sender B, but it belongs to sender A"):
        receiver.revoked(1, epoch, "sender B")  # another sender's fence does not count
    assert not released and len(receiver) == 1
    assert receiver.revoked(1, epoch, "sender A")
    thread.join(timeout=SLACK)
    assert released and released[0].claimed_blocks == 0 and len(receiver) == 0


# --- one stage per request ---------------------------------------------------------------------


def test_receiver_stages_follow_the_diagram() -> None:
    """Each edge of `ReceiverStage`'s diagram, and what each stage does with a notice:
    PENDING and ENDED count it, CANCELLED and FENCED discard it; fenced is ``>= ENDED``."""
    receiver = KVReceiver(POOLS.random(0))
    epochs = {rid: receiver.expect(rid, 8) for rid in (1, 2, 3, 4)}  # 2 blocks each
    for rid, epoch in epochs.items():
        receiver.bind(rid, "sender A", epoch)
    assert {receiver.stage(rid) for rid in epochs} == {ReceiverStage.PENDING}
    assert receiver.deliver(Notice(1, 0, 0, 2, True, epochs[1]), "sender A")
    assert receiver.stage(1) == ReceiverStage.COMPLETE
    assert receiver.cancel(2) and receiver.stage(2) == ReceiverStage.CANCELLED and not receiver.fenced(2)
    assert not receiver.deliver(Notice(2, 0, 0, 2, True, epochs[2]), "sender A")  # discarded
    assert receiver.fence_source("sender A") == [1, 2, 3, 4]
    stages = [receiver.stage(rid) for rid in (1, 2, 3, 4)]
    assert stages == [ReceiverStage.COMPLETE, ReceiverStage.FENCED, ReceiverStage.ENDED, ReceiverStage.ENDED]
    assert receiver.deliver(Notice(3, 0, 0, 2, True, epochs[3]), "sender A")  # a late notice counts
    assert receiver.revoked(4, epochs[4], "sender A") and receiver.stage(4) == ReceiverStage.FENCED
    assert not receiver.deliver(Notice(4, 0, 0, 2, True, epochs[4]), "sender A")  # discarded
    assert all(receiver.fenced(rid) for rid in epochs) and receiver.notices(2) == receiver.notices(4) == []
    for rid in epochs:
        receiver.release(rid, timeout=0)


def test_sender_stages_follow_the_diagram() -> None:
    """Each edge of `SenderStage`'s diagram: a cancel that times out leaves the request
    REVOKED (still in the book); one whose copy finished behind another request's unfinished
    copy leaves it DRAINING (out of the book, its notices dropped once posted, its fence
    sent) until that copy is posted; the receiver's cancellation fails a request, SETTLED
    until `remove` acknowledges it."""
    sender, receiver, engine = _pair(progress=False)
    epochs = {rid: receiver.expect(rid, 16) for rid in (1, 2, 3)}
    for rid, epoch in epochs.items():
        sender.add(rid, 16, reused_len=8, epoch=epoch)
    assert {sender.stage(rid) for rid in epochs} == {SenderStage.SENDING}
    table = np.arange(4)[None, :]
    sender.send_early([2], table, table + 4)  # gate 0: the head of the queue
    sender.send_early([1], table, table)  # gate 1
    with pytest.raises(TransferTimeoutError, match="request 1: copies reading its blocks"):
        sender.cancel(1, timeout=0)
    assert sender.stage(1) == SenderStage.REVOKED and 1 in sender.book and sender.leased(1)
    engine.gates[1].opened = True
    assert not sender.cancel(1).is_complete
    assert sender.stage(1) == SenderStage.DRAINING and 1 not in sender.book and sender.in_flight(1)
    assert receiver.fenced(1)  # its copy ended: the fence went, ahead of its dropped notices
    engine.gates[0].opened = True
    assert [n.request_id for n in sender.poll()] == [2]  # request 1's notices are dropped
    with pytest.raises(UnknownRequestError):
        sender.stage(1)  # forgotten
    assert receiver.notices(1) == []

    receiver.cancel(3)  # the receiver gives up: the sender's next poll fails it
    with pytest.raises(TransferError, match=r"requests \[3\] cancelled by the receiver"):
        sender.poll()
    assert sender.stage(3) == SenderStage.SETTLED and 3 not in sender.book and list(sender.failures()) == [3]
    sender.remove(3)
    with pytest.raises(UnknownRequestError):
        sender.stage(3)
    assert not sender.failures()
    sender.close()
