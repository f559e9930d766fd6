"""The executor's thread never waits on the network or on room in a transport (issue 19
item 4; issue 21, "the early send never waits on a full ring").

Each stall is forced, never hoped for: a staging receiver whose connection thread is held
on an Event before it applies a batch (so it frees no ring slot and reads no frame), and a
transport whose post blocks on an Event the way a send into a socket nobody drains does.
Every executor call is made on a helper thread and waited for with a deadlock guard only:
on the code before the fix the early send waited for ring room (up to the sender's
timeout) and every call waited for the lock the announcer held across its post, so each
of these guards tripped.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import threading
from typing import Any, Callable, Sequence

import numpy as np
import pytest
import torch
from helpers import TRANSFER_POOLS
from kvferry import sender as sender_module
from kvferry.engine import CopyEngine, Pending, _FuturePending
from kvferry.errors import TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.staging import StagingEndpoint, StagingTransport

POOLS = TRANSFER_POOLS
TPB, LAYERS, SHAPE = POOLS.tpb, POOLS.layers, POOLS.shape
GUARD = 30.0  # deadlock guard on every wait: never reached when the code is right
RING = 4  # staging ring slots: a write is at most 2 blocks
PREFIX_BLOCKS = 16 * RING  # the early send: 16 times the ring


class PausedStaging(StagingEndpoint):
    """A staging endpoint whose connection threads stop before applying each batch until
    ``resume`` is set: while paused it frees no slot and reads no further frame."""

    def __init__(self, receiver: KVReceiver, **options: Any) -> None:
        self.resume = threading.Event()
        self.reached = threading.Event()  # a batch is waiting for resume
        super().__init__(receiver, **options)

    def stage(self, *args: Any, **kwargs: Any) -> None:
        self.reached.set()
        assert self.resume.wait(GUARD), "the test never resumed the receiver"
        super().stage(*args, **kwargs)


def returns(call: Callable[[], Any]) -> Any:
    """Runs an executor call on a helper thread; its result, or the failure of the guard
    when it does not return (it waits on the stalled link)."""
    done = threading.Event()
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", call()))
        except BaseException as err:  # handed back to the test
            out.append(("raised", err))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(GUARD), "the executor's call waited on the stalled link"
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value


def table(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)[None, :]


def blocks_of(pool: PagedKV, ids: Sequence[int]) -> list[torch.Tensor]:
    index = torch.as_tensor(list(ids))
    return [layer[index].clone() for layer in pool.layers]


def assert_exactly_once(notices: Sequence[Notice], blocks: int) -> None:
    """Every block ``[0, blocks)`` covered by exactly one notice."""
    count = np.zeros(blocks, dtype=np.int64)
    for n in notices:
        count[n.start : n.end] += 1
    assert count.tolist() == [1] * blocks, count


def assert_landed_once(receiver: KVReceiver, src: PagedKV, blocks: int) -> None:
    """Request 1's first ``blocks`` blocks landed equal to the source's, each noticed once."""
    for got, want in zip(blocks_of(receiver.pool, range(blocks)), blocks_of(src, range(blocks))):
        assert torch.equal(got, want)
    assert_exactly_once(receiver.notices(1), blocks)


def shm_pair() -> tuple[Any, KVReceiver, Any, Any]:
    """A shared-memory receiver pool, its receiver and endpoint, and a transport to it."""
    from kvferry.transports.shm import ShmEndpoint, ShmTransport

    shared = POOLS.shared()
    assert shared.pool is not None
    receiver = KVReceiver(shared.pool)
    authkey = secrets.token_bytes(32)
    endpoint = ShmEndpoint(receiver, shared, authkey=authkey)
    return shared, receiver, endpoint, ShmTransport(endpoint.address, authkey=authkey)


def staging_pair(src: PagedKV, paused: bool) -> tuple[KVReceiver, StagingEndpoint, KVSender]:
    receiver = KVReceiver(POOLS.nan())
    authkey = secrets.token_bytes(32)
    kind = PausedStaging if paused else StagingEndpoint
    endpoint = kind(receiver, authkey=authkey, capacity_blocks=RING)
    sender = KVSender(src, StagingTransport(endpoint.address, authkey=authkey), timeout=GUARD * 4)
    return receiver, endpoint, sender


def test_an_early_send_many_times_the_ring_returns_before_any_slot_frees() -> None:
    """A prefix of 16 rings through a receiver that frees nothing: the early send returns
    with the writes backlogged; the next step's calls (the chunk send, poll, a new request,
    a cancel of a backlogged one) return while the link stays stalled; a second sender to a
    healthy receiver completes meanwhile. Resumed, the stalled request lands bit exact,
    each block once, and the cancelled one gets its fence, none of its blocks."""
    src = POOLS.random(0)
    prompt = PREFIX_BLOCKS * TPB + 3  # the prefix, and a partial block the forward writes
    src_ids, dst_ids = list(range(PREFIX_BLOCKS + 1)), list(range(10, 11 + PREFIX_BLOCKS))
    receiver, endpoint, sender = staging_pair(src, paused=True)
    healthy_receiver, healthy_endpoint, healthy = staging_pair(src, paused=False)
    assert isinstance(endpoint, PausedStaging)
    try:
        epoch = receiver.expect(1, prompt)
        returns(lambda: sender.add(1, prompt, reused_len=prompt - 1, epoch=epoch))
        early = returns(lambda: sender.send_early([1], table(src_ids), table(dst_ids)))
        assert sum(n.end - n.start for n in early) == PREFIX_BLOCKS  # planned and numbered, all of it
        assert not endpoint.resume.is_set() and sender.backlogged > 0  # no slot was freed: they wait
        assert endpoint.reached.wait(GUARD)  # the receiver holds the first batch: the link is stalled

        # The next step, the link still stalled: the chunk, a poll, a new request and a
        # cancel of that request (its writes only backlogged, never started) all return.
        chunk = returns(lambda: sender.send_chunks([1], [prompt - 1], [prompt], table(src_ids), table(dst_ids)))
        assert [(n.start, n.end, n.last) for n in chunk] == [(PREFIX_BLOCKS, PREFIX_BLOCKS + 1, True)]
        returns(sender.poll)
        epoch2 = receiver.expect(2, 8 * TPB)
        returns(lambda: sender.add(2, 8 * TPB, epoch=epoch2))
        src2, dst2 = list(range(70, 78)), list(range(80, 88))
        returns(lambda: sender.send_chunks([2], [0], [8 * TPB], table(src2), table(dst2)))
        assert sender.in_flight(2) and sender.leased(2)  # backlogged behind request 1's writes
        ledger = returns(lambda: sender.cancel(2, timeout=0))  # nothing of it was read: no wait
        assert ledger.claimed_blocks == 8 and not sender.in_flight(2) and not sender.leased(2)

        # Another receiver, healthy: its request completes while the first link is stalled.
        e3 = healthy_receiver.expect(3, 6 * TPB)
        returns(lambda: healthy.add(3, 6 * TPB, epoch=e3))
        src3, dst3 = list(range(40, 46)), list(range(0, 6))
        returns(lambda: healthy.send_chunks([3], [0], [6 * TPB], table(src3), table(dst3)))
        healthy_receiver.wait(3, timeout=GUARD)
        for got, want in zip(blocks_of(healthy_receiver.pool, dst3), blocks_of(src, src3)):
            assert torch.equal(got, want)
        assert not endpoint.resume.is_set() and not receiver.is_complete(1)

        endpoint.resume.set()  # the link resumes
        receiver.wait(1, timeout=GUARD)
        for got, want in zip(blocks_of(receiver.pool, dst_ids), blocks_of(src, src_ids)):
            assert torch.equal(got, want)
        assert_exactly_once(receiver.notices(1), PREFIX_BLOCKS + 1)
        assert receiver.release(2, timeout=GUARD).claimed_blocks == 0  # its fence came, none of its blocks
        assert torch.isnan(receiver.pool.layers[0][dst2]).all()
        sender.flush(timeout=GUARD)
        assert sender.remove(1).is_complete
    finally:
        endpoint.resume.set()
        for s in (sender, healthy):
            s.close()
        endpoint.close()
        healthy_endpoint.close()


def test_a_backlog_past_its_bound_fails_the_request_that_hit_it() -> None:
    """``backlog_blocks`` bounds what waits for room: the send that would pass it fails its
    request at once with an error naming the bound; nothing blocks, and the request already
    backlogged is untouched."""
    src = POOLS.random(1)
    receiver = KVReceiver(POOLS.nan())
    authkey = secrets.token_bytes(32)
    endpoint = PausedStaging(receiver, authkey=authkey, capacity_blocks=RING)
    # Request 1 fits whatever part of it the ring took at once (a write meeting the
    # announcer holding the transport goes to the backlog, and every write after it):
    # the ring holds at most RING blocks, so at least 8 of its 12 wait, and request 2's 12
    # more pass the bound.
    sender = KVSender(src, StagingTransport(endpoint.address, authkey=authkey), backlog_blocks=12)
    try:
        for rid in (1, 2):
            sender.add(rid, 12 * TPB, epoch=receiver.expect(rid, 12 * TPB))
        returns(lambda: sender.send_chunks([1], [0], [12 * TPB], table(range(12)), table(range(12))))
        assert 12 - RING <= sender.backlogged <= 12
        with pytest.raises(TransferError, match=r"backlog is full \(backlog_blocks=12\)") as caught:
            returns(lambda: sender.send_chunks([2], [0], [12 * TPB], table(range(20, 32)), table(range(20, 32))))
        assert caught.value.request_ids == (2,) and 2 in sender.failures() and 1 not in sender.failures()
        endpoint.resume.set()
        receiver.wait(1, timeout=GUARD)
    finally:
        endpoint.resume.set()
        sender.close()
        endpoint.close()


class _StuckPosts:
    """Wraps a transport's ``post`` so that the first one blocks until ``go`` is set, as a
    send into a socket whose receiver stopped reading does."""

    def __init__(self, transport: Any) -> None:
        self.go = threading.Event()
        self.stuck = threading.Event()
        self._post = transport.post
        transport.post = self.post
        # A socket nobody drains takes nothing now: the executor's own try leaves the post.
        transport.try_post = lambda *args: False

    def post(self, *args: Any) -> None:
        self.stuck.set()
        assert self.go.wait(GUARD), "the test never let the post through"
        self._post(*args)


def test_a_post_stuck_on_the_network_stalls_no_executor_call() -> None:
    """The announcer's post blocks (a receiver that stopped reading its socket): sends,
    polls, a new request, the receiver check and a cancel on that sender all return, as
    they only touch local state; the request completes once the post goes through."""
    shared, receiver, endpoint, transport = shm_pair()
    src = POOLS.random(2)
    stuck = _StuckPosts(transport)
    sender = KVSender(src, transport, timeout=GUARD * 4)
    try:
        e1 = receiver.expect(1, 8 * TPB)
        sender.add(1, 8 * TPB, epoch=e1)
        returns(lambda: sender.send_chunks([1], [0], [4 * TPB], table(range(8)), table(range(8))))
        assert stuck.stuck.wait(GUARD)  # the announcer is in the post now
        returns(lambda: sender.send_chunks([1], [4 * TPB], [8 * TPB], table(range(8)), table(range(8))))
        returns(sender.poll)
        returns(sender.check_peer)
        e2 = receiver.expect(2, 4 * TPB)
        returns(lambda: sender.add(2, 4 * TPB, epoch=e2))
        returns(lambda: sender.cancel(2, timeout=0))
        assert not receiver.is_complete(1)
        stuck.go.set()
        receiver.wait(1, timeout=GUARD)
        assert_landed_once(receiver, src, 8)
        receiver.release(2, timeout=GUARD)  # fenced after the stuck post went
    finally:
        stuck.go.set()
        sender.close()
        endpoint.close()
        del receiver
        shared.close()


def counted_wakes(sender: KVSender) -> list[int]:
    """One entry per time the sender wakes its announcer from now on."""
    wakes: list[int] = []
    wake_set = sender._wake.set

    def counted() -> None:
        wakes.append(1)
        wake_set()

    sender._wake.set = counted  # type: ignore[method-assign]
    return wakes


def quiet_announcer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The announcer looks at the receiver only when woken, not every `PEER_CHECK_SECONDS`:
    a look that holds the sender's lock as a copy ends would leave that copy's post to it."""
    monkeypatch.setattr(sender_module, "PEER_CHECK_SECONDS", 3600.0)


def test_a_steps_poll_with_nothing_new_leaves_the_announcer_asleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the announcer watches a registered request and no write is in flight, an engine
    step's `poll` gives it nothing to do and does not wake it (its pass would take the GIL
    and a core from the engine's step); a write that follows is still posted, by the send
    call or by its copy's completion, without waking it."""
    quiet_announcer(monkeypatch)
    shared, receiver, endpoint, transport = shm_pair()
    src = POOLS.random(4)
    sender = KVSender(src, transport, timeout=GUARD * 4)
    try:
        epoch = receiver.expect(1, 8 * TPB)
        sender.add(1, 8 * TPB, epoch=epoch)
        sender.send_chunks([1], [0], [4 * TPB], table(range(8)), table(range(8)))
        sender.flush(GUARD)  # the announcer posted it, in a pass that saw request 1 registered
        wakes = counted_wakes(sender)
        for _ in range(20):
            assert sender.poll() == []
        assert wakes == []
        names = sends_by_thread(transport)
        sender.send_chunks([1], [4 * TPB], [8 * TPB], table(range(8)), table(range(8)))
        receiver.wait(1, timeout=GUARD)
        assert len(names) == 1 and names[0] in (threading.current_thread().name, "kvferry-copy_0")
        assert wakes == []
        assert_landed_once(receiver, src, 8)
    finally:
        sender.close()
        endpoint.close()
        del receiver
        shared.close()


class DoneAtOnce(CopyEngine):
    """A copy engine whose copies have ended when `submit` returns (a small GPU copy that
    ended while the send call went on)."""

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Any] = (), nbytes: int = 0) -> Pending:
        assert not after
        work()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(None)
        return _FuturePending(done)


def sends_by_thread(transport: Any) -> list[str]:
    """The name of the thread that sent each frame on ``transport``'s connection."""
    names: list[str] = []
    conn = transport._conn
    send, try_send = conn.send, conn.try_send

    def sent(frame: Any) -> None:
        names.append(threading.current_thread().name)  # before: the receiver may act on it at once
        send(frame)

    def tried(frame: Any) -> bool:
        names.append(threading.current_thread().name)  # before, as above; taken back if not sent
        went = try_send(frame)
        if not went:  # sends are serialised (the sender's ``_wire``): the entry is this one
            names.pop()
        return bool(went)

    conn.send, conn.try_send = sent, tried
    return names


def test_a_write_whose_copy_ended_during_the_send_is_posted_by_the_senders_own_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that ended before the send call returned: the calling thread posts its
    notices itself (their frame fits in the connection), without waking the announcer; a
    frame the connection would not take now is left to the announcer, which posts it."""
    quiet_announcer(monkeypatch)
    shared, receiver, endpoint, transport = shm_pair()
    src = POOLS.random(4)
    sender = KVSender(src, transport, engine=DoneAtOnce(), timeout=GUARD * 4)
    try:
        epoch = receiver.expect(1, 8 * TPB)
        sender.add(1, 8 * TPB, epoch=epoch)
        sender.flush(GUARD)  # the announce went, in a pass that saw request 1 registered
        names = sends_by_thread(transport)
        wakes = counted_wakes(sender)
        sender.send_chunks([1], [0], [4 * TPB], table(range(8)), table(range(8)))
        assert names == [threading.current_thread().name]
        assert wakes == []
        # The connection takes nothing now: the announcer posts the next write.
        transport._conn.try_send = lambda frame: False
        sender.send_chunks([1], [4 * TPB], [8 * TPB], table(range(8)), table(range(8)))
        receiver.wait(1, timeout=GUARD)
        assert names == [threading.current_thread().name, "kvferry-sender-progress"]
        assert wakes, "the post left behind woke the announcer"
        assert_landed_once(receiver, src, 8)
    finally:
        sender.close()
        endpoint.close()
        del receiver
        shared.close()


class EndsWhenTold(CopyEngine):
    """A copy engine whose copies end when the test says (`end`), on the thread it calls from."""

    def __init__(self) -> None:
        self.running: list[concurrent.futures.Future[Any]] = []

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Any] = (), nbytes: int = 0) -> Pending:
        assert not after
        work()
        self.running.append(concurrent.futures.Future())
        return _FuturePending(self.running[-1])

    def end(self) -> None:
        """Ends the oldest running copy: its completion callbacks run on this thread."""
        self.running.pop(0).set_result(None)


def test_a_write_whose_copy_ends_after_the_send_is_posted_by_the_copys_completion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy still running when the send call returned: its completion (on the copy
    engine's thread) posts its notices, without waking the announcer; two writes in flight
    are posted in order, each as its copy ends; a copy that ends while the sender's lock is
    held elsewhere is left to the announcer, which it wakes."""
    quiet_announcer(monkeypatch)
    shared, receiver, endpoint, transport = shm_pair()
    src = POOLS.random(4)
    engine = EndsWhenTold()
    sender = KVSender(src, transport, engine=engine, timeout=GUARD * 4)

    def end_on(name: str) -> None:
        thread = threading.Thread(target=engine.end, name=name)
        thread.start()
        thread.join()

    try:
        for rid in (1, 2):
            sender.add(rid, 8 * TPB, epoch=receiver.expect(rid, 8 * TPB))
        sender.flush(GUARD)  # the announces went, in a pass that saw the requests registered
        names = sends_by_thread(transport)
        wakes = counted_wakes(sender)
        sender.send_chunks([1], [0], [8 * TPB], table(range(8)), table(range(8)))
        sender.send_chunks([2], [0], [4 * TPB], table(range(8)), table(range(10, 18)))
        assert names == [] and wakes == []
        end_on("copy-end-1")
        receiver.wait(1, timeout=GUARD)
        assert names == ["copy-end-1"]
        end_on("copy-end-2")
        assert names == ["copy-end-1", "copy-end-2"]
        assert wakes == []
        assert_landed_once(receiver, src, 8)
        assert_exactly_once(receiver.notices(2), 4)
        # The sender's lock held elsewhere (an announcer's pass) as the copy ends: it wakes
        # the announcer, which posts it once the lock is free.
        sender.send_chunks([2], [4 * TPB], [8 * TPB], table(range(8)), table(range(10, 18)))
        with sender._lock:
            end_on("copy-end-3")
            assert wakes
        receiver.wait(2, timeout=GUARD)
        assert names[-1] == "kvferry-sender-progress"
        assert_exactly_once(receiver.notices(2), 8)
    finally:
        sender.close()
        endpoint.close()
        del receiver
        shared.close()


def test_prefill_worker_steps_never_wait_on_a_stalled_decode_endpoint() -> None:
    """`PrefillWorker` driven as vLLM's engine thread drives it, with one decode endpoint
    that frees nothing (a paused staging receiver) and one healthy: bind (the connections
    start off the engine thread), the forward's end (the early send of 16 rings and the
    chunks), results and a preemption of the stalled request all return while the link
    stays stalled; the healthy peer's request completes meanwhile; resumed, the other
    stalled request lands bit exact and the preempted one gets its fence, never completing."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import Chunk, KvferryMetadata, SendSpec
    from kvferry.vllm.prefill_worker import PrefillWorker
    from kvferry.vllm.worker import WorkerCommon

    authkey = secrets.token_bytes(32)
    common = WorkerCommon(ConnectorConfig(transport="staging"), block_size=TPB, num_blocks=SHAPE[0], authkey=authkey)
    src = common.pool = POOLS.random(3)
    worker = PrefillWorker(common)
    stalled_rx, healthy_rx = KVReceiver(POOLS.nan()), KVReceiver(POOLS.nan())
    stalled = PausedStaging(stalled_rx, authkey=authkey, capacity_blocks=RING)
    healthy = StagingEndpoint(healthy_rx, authkey=authkey, capacity_blocks=RING)
    nowhere = "unix:///nonexistent/kvferry-rendezvous.sock"  # abandons fail, logged, off-thread

    def send(rid: str, kv: int, rx: KVReceiver, endpoint: StagingEndpoint, prompt: int, reused: int) -> SendSpec:
        blocks = -(-prompt // TPB)
        dst = list(range(kv * 20, kv * 20 + blocks)) if blocks <= 20 else list(range(10, 10 + blocks))
        dest = {"request_id": kv, "epoch": rx.expect(kv, prompt), "held_blocks": 0, "dst_blocks": dst,
                "endpoint": f"staging+{endpoint.address}"}  # fmt: skip
        return SendSpec(rid, f"T{rid}", prompt, reused, nowhere, dest, 60.0)

    long = PREFIX_BLOCKS * TPB + 3
    a = send("a", 1, stalled_rx, stalled, long, long - 1)  # 16 rings of prefix: preempted below
    b = send("b", 2, healthy_rx, healthy, 6 * TPB, 0)
    c = send("c", 3, stalled_rx, stalled, 4 * TPB, 0)  # behind a on the stalled link
    src_a, src_b, src_c = list(range(PREFIX_BLOCKS + 1)), list(range(70, 76)), list(range(80, 84))
    chunks = [Chunk("a", long - 1, long, [src_a]), Chunk("b", 0, 6 * TPB, [src_b]), Chunk("c", 0, 4 * TPB, [src_c])]
    step = KvferryMetadata(sends=[a, b, c], chunks=chunks)
    try:
        returns(lambda: (worker.preempt(step), worker.bind(step)))
        for future in list(worker._connecting.values()):  # made on background threads
            future.result(GUARD)
        returns(worker.after_forward)  # the connections are up: early sends and chunks issued
        assert stalled.reached.wait(GUARD) and not stalled.resume.is_set()
        healthy_rx.wait(2, timeout=GUARD)
        for got, want in zip(blocks_of(healthy_rx.pool, b.destination["dst_blocks"]), blocks_of(src, src_b)):
            assert torch.equal(got, want)
        assert returns(lambda: worker.results({"b", "c"})) == {"b"}  # c waits on the link

        nxt = KvferryMetadata(preempted=["a"])
        returns(lambda: (worker.preempt(nxt), worker.bind(nxt)))  # revoked: nothing waited for
        returns(worker.after_forward)
        # Retired, not finished: the scheduler half looks it up again and it is sent again.
        assert returns(lambda: worker.results(set())) == set()
        assert not stalled.resume.is_set() and not stalled_rx.is_complete(3)

        stalled.resume.set()  # the link resumes
        stalled_rx.wait(3, timeout=GUARD)
        for got, want in zip(blocks_of(stalled_rx.pool, c.destination["dst_blocks"]), blocks_of(src, src_c)):
            assert torch.equal(got, want)
        assert_exactly_once(stalled_rx.notices(3), 4)
        assert not stalled_rx.is_complete(1) and stalled_rx.release(1, timeout=GUARD) is not None  # fenced
        results: set[str] = set()
        while "c" not in results:  # its last notice was sent: settled at the next results
            results |= returns(lambda: worker.results(set()))
        assert "a" not in results and worker._retired == []  # it left its sender
    finally:
        stalled.resume.set()
        worker.close()
        stalled.close()
        healthy.close()
