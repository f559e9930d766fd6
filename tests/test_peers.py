"""One context worker, many generation workers (kvferry.peers.MultiPeerSender): several
in-process and shared-memory receivers fed by one sender, one step call dispatching the whole
batch to every peer over one shared copy engine, each block bit exact and exactly once at its
own receiver, and a peer that dies failing only its own requests."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import pytest
import torch
from helpers import TRANSFER_POOLS as POOLS
from kvferry.engine import CopyEngine, Pending, ThreadCopyEngine
from kvferry.errors import InvalidArgumentError, TransferError, UnknownRequestError
from kvferry.hook import TransferHook
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.peers import MultiPeerSender
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender, as_table
from kvferry.tiers import Signal
from kvferry.transports import registry
from kvferry.transports.base import Transport
from test_transfer import LAYERS, SHAPE, TPB

# (request id, prompt, reused, peer): every peer gets requests, with and without a prefix.
REQUESTS = [
    (1, 30, 13, "a"),
    (2, 17, 0, "b"),
    (3, 40, 32, "c"),
    (4, 9, 5, "d"),
    (5, 22, 16, "a"),
    (6, 13, 8, "c"),
    (7, 26, 24, "b"),
    (8, 11, 4, "d"),
]


class _CountingEngine(CopyEngine):
    """The shared engine, counting the jobs every peer queued on it."""

    def __init__(self) -> None:
        self.inner = ThreadCopyEngine()
        self.jobs = 0

    def submit_call(self, work: Callable[[], None], *, after: Sequence[Signal] = (), nbytes: int = 0) -> Pending:
        self.jobs += 1
        return self.inner.submit_call(work, after=after, nbytes=nbytes)

    def close(self) -> None:
        self.inner.close()


class _Peers:
    """Receivers "a" and "b" in this process (in-process transport), "c" and "d" behind shm
    endpoints (their pools in shared segments, notices over their sockets)."""

    def __init__(self, names: Sequence[str] = ("a", "b", "c", "d"), shm: Sequence[str] = ("c", "d")) -> None:
        self.authkey = secrets.token_bytes(32)
        self.receivers: dict[str, KVReceiver] = {}
        self.transports: dict[Hashable, Transport] = {}
        self.served: dict[str, Any] = {}
        self.pools: list[Any] = []
        for name in names:
            kind = "shm" if name in shm else "in-process"
            if kind == "shm":
                pool = registry.receiver_pool(
                    "shm", num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB
                )
                self.pools.append(pool)
                receiver = KVReceiver(pool.pool)
                served = registry.serve("shm", receiver, authkey=self.authkey, shared=pool.shared)
                self.served[name] = served
                self.transports[name] = registry.connect(served.url, authkey=self.authkey)
            else:
                receiver = KVReceiver(POOLS.nan())
                self.transports[name] = registry.connect("in-process", receiver=receiver)
            self.receivers[name] = receiver

    def close(self) -> None:
        for served in self.served.values():
            served.close()
        self.receivers.clear()
        for pool in self.pools:
            pool.close()


def _tables(seed: int, requests: Sequence[tuple[int, int, int, str]]) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random source blocks; destination blocks disjoint within each peer's pool."""
    rng = np.random.default_rng(seed)
    widths = [-(-p // TPB) for _, p, _, _ in requests]
    src = rng.permutation(SHAPE[0])
    dst = {peer: list(rng.permutation(SHAPE[0])) for *_, peer in requests}
    rows_s, rows_d, at = [], [], 0
    for (_, _, _, peer), w in zip(requests, widths):
        rows_s.append(src[at : at + w])
        rows_d.append(np.array([dst[peer].pop() for _ in range(w)]))
        at += w
    return as_table(rows_s, max(widths)), as_table(rows_d, max(widths))


def _digest(pool: PagedKV, row: np.ndarray, prompt: int) -> str:
    h = hashlib.sha256()
    ids = torch.from_numpy(row[: -(-prompt // TPB)])
    for layer in pool.layers:
        h.update(layer.index_select(0, ids).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _expect_all(peers: _Peers, requests: Sequence[tuple[int, int, int, str]]) -> None:
    for rid, prompt, _, peer in requests:
        peers.receivers[peer].expect(rid, prompt)


def _start(
    peers: _Peers, sender: MultiPeerSender, requests: Sequence[tuple[int, int, int, str]], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Notice]]:
    """Leases every request at its peer, adds it to the sender and sends the early blocks of all
    of them in one step call; returns the block tables, the ids and the early notices."""
    _expect_all(peers, requests)
    for rid, prompt, reused, peer in requests:
        sender.add(rid, prompt, reused_len=reused, peer=peer)
    src, dst = _tables(seed, requests)
    ids = np.array([r for r, *_ in requests])
    return src, dst, ids, sender.send_early(ids, src, dst)


def _chunks(
    sender: MultiPeerSender,
    requests: Sequence[tuple[int, int, int, str]],
    src: np.ndarray,
    dst: np.ndarray,
    chunk: int = 8,
) -> list[Notice]:
    """Chunk after chunk, each step one `send_chunks` call over the whole live batch."""
    pos = {rid: reused for rid, _, reused, _ in requests}
    sent: list[Notice] = []
    while True:
        live = [i for i, (rid, prompt, _, _) in enumerate(requests) if pos[rid] < prompt]
        if not live:
            return sent
        ids = np.array([requests[i][0] for i in live])
        starts = np.array([pos[requests[i][0]] for i in live])
        ends = np.array([min(pos[requests[i][0]] + chunk, requests[i][1]) for i in live])
        sent += sender.send_chunks(ids, starts, ends, src[live], dst[live])
        for i, e in zip(live, ends):
            pos[requests[i][0]] = int(e)
        sender.poll()


def _check_arrived(
    peers: _Peers, src_pool: PagedKV, requests: Sequence[tuple[int, int, int, str]], src: np.ndarray, dst: np.ndarray
) -> None:
    """Each request complete at its own receiver, bit exact, every block in exactly one
    notice there, and no notice of it anywhere else."""
    for i, (rid, prompt, _, peer) in enumerate(requests):
        receiver = peers.receivers[peer]
        receiver.wait(rid, timeout=60)
        assert _digest(receiver.pool, dst[i], prompt) == _digest(src_pool, src[i], prompt), f"request {rid} at {peer}"
        seen = np.zeros(-(-prompt // TPB), dtype=np.int64)
        for n in receiver.notices(rid):
            seen[n.start : n.end] += 1
        assert (seen == 1).all(), f"request {rid} at {peer}: block arrivals {seen.tolist()}"
        for other, r in peers.receivers.items():
            if other != peer:
                with pytest.raises(UnknownRequestError):
                    r.notices(rid)


def test_one_step_call_dispatches_to_every_peer_bit_exact_and_exactly_once() -> None:
    peers = _Peers()
    engine = _CountingEngine()
    src_pool = POOLS.random(21)
    sender = MultiPeerSender(src_pool, peers.transports, engine=engine)
    try:
        src, dst, ids, early = _start(peers, sender, REQUESTS, seed=22)
        # One call planned and queued the early blocks of every peer's requests, on one engine.
        # A write meeting a peer's announcer on its wire waits in that peer's backlog (the call
        # never waits), so the jobs are counted once every queued write was handed over.
        assert {sender.peer_of(n.request_id) for n in early} == {"a", "b", "c", "d"}
        sender.flush(timeout=60)
        assert engine.jobs == 4
        assert all(s.engine._engine is engine for s in sender.peers.values())  # type: ignore[attr-defined]
        sent = early + _chunks(sender, REQUESTS, src, dst)
        sender.flush(timeout=60)
        _check_arrived(peers, src_pool, REQUESTS, src, dst)
        # What the calls returned is what the receivers got: every notice, once.
        key = lambda n: (n.request_id, n.slice_id)  # noqa: E731
        assert sorted(sent, key=key) == sorted(
            (n for rid, *_, p in REQUESTS for n in peers.receivers[p].notices(rid)), key=key
        )
        for rid, *_ in REQUESTS:
            sender.remove(rid)
            assert not sender.leased(rid)
    finally:
        sender.close()
        peers.close()


def test_a_closed_peer_fails_only_its_own_requests() -> None:
    peers = _Peers(names=("a", "b", "c"), shm=("b", "c"))
    requests = [r for r in REQUESTS if r[3] in ("a", "b", "c")]
    src_pool = POOLS.random(31)
    sender = MultiPeerSender(src_pool, peers.transports)
    try:
        src, dst, ids, _ = _start(peers, sender, requests, seed=32)
        sender.flush(timeout=60)
        # Peer "b"'s generation worker goes away before the chunks are sent.
        peers.served.pop("b").close()
        b_ids = sorted(r for r, *_, p in requests if p == "b")
        with pytest.raises(TransferError) as lost:
            sender.send_chunks(ids, np.array([r[2] for r in requests]), np.array([r[1] for r in requests]), src, dst)
        assert sorted(lost.value.request_ids) == b_ids
        assert sorted(sender.failures()) == b_ids
        sender.flush(timeout=60)
        others = [(i, r) for i, r in enumerate(requests) if r[3] != "b"]
        rows = [i for i, _ in others]
        _check_arrived(peers, src_pool, [r for _, r in others], src[rows], dst[rows])
        # The dead peer's requests are refused again, the live peers' keep working.
        with pytest.raises(TransferError):
            sender.send_early(
                np.array(b_ids),
                src[[i for i, r in enumerate(requests) if r[3] == "b"]],
                dst[[i for i, r in enumerate(requests) if r[3] == "b"]],
            )
        for rid, *_ in requests:
            sender.remove(rid)  # acknowledges the failures, forgets the completed requests
        assert not sender.failures()
    finally:
        sender.close()
        peers.close()


def test_hook_routes_each_request_to_its_peer() -> None:
    peers = _Peers(names=("a", "c"), shm=("c",))
    requests = [r for r in REQUESTS if r[3] in ("a", "c")]
    src_pool = POOLS.random(41)
    hook = TransferHook(MultiPeerSender(src_pool, peers.transports))
    try:
        _expect_all(peers, requests)
        src, dst = _tables(42, requests)
        widths = [-(-p // TPB) for _, p, _, _ in requests]
        for i, (rid, prompt, reused, peer) in enumerate(requests):
            hook.add_request(
                rid,
                prompt,
                reused_len=reused,
                src_blocks=src[i, : widths[i]],
                dst_blocks=dst[i, : widths[i]],
                peer=peer,
            )
        ids = [r for r, *_ in requests]
        hook.before_forward(ids)
        hook.after_forward(ids, [r[2] for r in requests], [r[1] for r in requests])
        for rid in ids:
            hook.finish(rid, timeout=60)
        _check_arrived(peers, src_pool, requests, src, dst)
    finally:
        hook.sender.close()
        peers.close()


def test_bad_peer_arguments_are_refused_by_name() -> None:
    peers = _Peers(names=("a",), shm=())
    sender = MultiPeerSender(POOLS.random(51), peers.transports)
    try:
        with pytest.raises(InvalidArgumentError, match=r"invalid peer='z': not one of this sender's peers \('a'\)"):
            sender.add(1, 8, peer="z")
        sender.add(1, 8, peer="a")
        with pytest.raises(InvalidArgumentError, match=r"invalid request_id=1: already registered for peer 'a'"):
            sender.add(1, 8, peer="a")
        with pytest.raises(UnknownRequestError, match=r"unknown request_id=2"):
            sender.send_early(np.array([1, 2]), np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64))
        with pytest.raises(
            InvalidArgumentError, match=r"invalid dst_block_table=<1 rows>: must hold one per request \(2\)"
        ):
            sender.send_early(np.array([1, 1]), np.zeros((2, 2), dtype=np.int64), np.zeros((1, 2), dtype=np.int64))
        with pytest.raises(InvalidArgumentError, match=r"invalid transports=\{\}"):
            MultiPeerSender(POOLS.random(52), {})
    finally:
        sender.close()
        peers.close()
    single = KVSender(POOLS.random(53), registry.connect("in-process", receiver=KVReceiver(POOLS.nan())))
    with pytest.raises(InvalidArgumentError, match=r"invalid peer='a': this hook's KVSender has one receiver"):
        TransferHook(single).add_request(1, 8, reused_len=0, src_blocks=[0, 1], dst_blocks=[0, 1], peer="a")
    single.close()


def _shm_receiver_process(conn: Any, authkey: bytes, requests: list[tuple[int, int]]) -> None:
    """A generation worker in its own process (killed by the test)."""
    pool = registry.receiver_pool("shm", num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    receiver = KVReceiver(pool.pool)
    served = registry.serve("shm", receiver, authkey=authkey, shared=pool.shared)
    for rid, prompt in requests:
        receiver.expect(rid, prompt)
    conn.send(served.url)
    conn.recv()  # never comes: the test kills this process


def test_a_killed_peer_process_fails_only_its_own_requests() -> None:
    import multiprocessing as mp

    peers = _Peers(names=("a", "c"), shm=("c",))
    requests = [r for r in REQUESTS if r[3] in ("a", "b", "c")]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_shm_receiver_process,
        args=(child, peers.authkey, [(r, p) for r, p, _, peer in requests if peer == "b"]),
        daemon=True,
    )
    proc.start()
    src_pool = POOLS.random(61)
    try:
        peers.transports["b"] = registry.connect(parent.recv(), authkey=peers.authkey)
        sender = MultiPeerSender(src_pool, peers.transports)
        _expect_all(peers, [r for r in requests if r[3] != "b"])
        for rid, prompt, reused, peer in requests:
            sender.add(rid, prompt, reused_len=reused, peer=peer)
        src, dst = _tables(62, requests)
        ids = np.array([r for r, *_ in requests])
        sender.send_early(ids, src, dst)
        sender.flush(timeout=60)
        proc.kill()  # peer "b"'s process dies; join reaps it, so its socket is closed
        proc.join(timeout=30)
        b_ids = sorted(r for r, *_, p in requests if p == "b")
        with pytest.raises(TransferError) as lost:
            sender.send_chunks(ids, np.array([r[2] for r in requests]), np.array([r[1] for r in requests]), src, dst)
        assert sorted(lost.value.request_ids) == b_ids
        sender.flush(timeout=60)
        rows = [i for i, r in enumerate(requests) if r[3] != "b"]
        _check_arrived(peers, src_pool, [requests[i] for i in rows], src[rows], dst[rows])
        for rid, *_ in requests:
            sender.remove(rid)
            assert not sender.leased(rid)
        sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
        peers.close()
