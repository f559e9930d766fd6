"""The connector's own cost per engine step (issue 22, part 2) and what its metrics count (part
4): CPU-level, no vLLM server. Each step-cost test counts the work a step does (items read,
receiver waits, failure scans), so it fails on code that walks every request each step;
benches/python/bench_connector.py times the same hooks.

Run in the vLLM venv:
    PYTHONPATH=python .venv-vllm/bin/python -m pytest tests/test_vllm_step.py -q
"""

from __future__ import annotations

import hashlib
import importlib.util
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not importable: run in the vLLM venv, see docs/vllm.md")

TPB = 16


def _digest_token_by_token(token_ids: list[int]) -> str:
    """The digest as it was computed before (one Python call per token): the value must not change."""
    h = hashlib.sha256()
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:32]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300))
def test_prompt_digest_is_unchanged(token_ids: list[int]) -> None:
    from kvferry.vllm.config import prompt_digest

    assert prompt_digest(token_ids) == _digest_token_by_token(token_ids)


@pytest.mark.parametrize("bad", [[1, 2**63], [1, "2"], [0.5]])
def test_prompt_digest_names_a_bad_token_id(bad: list[Any]) -> None:
    from kvferry.errors import InvalidArgumentError
    from kvferry.vllm.config import prompt_digest

    with pytest.raises(InvalidArgumentError, match=rf"invalid token_ids=<{len(bad)} ids>"):
        prompt_digest(bad)


class _Counted(list):  # type: ignore[type-arg]
    """A list that counts the items read through iteration or indexing."""

    reads = 0

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            _Counted.reads += 1
            yield item

    def __getitem__(self, i: Any) -> Any:
        _Counted.reads += 1
        return super().__getitem__(i)


def _lookup(transfer: str) -> Any:
    """The ended lookup a hand-made send came from (a preempted send looks it up again)."""
    import threading

    from kvferry.vllm.scheduler import _Lookup

    return _Lookup(threading.Event(), transfer, None, None, 0.0)


def test_build_connector_meta_reads_only_the_sends() -> None:
    """A prefill server running 100 plain requests and one send: each step's metadata holds
    the send's chunk, starting where the last one ended, and reads none of the plain
    requests' entries (it read all of them before, each step); a resumed send's start is
    the one vLLM lists."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import SendSpec
    from kvferry.vllm.scheduler import SchedulerSide, _Sending
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    tables_read: list[str] = []

    def get_block_ids(rid: str) -> tuple[list[int]]:
        tables_read.append(rid)
        return (list(range(7, 20)),)

    side = SchedulerSide(ConnectorConfig(), block_size=TPB, role="kv_producer", engine_id="E",
                         kv_cache_manager_getter=lambda: SimpleNamespace(get_block_ids=get_block_ids),
                         authkey=b"k" * 32)  # fmt: skip
    side._sending["S"] = _Sending(SendSpec("S", "T", 200, 0, "unix:///p", {}, 60.0), _lookup("T"))
    plain = [f"r{i}" for i in range(100)]

    def step(new: list[Any], cached_ids: list[str], computed: list[int], resumed: frozenset[str] = frozenset()) -> Any:
        cached = CachedRequestData(
            req_ids=_Counted(cached_ids), resumed_req_ids=set(resumed), new_token_ids=[], all_token_ids={},
            new_block_ids=[], num_computed_tokens=_Counted(computed), num_output_tokens=[],
        )  # fmt: skip
        scheduled = {rid: 1 for rid in plain} | {"S": 64}
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs, out.scheduled_cached_reqs, out.num_scheduled_tokens = new, cached, scheduled
        _Counted.reads = 0
        tables_read.clear()
        return side.build_connector_meta(out)

    # The step that emits a send with a hit reads each scheduled request's start once, and
    # the table of those that fill a block (none of the plain ones: 100 -> 101 tokens).
    first = step([SimpleNamespace(req_id="S", num_computed_tokens=32)], plain, [100] * 100)
    assert [(s.req_id, s.reused_len, s.early) for s in first.sends] == [("S", 32, True)]
    assert [(c.start, c.end) for c in first.chunks] == [(32, 96)]
    assert _Counted.reads == 200 and set(tables_read) == {"S"}
    second = step([], [*plain, "S"], [101] * 100 + [96])
    assert not second.sends and [(c.start, c.end) for c in second.chunks] == [(96, 160)]
    assert _Counted.reads == 0 and tables_read == ["S"]
    resumed = step([], [*plain, "S"], [102] * 100 + [16], frozenset({"S"}))
    assert [(c.start, c.end) for c in resumed.chunks] == [(16, 80)]


def test_a_hit_that_this_step_fills_leaves_after_the_forward() -> None:
    """vLLM caches a block when it schedules the tokens that fill it: a send scheduled after
    another request's chunk in the same step can hit blocks that chunk's forward has yet to
    write. Its early send is withheld (``early`` False) when any hit block is one the step
    fills; a hit filled in an earlier step (or a block this step only starts) leaves early."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import SendSpec
    from kvferry.vllm.scheduler import SchedulerSide, _Sending
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    tables = {"A": [10, 11, 12, 13, 14], "B": [10, 11, 12, 13, 20], "C": [10, 11, 30], "D": [40, 41, 42]}
    side = SchedulerSide(ConnectorConfig(), block_size=TPB, role="kv_producer", engine_id="E",
                         kv_cache_manager_getter=lambda: SimpleNamespace(get_block_ids=lambda rid: (tables[rid],)),
                         authkey=b"k" * 32)  # fmt: skip
    for rid in ("B", "C"):
        side._sending[rid] = _Sending(SendSpec(rid, "T" + rid, 80, 0, "unix:///p", {}, 60.0), _lookup("T" + rid))
    # A computes [32, 72) this step: it fills blocks 2 and 3 (ids 12, 13) and starts block 4.
    # D decodes its 33rd token: it fills nothing. B hits blocks 0-3, C blocks 0-1.
    cached = CachedRequestData(
        req_ids=["A", "D"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[], num_computed_tokens=[32, 32], num_output_tokens=[],
    )  # fmt: skip
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = cached
    out.scheduled_new_reqs = [SimpleNamespace(req_id="B", num_computed_tokens=64),
                              SimpleNamespace(req_id="C", num_computed_tokens=32)]  # fmt: skip
    out.num_scheduled_tokens = {"A": 40, "D": 1, "B": 16, "C": 48}
    meta = side.build_connector_meta(out)
    assert {s.req_id: (s.reused_len, s.early) for s in meta.sends} == {"B": (64, False), "C": (32, True)}


def _pool(blocks: int) -> Any:
    import torch
    from kvferry.layout import PagedKV

    return PagedKV((torch.zeros(blocks, 2, TPB, 8),), TPB)


def test_receiver_reports_each_settled_request() -> None:
    """`take_settled`: the requests that completed or failed since the last call (a request
    whose awaited blocks arrived with another's transfer too), none twice, none released."""
    from kvferry import BlockRange
    from kvferry.errors import TransferError
    from kvferry.notice import Notice
    from kvferry.receiver import KVReceiver

    receiver = KVReceiver(_pool(16))
    epochs = {rid: receiver.expect(rid, 2 * TPB) for rid in (1, 2, 3)}
    held = receiver.expect(4, TPB, held=[BlockRange(0, 1)])  # all held: complete at once
    assert receiver.take_settled() == {4} and receiver.take_settled() == set()
    receiver.deliver(Notice(1, 0, 0, 1, False, epochs[1]))
    assert receiver.take_settled() == set()  # half arrived: nothing to report
    receiver.deliver(Notice(1, 1, 1, 2, True, epochs[1]))
    receiver.fail(2, TransferError("lost"))
    assert receiver.take_settled() == {1, 2} and receiver.take_settled() == set()
    receiver.deliver(Notice(3, 0, 0, 2, True, epochs[3]))
    receiver.release(3, 0)
    assert receiver.take_settled() == set()  # released before it was taken
    owner = receiver.expect(5, 2 * TPB)
    receiver.expect(6, 2 * TPB, awaits=[(5, BlockRange(0, 2))])
    receiver.deliver(Notice(5, 0, 0, 2, True, owner))
    assert receiver.take_settled() == {5, 6}
    receiver.wait(6, 0)
    assert held


@pytest.fixture
def decode(tmp_path: Any) -> Iterator[Any]:
    from helpers import decode_worker

    with decode_worker(str(tmp_path), num_blocks=32, block_size=TPB) as worker:
        yield worker


def _expect(worker: Any, n: int, prefix: str = "r") -> list[Any]:
    from kvferry.vllm.metadata import KvferryMetadata, RecvSpec

    specs = [RecvSpec(f"{prefix}{i}", 100 + i, f"T{prefix}{i}", 2 * TPB, [[2 * i, 2 * i + 1]], 0, "d", 60.0)
             for i in range(n)]  # fmt: skip
    worker.bind(KvferryMetadata(recvs=specs))
    return specs


def test_decode_results_wait_only_on_requests_that_changed(decode: Any) -> None:
    """A decode step with 8 requests waiting for their KV, none arrived, makes no receiver
    wait (it made one per waiting request each step before); one that arrived, one whose
    prefill side abandoned it and one aborted are each reported in the step after."""
    from kvferry.notice import Notice

    specs = _expect(decode, 8)
    waits: list[int] = []
    real_wait = decode.receiver.wait

    def counted_wait(kv: int, timeout: Any = None) -> float:
        waits.append(kv)
        return real_wait(kv, timeout)

    decode.receiver.wait = counted_wait
    assert decode.results(set()) == (set(), set()) and waits == []
    epoch = decode.receiver.epoch(specs[0].kv_id)
    decode.receiver.deliver(Notice(specs[0].kv_id, 0, 0, 2, True, epoch))
    decode.rendezvous._abandon(specs[1].transfer, "the prefill request was aborted")
    arrived, failed = decode.results({specs[2].req_id})
    assert waits == [specs[0].kv_id]
    assert arrived == {specs[0].req_id, specs[1].req_id, specs[2].req_id} and failed == {specs[1].req_id}
    assert decode.results(set()) == (set(), set()) and set(decode._recv) == {s.req_id for s in specs[3:]}


def test_a_transfer_given_up_before_its_request_came_is_reported_to_the_scheduler_half(decode: Any) -> None:
    """The prefill side abandons a transfer this decode worker holds no request of (one
    name plain, one a tensor-parallel rank's leg), and one it holds: the step's worker
    metadata names the first two as given up, by their transfer ids, once; the held one
    is failed as before, and not reported as given up."""
    from kvferry.vllm.metadata import leg_name

    (spec,) = _expect(decode, 1)
    decode.rendezvous._abandon("Tnobody", "no destination within its 60 s wait")
    decode.rendezvous._abandon(leg_name("Tlegs", 1, 2), "prefill request ended")
    decode.rendezvous._abandon(spec.transfer, "the prefill request was aborted")
    arrived, failed = decode.results(set())
    assert failed == {spec.req_id}
    meta = decode.common.outcomes()
    assert meta is not None and sorted(meta.given_up) == ["Tlegs", "Tnobody"]
    assert decode.results(set()) == (set(), set())
    again = decode.common.outcomes()
    assert again is None or again.given_up == []


def test_a_decode_step_does_not_wait_for_an_endpoint_being_made(decode: Any) -> None:
    """A lookup making a prefill engine's endpoint holds the endpoints' lock (with NIXL, for
    the whole pool's registration); a decode step then sweeps nothing and returns, where it
    used to wait for the lock on the engine thread. The next step sweeps."""
    from helpers import SLACK, in_thread

    decode._endpoint_for("gone-engine")  # an endpoint no sender ever connected to
    with decode._endpoints_lock:  # another engine's endpoint being made
        done, outcome = in_thread(lambda: (decode.results(set()), decode.sweep(float("inf"))))
        assert done.wait(SLACK), "the decode step waited for the endpoint being made"
    assert outcome == [((set(), set()), [])]  # nothing swept meanwhile
    assert decode.sweep(float("inf")) == ["gone-engine"]  # the lock free again: swept


def test_a_decode_step_goes_on_while_a_lookup_it_answered_waits_for_a_registration(decode: Any) -> None:
    """A prefill engine's lookup waits (parked) at the decode rendezvous; the step that
    publishes its transfer answers it, but its answer needs the engine's endpoint, whose
    making (with NIXL, the pool's registration) is stalled here by holding the endpoints'
    lock. The publishing step and the next one (another request bound, results, sweep)
    return meanwhile: no engine-thread call waits on a registration, a lock held across
    one, or the network. The answer comes once the registration ends."""
    import threading

    from helpers import SLACK, in_thread
    from kvferry.vllm.client import Client

    rdv = decode.rendezvous
    parked = threading.Event()
    real_park = rdv._park

    def park(entry: Any) -> None:
        real_park(entry)
        parked.set()

    settled = threading.Event()  # the rendezvous's own thread looked again and took it
    real_settle = rdv._settle

    def settle(entry: Any, outcome: Any) -> None:
        real_settle(entry, outcome)
        settled.set()

    rdv._park, rdv._settle = park, settle
    with Client(b"k" * 32) as client:
        answer = client.lookup(rdv.address, "Tr0", 60, "stalled-engine")
        assert parked.wait(SLACK)
        with decode._endpoints_lock:  # the engine's endpoint being made: a registration, stalled
            done, outcome = in_thread(lambda: (_expect(decode, 1), _expect(decode, 1, "s"), decode.results(set())))
            assert done.wait(SLACK), "a decode step waited for a lookup's registration"
            assert not isinstance(outcome[0], BaseException), outcome[0]
            assert settled.wait(SLACK)
            assert rdv.taker("Tr0") == "stalled-engine" and not answer.done()  # taken; its answer waits
        assert answer.result(SLACK)["request_id"] == 100  # the registration ended: answered


def test_duplicates_and_other_refusals_count_apart(decode: Any) -> None:
    """vllm:kvferry_duplicates_refused counts notices for blocks that had arrived, only;
    every other refusal (here: a notice for blocks outside the prompt) counts in
    vllm:kvferry_notices_refused (before, the duplicates counter counted both)."""
    from kvferry.errors import DuplicateTransferError, KvFerryError
    from kvferry.notice import Notice

    (spec,) = _expect(decode, 1)
    epoch = decode.receiver.epoch(spec.kv_id)
    decode.receiver.deliver(Notice(spec.kv_id, 0, 0, 1, False, epoch))
    with pytest.raises(DuplicateTransferError):
        decode.receiver.deliver(Notice(spec.kv_id, 1, 0, 1, False, epoch))
    with pytest.raises(KvFerryError) as refused:
        decode.receiver.deliver(Notice(spec.kv_id, 2, 1, 9, False, epoch))  # blocks outside its 2-block prompt
    assert not isinstance(refused.value, DuplicateTransferError)
    decode.results(set())
    counts = decode.tally.take()["counts"]
    assert counts.get("duplicates_refused") == 1 and counts.get("notices_refused") == 1


def test_early_bytes_issued_and_landed_before_the_forward() -> None:
    """Early writes count as issued whenever they land; as landed only when their copy had
    finished before the first chunk's forward ended."""
    from kvferry.notice import Notice
    from kvferry.sender import TransferRecord
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.prefill_worker import PrefillWorker, _Send
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(ConnectorConfig(), block_size=TPB, num_blocks=8, authkey=b"k" * 32)
    common.pool = _pool(8)
    worker = PrefillWorker(common)
    notice = Notice(7, 0, 0, 2, False, 1)
    records = [
        TransferRecord("early", (notice,), 0, 1.0, 1.0, 5.0),  # finished before the forward ended (10.0)
        TransferRecord("early", (notice,), 0, 1.0, 1.0, 20.0),  # landed after it
        TransferRecord("chunk", (notice,), 0, 11.0, 11.0, 21.0),
    ]
    peer = SimpleNamespace(sender=SimpleNamespace(records=records), pool=common.pool)
    spec = SimpleNamespace(transfer="T", req_id="r")
    st = _Send(spec, 7, peer, 2, {}, common.pool, "T", "p", added=True, first_forward_done=10.0)  # type: ignore[arg-type]
    worker._take_records(peer, {(id(peer), 7): st})  # type: ignore[arg-type]
    per = 2 * common.pool.block_bytes * common.pool.num_layers
    counts = worker.tally.take()["counts"]
    assert counts == {"early_issued_bytes": 2 * per, "early_landed_bytes": per, "chunk_bytes": per}


def test_prefill_settle_scans_each_peer_once_per_step() -> None:
    """Settling N finished sends in one step asks their sender for its failures once (it did
    once per send before: quadratic in the sends), and reports every one finished."""
    import numpy as np
    import torch
    from kvferry.hook import TransferHook
    from kvferry.layout import PagedKV
    from kvferry.receiver import KVReceiver
    from kvferry.sender import KVSender
    from kvferry.transports.inprocess import InProcessTransport
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import SendSpec
    from kvferry.vllm.prefill_worker import PrefillWorker, _Peer, _Send
    from kvferry.vllm.worker import WorkerCommon

    n = 6
    common = WorkerCommon(ConnectorConfig(), block_size=TPB, num_blocks=n, authkey=b"k" * 32)
    common.pool = PagedKV((torch.randn(n, 2, TPB, 8),), TPB)
    receiver = KVReceiver(_pool(n))
    sender = KVSender(common.pool, InProcessTransport(receiver), record=True, progress=True)
    worker = PrefillWorker(common)
    peer = worker._peers["p"] = _Peer("p", sender, TransferHook(sender), common.pool)
    try:
        for kv in range(n):
            epoch = receiver.expect(kv, TPB)
            peer.hook.add_request(kv, TPB, reused_len=0, src_blocks=np.array([kv]), dst_blocks=[kv], epoch=epoch)
            peer.hook.after_forward([kv], [0], [TPB])
            spec = SendSpec(f"s{kv}", f"T{kv}", TPB, 0, "p", {"request_id": kv, "held_blocks": 0}, 60.0)
            dest = spec.destination
            worker._send[(spec.req_id, 0)] = _Send(
                spec, kv, peer, 1, dest, common.pool, spec.transfer, "p", added=True, early_done=True
            )
            worker._reqs[spec.req_id] = [(spec.req_id, 0)]
        for kv in range(n):
            receiver.wait(kv, timeout=30)
        scans: list[int] = []
        real = sender.failures
        sender.failures = lambda: scans.append(1) or real()  # type: ignore[method-assign]
        finished = set(worker._reqs)
        assert worker.results(finished) == finished
        assert len(scans) == 1
        assert worker.tally.take()["counts"]["chunk_bytes"] == n * common.pool.block_bytes
    finally:
        sender.close()


@pytest.fixture
def checked_decode(tmp_path: Any) -> Iterator[Any]:
    """``decode`` with per-block checksums asked for (off by default over CPU caches)."""
    from helpers import decode_worker

    with decode_worker(str(tmp_path), num_blocks=32, block_size=TPB, config={"checksum": True}) as worker:
        yield worker


def test_a_checksum_mismatch_fails_the_request_into_the_load_failure_policy(checked_decode: Any) -> None:
    """A write whose block differs where it landed from what the prefill side summed (a
    byte flipped in flight) fails its request: the next step reports it failed, which vLLM
    hands to kv_load_failure_policy (recompute, or fail); the error names the block, and it
    counts in vllm:kvferry_checksum_mismatches and failures{reason="checksum"}, not among the
    other refusals. An intact write of another request arrives."""
    from kvferry.checksum import block_checksums
    from kvferry.errors import ChecksumError
    from kvferry.notice import Notice

    decode = checked_decode
    good, bad = _expect(decode, 2)
    receiver = decode.receiver
    assert receiver.checksum
    for spec in (good, bad):
        dst = np.asarray(spec.dst_blocks[0])
        sums = block_checksums(receiver.pool, dst)
        if spec is bad:
            sums[1] ^= np.uint64(1 << 40)  # what it summed is not what landed in block 1
        notice = Notice(spec.kv_id, 0, 0, 2, True, receiver.epoch(spec.kv_id)).with_checksums(sums)
        if spec is bad:
            with pytest.raises(ChecksumError, match=rf"request {spec.kv_id}: block 1 \(destination block 3\)"):
                receiver.deliver(notice, dst_ids=dst)
        else:
            receiver.deliver(notice, dst_ids=dst)
    arrived, failed = decode.results(set())
    assert arrived == {good.req_id, bad.req_id} and failed == {bad.req_id}
    counts = decode.tally.take()["counts"]
    assert counts.get("checksum_mismatches") == 1 and counts.get("notices_refused", 0) == 0
    assert counts.get("checksummed_blocks") == 2 and counts.get("failures/checksum") == 1, counts
