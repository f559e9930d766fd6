"""The prefill worker's small writes (kvferry.vllm.prefill_worker): the sends of one scheduler
step that go to one decode server leave as one hook call per peer, and so as one
transport write (and one posted notice batch) per peer, not one per request. A request
whose own send is refused in such a batch fails alone; the others' blocks arrive.

CPU only, no vLLM: the worker drives real `KVSender`s over in-process transports that count
what they are handed.

    PYTHONPATH=python .venv/bin/python -m pytest tests/test_prefill_batch.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import pytest
import torch

TPB = 4
BLOCKS = 8  # each request's prompt: 8 blocks, the turn's new KV
REUSED = 2 * TPB  # a cached prefix of 2 blocks: the early send


def _counting(receiver: Any) -> Any:
    from kvferry.transports.inprocess import InProcessTransport

    class Counting(InProcessTransport):
        def __init__(self, receiver: Any) -> None:
            super().__init__(receiver)
            self.writes: list[list[int]] = []  # request ids each write carried
            self.posts = 0
            self.room: Optional[int] = None  # writes it has room for (None: any number)

        def write(self, engine: Any, job: Any) -> Any:
            from kvferry.transports.base import TransportFull

            if self.room is not None:
                if not self.room:
                    raise TransportFull()
                self.room -= 1
            self.writes.append(sorted({n.request_id for n in job.notices}))
            return super().write(engine, job)

        def post(self, batch: Any, revoked: Any = frozenset()) -> None:
            self.posts += 1
            super().post(batch, revoked)

    return Counting(receiver)


@dataclass
class Rig:
    """A prefill worker with one live peer per address (``p0``, ``p1``, ...), each a sender
    over a counting in-process transport into its own receiver."""

    worker: Any
    peers: dict[str, Any]
    receivers: dict[str, Any]
    transports: dict[str, Any]
    expected: dict[str, tuple[str, int]] = field(default_factory=dict)  # req -> (address, kv)

    def send(self, rid: str, address: str, kv: int, reused: int = REUSED) -> Any:
        """The `SendSpec` of a request of ``BLOCKS`` blocks into ``address``'s receiver."""
        from kvferry.vllm.metadata import SendSpec

        receiver = self.receivers[address]
        epoch = receiver.expect(kv, BLOCKS * TPB)
        dst = list(range(kv * BLOCKS, (kv + 1) * BLOCKS))
        dest = {"request_id": kv, "held_blocks": 0, "epoch": epoch, "endpoint": address, "dst_blocks": dst}
        self.expected[rid] = (address, kv)
        return SendSpec(rid, f"T{rid}", BLOCKS * TPB, reused, "rdv", dest, 60.0)

    def table(self, kv: int) -> list[list[int]]:
        return [list(range(kv * BLOCKS, (kv + 1) * BLOCKS))]

    def arrived(self, rid: str) -> bool:
        address, kv = self.expected[rid]
        return self.receivers[address].is_complete(kv)

    def flush(self) -> None:
        for peer in self.peers.values():
            peer.sender.flush(30)


@pytest.fixture
def rig() -> Iterator[Any]:
    made: list[Rig] = []

    def make(
        addresses: tuple[str, ...] = ("p0",),
        requests: int = 32,
        layer_groups: int = 1,
        device: str = "cpu",
        **options: Any,
    ) -> Rig:
        from kvferry.hook import TransferHook
        from kvferry.layout import PagedKV
        from kvferry.receiver import KVReceiver
        from kvferry.sender import KVSender
        from kvferry.vllm.config import ConnectorConfig
        from kvferry.vllm.prefill_worker import PrefillWorker, _Peer
        from kvferry.vllm.worker import WorkerCommon

        blocks = requests * BLOCKS
        config = ConnectorConfig(layer_groups=layer_groups)
        common = WorkerCommon(config, block_size=TPB, num_blocks=blocks, authkey=b"k" * 32)
        layers = layer_groups  # one layer per group
        common.pool = PagedKV(tuple(torch.randn(blocks, 2, TPB, 8, device=device) for _ in range(layers)), TPB)
        common.layer_of = {f"layers.{i}": i for i in range(layers)}
        worker = PrefillWorker(common)
        r = Rig(worker, {}, {}, {})
        for address in addresses:
            receiver = KVReceiver(
                PagedKV(tuple(torch.full((blocks, 2, TPB, 8), float("nan"), device=device) for _ in range(layers)), TPB)
            )
            transport = _counting(receiver)
            # progress=False: every write is handed over on this thread, so the counts are
            # the step's own, with no announcer to race.
            sender = KVSender(common.pool, transport, record=True, progress=False, layer_groups=layer_groups, **options)
            worker._peers[address] = _Peer(address, sender, TransferHook(sender), common.pool)
            r.peers[address], r.receivers[address], r.transports[address] = worker._peers[address], receiver, transport
        made.append(r)
        return r

    yield make
    for r in made:
        r.worker.close()


def _step(r: Rig, sends: list[Any], chunks: list[tuple[str, int, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """One engine step: bind (new sends, their early writes), the forward, after_forward.
    Returns the writes each peer's transport was handed in bind and in after_forward."""
    from kvferry.vllm.metadata import Chunk, KvferryMetadata

    meta = KvferryMetadata(sends=sends, chunks=[Chunk(rid, s, e, r.table(r.expected[rid][1])) for rid, s, e in chunks])
    before = {a: len(t.writes) for a, t in r.transports.items()}
    r.worker.bind(meta)
    bound = {a: len(t.writes) for a, t in r.transports.items()}
    r.worker.after_forward()
    after = {a: len(t.writes) for a, t in r.transports.items()}
    return {a: bound[a] - before[a] for a in before}, {a: after[a] - bound[a] for a in before}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n", [1, 8, 32])
def test_one_steps_sends_to_one_peer_are_one_write(rig: Any, n: int, device: str) -> None:
    """N requests added in one step, each with a 2-block cached prefix and its last chunk
    ending in that step, all to one decode server: the early prefixes leave before the
    forward as one write, the chunks after it as one write, and each write's notices as one
    post (it was N writes and N posts each before). Every block arrives, byte for byte (the
    receiver's pool poisoned first; on CUDA too, the copies queued on the copy stream)."""
    r = rig(requests=n, device=device)
    sends = [r.send(f"r{i}", "p0", i) for i in range(n)]
    early, chunks = _step(r, sends, [(f"r{i}", REUSED, BLOCKS * TPB) for i in range(n)])
    assert early == {"p0": 1} and chunks == {"p0": 1}
    writes = r.transports["p0"].writes
    assert writes == [list(range(n)), list(range(n))]
    r.flush()
    r.worker.after_forward()  # the next step's poll
    assert r.transports["p0"].posts == 2
    assert all(r.arrived(f"r{i}") for i in range(n))
    src, dst = r.worker.pool.layers[0], r.receivers["p0"].pool.layers[0]
    assert torch.equal(src[: n * BLOCKS], dst[: n * BLOCKS])


def test_each_peer_gets_one_write_and_a_request_two_chunks_in_order(rig: Any) -> None:
    """Requests to two decode servers: one write per server per step. A request whose
    sends waited (its connection was being made) and whose two chunks are queued sends its
    early prefix, then its first chunk, then its second, in order, beside another request's
    one chunk: one write per round of chunks, the early one first."""

    r = rig(("p0", "p1"), requests=6)
    sends = [r.send(f"a{i}", "p0", i) for i in range(3)] + [r.send(f"b{i}", "p1", i + 3) for i in range(3)]
    chunks = [(f"a{i}", REUSED, BLOCKS * TPB) for i in range(3)] + [(f"b{i}", REUSED, BLOCKS * TPB) for i in range(3)]
    early, after = _step(r, sends, chunks)
    assert early == {"p0": 1, "p1": 1} and after == {"p0": 1, "p1": 1}
    r.flush()
    r.worker.after_forward()
    assert all(r.arrived(rid) for rid in r.expected)

    # On another worker: "q" waits for its connection through two steps, so two chunks
    # queue up; once it is up they leave in order after its early prefix, in the step
    # that adds "s" (whose early prefix leaves with q's).
    from concurrent.futures import Future

    r2 = rig(("p0",), requests=2)
    worker, peer = r2.worker, r2.peers["p0"]
    connection: Future[Any] = Future()
    worker._connecting["p0"] = connection
    del worker._peers["p0"]
    q, s = r2.send("q", "p0", 0), r2.send("s", "p0", 1)
    step = lambda sends, chunks: _step(r2, sends, chunks)  # noqa: E731
    assert step([q], [("q", REUSED, 3 * TPB)]) == ({"p0": 0}, {"p0": 0})
    assert step([], [("q", 3 * TPB, 5 * TPB)]) == ({"p0": 0}, {"p0": 0})
    connection.set_result(peer)
    assert step([s], [("q", 5 * TPB, BLOCKS * TPB), ("s", REUSED, BLOCKS * TPB)]) == ({"p0": 3}, {"p0": 1})
    assert r2.transports["p0"].writes == [[0, 1], [0], [0], [0, 1]]
    r2.flush()
    worker.after_forward()
    assert [(n.start, n.end) for n in r2.receivers["p0"].notices(0)] == [(0, 2), (2, 3), (3, 5), (5, 8)]
    assert r2.arrived("q") and r2.arrived("s")


@pytest.mark.parametrize("how", ["bad_chunk", "cancelled_by_receiver"])
def test_a_request_refused_in_a_batch_fails_alone(rig: Any, how: str) -> None:
    """Three requests' chunks leave in one step to one peer; the middle one's send is
    refused (its chunk runs past its prompt, or its receiver gave up on it since the last
    step): it fails, alone, and the other two arrive, byte for byte."""
    r = rig(requests=3)
    sends = [r.send(f"r{i}", "p0", i, reused=0) for i in range(3)]
    from kvferry.vllm.metadata import KvferryMetadata

    r.worker.bind(KvferryMetadata(sends=sends))
    if how == "cancelled_by_receiver":
        r.receivers["p0"].cancel(1)
    end = {0: BLOCKS * TPB, 1: BLOCKS * TPB + (TPB if how == "bad_chunk" else 0), 2: BLOCKS * TPB}
    _step(r, [], [(f"r{i}", 0, end[i]) for i in range(3)])
    r.flush()
    r.worker.after_forward()
    failed = {st.spec.req_id for st in r.worker._send.values() if st.error is not None}
    assert failed == {"r1"}
    assert r.arrived("r0") and r.arrived("r2") and not r.arrived("r1")
    src, dst = r.worker.pool.layers[0], r.receivers["p0"].pool.layers[0]
    for kv in (0, 2):
        assert torch.equal(src[kv * BLOCKS : (kv + 1) * BLOCKS], dst[kv * BLOCKS : (kv + 1) * BLOCKS])
    assert torch.isnan(dst[BLOCKS : 2 * BLOCKS]).all()
    assert r.worker.results({"r0", "r1", "r2"}) == {"r0", "r1", "r2"}
    counts = r.worker.tally.take()["counts"]
    assert counts["chunk_bytes"] == 2 * BLOCKS * r.worker.pool.block_bytes and counts["failed_transfers"] == 1


def test_a_batch_whose_write_finds_no_room_fails_only_the_unwritten_requests(rig: Any) -> None:
    """Three requests' chunks in one call, cut into one write per request (a transport that
    takes 8 blocks a write) with room for one write, and a sender that keeps no backlog: the
    second and third requests fail (claimed, never written), as they did sent one by one; the
    first, whose write was queued, arrives and is not sent again."""
    r = rig(requests=3, backlog_blocks=0)
    transport = r.transports["p0"]
    transport.max_write_blocks = BLOCKS
    transport.room = 1
    sends = [r.send(f"r{i}", "p0", i, reused=0) for i in range(3)]
    _step(r, sends, [(f"r{i}", 0, BLOCKS * TPB) for i in range(3)])
    assert transport.writes == [[0]]
    r.flush()
    r.worker.after_forward()
    failed = {st.spec.req_id: st.error for st in r.worker._send.values() if st.error is not None}
    assert set(failed) == {"r1", "r2"} and all("claimed, never written" in e for e in failed.values())
    assert r.arrived("r0") and not r.arrived("r1") and not r.arrived("r2")
    assert r.worker.results({"r0", "r1", "r2"}) == {"r0", "r1", "r2"}


def test_layer_wise_streaming_sends_one_write_per_group_per_peer(rig: Any) -> None:
    """Layer-wise streaming (two layer groups): four requests whose last chunk runs this
    step send each group's layers in one write as the group's last layer is saved (it was
    one per request), and nothing is left for after the forward; every layer arrives."""
    from kvferry.vllm.metadata import Chunk, KvferryMetadata

    r = rig(requests=4, layer_groups=2)
    sends = [r.send(f"r{i}", "p0", i, reused=0) for i in range(4)]
    meta = KvferryMetadata(sends=sends, chunks=[Chunk(f"r{i}", 0, BLOCKS * TPB, r.table(i)) for i in range(4)])
    r.worker.bind(meta)
    writes = r.transports["p0"].writes
    r.worker.save_layer("layers.0")
    assert writes == [[0, 1, 2, 3]]
    r.worker.save_layer("layers.1")
    assert writes == [[0, 1, 2, 3]] * 2
    r.worker.after_forward()
    assert len(writes) == 2
    r.flush()
    r.worker.after_forward()
    assert all(r.arrived(f"r{i}") for i in range(4))
    for layer in range(2):
        assert torch.equal(r.worker.pool.layers[layer], r.receivers["p0"].pool.layers[layer])
