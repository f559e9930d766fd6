"""Sender and receiver end to end: random KV through each transport that runs here, compared
bit for bit; exact-once accounting at the receiver; layouts checked before any byte moves."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import secrets
import threading
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from conftest import FakeClock
from helpers import SLACK, TRANSFER_POOLS, ManualEngine, assert_nothing_leased, in_process_pair, reply_from, serve
from kvferry._core import BlockRange
from kvferry.errors import (
    DuplicateTransferError,
    InvalidArgumentError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from kvferry.layout import LayoutMismatchError, PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender, as_table
from kvferry.transports.cuda_ipc import CudaIpcTransport
from kvferry.transports.inprocess import InProcessTransport
from kvferry.transports.shm import ShmTransport

POOLS = TRANSFER_POOLS
TPB, LAYERS, SHAPE = POOLS.tpb, POOLS.layers, POOLS.shape
REQUESTS = [(11, 30, 13), (12, 17, 0), (13, 40, 32), (14, 9, 5)]  # (id, prompt, reused)


def in_process_receiver(
    device: str = "cpu", max_write_blocks: Optional[int] = None
) -> tuple[PagedKV, KVReceiver, InProcessTransport]:
    """A NaN-poisoned destination pool, a receiver expecting every request of ``REQUESTS``,
    and an in-process transport to it (writes capped at ``max_write_blocks``)."""
    dst = POOLS.nan(device)
    receiver = KVReceiver(dst)
    for rid, prompt, _ in REQUESTS:
        receiver.expect(rid, prompt)
    transport = InProcessTransport(receiver)
    transport.max_write_blocks = max_write_blocks
    return dst, receiver, transport


def block_tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random physical blocks per request on each side."""
    rng = np.random.default_rng(seed)
    widths = [-(-p // TPB) for _, p, _ in REQUESTS]
    src, dst = rng.permutation(SHAPE[0]), rng.permutation(SHAPE[0])
    offsets = np.cumsum([0, *widths])
    rows_s = [src[offsets[i] : offsets[i + 1]] for i in range(len(REQUESTS))]
    rows_d = [dst[offsets[i] : offsets[i + 1]] for i in range(len(REQUESTS))]
    return as_table(rows_s, max(widths)), as_table(rows_d, max(widths))


def drive(
    sender: KVSender, src_table: np.ndarray, dst_table: np.ndarray, chunk: int = 8, layerwise: bool = False
) -> list[Notice]:
    """An executor's view: early sends before the first forward, then chunk by chunk;
    ``layerwise``: the last chunk's blocks leave layer group by layer group during its
    forward (`KVSender.send_layers`, groups in order), before its `send_chunks`."""
    ids = np.array([r for r, _, _ in REQUESTS])
    for rid, prompt, reused in REQUESTS:
        sender.add(rid, prompt, reused_len=reused)
    sent = sender.send_early(ids, src_table, dst_table)
    pos = {rid: reused for rid, _, reused in REQUESTS}
    while True:
        live = [i for i, (rid, prompt, _) in enumerate(REQUESTS) if pos[rid] < prompt]
        if not live:
            break
        starts = np.array([pos[REQUESTS[i][0]] for i in live])
        ends = np.array([min(pos[REQUESTS[i][0]] + chunk, REQUESTS[i][1]) for i in live])
        last = [k for k, i in enumerate(live) if ends[k] == REQUESTS[i][1]]
        if layerwise and last:
            rows = [live[k] for k in last]
            for group in range(sender.layer_groups):
                sent += sender.send_layers(ids[rows], starts[last], ends[last], group, src_table[rows], dst_table[rows])
        sent += sender.send_chunks(ids[live], starts, ends, src_table[live], dst_table[live])
        for i, e in zip(live, ends):
            pos[REQUESTS[i][0]] = int(e)
        sender.poll()
    return sent


def check_layer_coverage(pool: PagedKV, notices: list[Notice]) -> None:
    """Every (layer, block) of every request arrived in exactly one notice."""
    for rid, prompt, _ in REQUESTS:
        seen = np.zeros((pool.num_layers, -(-prompt // TPB)), dtype=np.int64)
        for n in notices:
            if n.request_id == rid:
                lo, hi = pool.group_layers(n.group, n.groups)
                seen[lo:hi, n.start : n.end] += 1
        assert (seen == 1).all(), f"request {rid}: (layer, block) arrivals {seen.tolist()}"


def digest(pool: PagedKV, table: np.ndarray) -> str:
    """Hash of every request's blocks, in logical order, over all layers."""
    h = hashlib.sha256()
    for i, (_, prompt, _) in enumerate(REQUESTS):
        ids = torch.from_numpy(table[i, : -(-prompt // TPB)])
        for layer in pool.layers:
            h.update(layer.index_select(0, ids.to(layer.device)).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("max_write_blocks", [None, 5, 1])
def test_in_process_random_kv_bit_exact(max_write_blocks: Optional[int]) -> None:
    """Also with writes capped below a slice's size: slices are cut across writes, each
    part announced once with its own slice id, and only the very last part marked last."""
    src = POOLS.random(1)
    dst, receiver, transport = in_process_receiver(max_write_blocks=max_write_blocks)
    sender = KVSender(src, transport, record=True)
    src_table, dst_table = block_tables(2)
    sent = drive(sender, src_table, dst_table)
    sender.flush(timeout=10)
    for rid, prompt, reused in REQUESTS:
        receiver.wait(rid, timeout=10)
        notices = receiver.notices(rid)
        assert [n.slice_id for n in notices] == list(range(len(notices)))
        assert sum(n.end - n.start for n in notices) == -(-prompt // TPB)  # each block once
        assert notices[-1].last and not any(n.last for n in notices[:-1])
        assert [n.start for n in notices] == [0] + [n.end for n in notices[:-1]]  # in order
        if reused >= TPB:  # the early slice went first, possibly in parts
            assert reused // TPB in {n.end for n in notices}
            if max_write_blocks is None:
                assert (notices[0].start, notices[0].end) == (0, reused // TPB)
    assert sender.records is not None
    assert all(sum(n.end - n.start for n in rec.notices) <= (max_write_blocks or 10**9) for rec in sender.records)
    assert digest(dst, dst_table) == digest(src, src_table)
    assert len(sent) == sum(len(receiver.notices(r)) for r, _, _ in REQUESTS)
    for rid, _, _ in REQUESTS:
        assert sender.remove(rid).is_complete
        assert receiver.release(rid).is_complete
    assert_nothing_leased(receiver, sender=sender)
    sender.close()


def test_receiver_refuses_a_second_copy_and_unknown_requests() -> None:
    receiver = KVReceiver(POOLS.random(0))
    receiver.expect(1, 16)
    assert not receiver.deliver(Notice(1, 0, 0, 2, False))
    with pytest.raises(DuplicateTransferError):
        receiver.deliver(Notice(1, 1, 1, 4, True))
    with pytest.raises(TransferError, match="request 1 failed"):
        receiver.wait(1, timeout=1)
    with pytest.raises(UnknownRequestError):
        receiver.deliver(Notice(2, 0, 0, 1, True))


def test_receiver_counts_held_blocks_and_times_out() -> None:
    from kvferry import BlockRange

    receiver = KVReceiver(POOLS.random(0))
    receiver.expect(1, 32, held=[BlockRange(0, 5)])
    with pytest.raises(TransferTimeoutError, match=r"\[BlockRange\(5, 8\)\]"):
        receiver.wait(1, timeout=0.05)
    assert receiver.deliver(Notice(1, 0, 5, 8, True))
    receiver.wait(1, timeout=1)


def test_layout_mismatch_is_refused_before_any_byte_moves() -> None:
    src = POOLS.random(0)
    other = POOLS.but(shape=(96, 2, TPB, 4)).zeros()
    with pytest.raises(LayoutMismatchError, match="segment_bytes"):
        KVSender(src, InProcessTransport(KVReceiver(other)))


def test_sender_refuses_resend_and_bad_tables() -> None:
    src, dst = POOLS.random(0), POOLS.random(1)
    receiver = KVReceiver(dst)
    receiver.expect(1, 16)
    sender = KVSender(src, InProcessTransport(receiver))
    sender.add(1, 16, reused_len=8)
    table = np.arange(4)[None, :]
    sender.send_early([1], table, table)
    # A table too narrow for the chunk is refused before its blocks are claimed...
    with pytest.raises(ValueError, match="dst_block_table"):
        sender.send_chunks([1], [8], [16], table, table[:, :2])
    assert sender.book.claimed_blocks(1) == 2
    # ...so the same chunk can still go, once.
    assert [(n.start, n.end) for n in sender.send_chunks([1], [8], [16], table, table)] == [(2, 4)]
    with pytest.raises(DuplicateTransferError):
        sender.send_chunks([1], [8], [16], table, table)
    sender.flush(timeout=10)
    receiver.wait(1, timeout=10)
    sender.close()


def test_a_plan_goes_in_the_writes_its_transport_asks_for_and_every_block_lands_once() -> None:
    """`Transport.write_blocks` (the staging transport's is `split_write_blocks` for dma
    legs): asked with each plan's size, here the early plan's 12 blocks of three requests;
    writes of 3 blocks then carry it in 4; every block still lands bit exact, once, and the
    slices' parts stay in order."""
    src = POOLS.random(1)
    dst, receiver, transport = in_process_receiver(max_write_blocks=8)
    asked: list[int] = []
    transport.write_blocks = lambda total, device: asked.append(total) or 3  # type: ignore[method-assign]
    sender = KVSender(src, transport, record=True)
    src_table, dst_table = block_tables(2)
    drive(sender, src_table, dst_table)
    sender.flush(timeout=10)
    assert sender.records is not None
    early = [sum(n.end - n.start for n in rec.notices) for rec in sender.records if rec.kind == "early"]
    assert sum(reused // TPB for _, _, reused in REQUESTS) == asked[0] == 12
    assert early == [3, 3, 3, 3]
    for rid, prompt, _ in REQUESTS:
        receiver.wait(rid, timeout=10)
        notices = receiver.notices(rid)
        assert [n.start for n in notices] == [0] + [n.end for n in notices[:-1]]
        assert notices[-1].end == -(-prompt // TPB)
    assert digest(dst, dst_table) == digest(src, src_table)


@pytest.mark.parametrize("layer_groups, max_write_blocks", [(1, None), (2, None), (3, None), (3, 2)])
def test_layer_wise_streaming_in_process_bit_exact(layer_groups: int, max_write_blocks: Optional[int]) -> None:
    """The last chunk's blocks leave one layer group at a time (groups of uneven size for
    2 groups of 3 layers): every (layer, block) arrives once, a request completes only once
    every group of its last blocks arrived, and the KV is bit exact; the chunk's own
    `send_chunks` then sends nothing more."""
    src = POOLS.random(5)
    dst, receiver, transport = in_process_receiver(max_write_blocks=max_write_blocks)
    sender = KVSender(src, transport, record=True, layer_groups=layer_groups)
    src_table, dst_table = block_tables(6)
    sent = drive(sender, src_table, dst_table, layerwise=True)
    sender.flush(timeout=10)
    for rid, _, _ in REQUESTS:
        receiver.wait(rid, timeout=10)
    arrived = [n for rid, _, _ in REQUESTS for n in receiver.notices(rid)]
    assert sorted(arrived, key=lambda n: (n.request_id, n.slice_id)) == sorted(
        sent, key=lambda n: (n.request_id, n.slice_id)
    )
    check_layer_coverage(dst, arrived)
    assert (
        {n.groups for n in arrived} == {1}
        if layer_groups == 1
        else {n.groups for n in arrived if n.group > 0} == {layer_groups}
    )
    assert sender.records is not None
    layer_bytes = [r.nbytes for r in sender.records if r.kind == "layer"]
    assert layer_bytes and all(r.kind in ("early", "chunk", "layer") for r in sender.records)
    # A layer write carries only its group's layers: the bytes add up to whole blocks.
    expected = sum(-(-p // TPB) for _, p, _ in REQUESTS) * src.block_bytes * LAYERS
    assert sum(r.nbytes for r in sender.records) == expected
    assert digest(dst, dst_table) == digest(src, src_table)
    for rid, _, _ in REQUESTS:
        assert sender.remove(rid).is_complete
        assert receiver.release(rid).is_complete
    assert_nothing_leased(receiver, sender=sender)
    sender.close()


def test_layer_slices_count_at_the_receiver_per_group() -> None:
    """The receiver's side of exact-once per (layer group, block): a block is complete once
    every group of it arrived; a group twice, a whole block over a partly arrived one, a
    group of a whole block, or a group the pool cannot split into are refused and fail the
    request, changing nothing."""
    pool = POOLS.zeros()
    r = KVReceiver(pool)
    r.expect(1, 8)  # two blocks
    assert not r.deliver(Notice(1, 0, 0, 2, False, 0, 0, 2))
    assert not r.is_complete(1)
    assert r.deliver(Notice(1, 1, 0, 2, True, 0, 1, 2))
    r.wait(1, timeout=1)
    for bad, error in [
        (Notice(1, 2, 0, 1, False, 0, 1, 2), DuplicateTransferError),  # group 1 again
        (Notice(1, 2, 0, 1, False, 0, 0, 1), DuplicateTransferError),  # the whole block again
    ]:
        with pytest.raises(error):
            r.deliver(bad)
    r.expect(2, 8)
    r.deliver(Notice(2, 0, 0, 1, False, 0, 2, 3))
    with pytest.raises(DuplicateTransferError):  # block 0 arrived in part: not whole
        r.deliver(Notice(2, 1, 0, 2, True, 0))
    assert r.refused()[-1].notice.request_id == 2
    r.expect(3, 8)
    with pytest.raises(InvalidArgumentError, match="groups=4"):  # 3 layers cannot make 4 groups
        r.deliver(Notice(3, 0, 0, 2, True, 0, 0, 4))
    r.expect(4, 8)
    with pytest.raises(InvalidArgumentError, match="group=3"):
        r.deliver(Notice(4, 0, 0, 2, True, 0, 3, 3))
    with pytest.raises(TransferError):
        r.wait(4, timeout=1)


def _receiver_process(conn: Any, authkey: bytes, kind: str) -> None:
    """The generation worker: a pool (shared memory, or CUDA shared by IPC), a receiver, an
    endpoint; reports the digest of its blocks once every request completed."""
    if kind == "shm":
        served = serve("shm", authkey=authkey, pools=POOLS)
    else:  # staging (a small ring: batches wrap around it and wait for frees), NIXL, CUDA IPC
        device = "cuda" if "cuda" in kind else "cpu"  # staging-cuda, nixl-cuda, cuda-ipc
        transport = kind if kind == "cuda-ipc" else kind.removesuffix("-cuda")
        served = serve(transport, POOLS.nan(device), authkey=authkey, capacity_blocks=12)
    serve_requests(conn, served.receiver, served.endpoint.address)
    served.close()


def serve_requests(conn: Any, receiver: KVReceiver, address: str) -> None:
    """A generation worker's part of `run_with_receiver`: expects every request of
    `REQUESTS`, sends its ``address``, takes the destination table, reports the digest of
    its blocks and the notices per request once every request completed (or the error), and
    returns once the sender is done with the pool."""
    for rid, prompt, _ in REQUESTS:
        receiver.expect(rid, prompt)
    conn.send(address)
    dst_table = conn.recv()
    try:
        for rid, _, _ in REQUESTS:
            receiver.wait(rid, timeout=60)
        conn.send(("ok", digest(receiver.pool, dst_table), [len(receiver.notices(r)) for r, _, _ in REQUESTS]))
    except Exception as err:  # reported to the test, which fails with it
        conn.send(("error", repr(err), []))
    conn.recv()  # the sender is done with the pool


def run_with_receiver(
    kind: str,
    tables: tuple[np.ndarray, np.ndarray],
    connect: Callable[[str, bytes], tuple[KVSender, str]],
    layerwise: bool,
    worker: Callable[..., None] = _receiver_process,
    *worker_args: Any,
) -> None:
    """Spawns the generation worker ``worker(conn, authkey, kind, *worker_args)`` (by default
    `_receiver_process`; it ends with `serve_requests`), connects a sender to it
    (``connect(address, authkey)`` returns the sender and the digest the receiver's blocks
    must have), drives ``tables`` through it (`drive`) and checks what arrived: that digest,
    and every slice announced once."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    authkey = secrets.token_bytes(32)
    proc = ctx.Process(target=worker, args=(child, authkey, kind, *worker_args), daemon=True)
    proc.start()
    try:
        address = reply_from(parent, proc, "receiver")
        src_table, dst_table = tables
        parent.send(dst_table)
        sender, expected = connect(address, authkey)
        sent = drive(sender, src_table, dst_table, layerwise=layerwise)
        sender.flush(timeout=60)
        status, value, counts = reply_from(parent, proc, "receiver")
        assert status == "ok", value
        assert value == expected
        assert sum(counts) == len(sent)  # every slice announced once, none lost
        sender.close()
        parent.send("done")
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def contiguous_block_tables() -> tuple[np.ndarray, np.ndarray]:
    """Each request's blocks consecutive on both sides (another start on each): every write
    is a few runs of blocks."""
    widths = [-(-p // TPB) for _, p, _ in REQUESTS]
    offsets = np.cumsum([0, *widths])
    rows_s = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(REQUESTS))]
    rows_d = [np.arange(offsets[i], offsets[i + 1]) + 7 for i in range(len(REQUESTS))]
    return as_table(rows_s, max(widths)), as_table(rows_d, max(widths))


def _two_processes(
    kind: str,
    device: str,
    transport: Any,
    layer_groups: int = 1,
    tables: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> None:
    tables = block_tables(3) if tables is None else tables
    nixl = kind.startswith("nixl")

    def connect(address: str, authkey: bytes) -> tuple[KVSender, str]:
        with pytest.raises(TransferError, match="cannot reach the receiver"):
            transport(address, authkey=secrets.token_bytes(32), **({"src": POOLS.random(0, device)} if nixl else {}))
        src = POOLS.random(4, device)
        link = transport(address, authkey=authkey, src=src) if nixl else transport(address, authkey=authkey)
        return KVSender(src, link, layer_groups=layer_groups), digest(src, tables[0])

    run_with_receiver(kind, tables, connect, layerwise=layer_groups > 1)


# Each cross-process transport also streams the last chunk by layer group (2 groups of 3
# layers: uneven), so a layer slice's subset of layers crosses every data path.
LAYERWISE = pytest.mark.parametrize("layer_groups", [1, 2])


@LAYERWISE
def test_shared_memory_two_processes_bit_exact(layer_groups: int) -> None:
    _two_processes("shm", "cpu", ShmTransport, layer_groups)


@LAYERWISE
def test_pinned_staging_two_processes_bit_exact(layer_groups: int) -> None:
    """The staging protocol with host pools (no pinning on CPU): ring wrap-around and waits."""
    from kvferry.transports.staging import StagingTransport

    _two_processes("staging", "cpu", StagingTransport, layer_groups)


@pytest.mark.cuda
@LAYERWISE
def test_pinned_staging_cuda_two_processes_bit_exact(layer_groups: int) -> None:
    from kvferry.transports.staging import StagingTransport

    _two_processes("staging-cuda", "cuda", StagingTransport, layer_groups)


@LAYERWISE
def test_nixl_two_processes_bit_exact(monkeypatch: pytest.MonkeyPatch, layer_groups: int) -> None:
    """NIXL with UCX on loopback: DRAM pools in two processes, notices as notifications."""
    pytest.importorskip("nixl")
    from kvferry.transports.nixl import NixlTransport

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # inherited by the spawned receiver
    _two_processes("nixl", "cpu", NixlTransport, layer_groups)


@LAYERWISE
def test_nixl_contiguous_blocks_go_as_runs_bit_exact(monkeypatch: pytest.MonkeyPatch, layer_groups: int) -> None:
    """Blocks consecutive on both sides go as one descriptor per run, layer and segment (a
    transfer made for the write, not the prepared per-block lists, which only a write with
    no two consecutive blocks takes): they land bit exact, exactly once."""
    pytest.importorskip("nixl")
    from kvferry.transports.nixl import NixlTransport
    from nixl._api import nixl_agent

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    made = {"runs": 0, "prepped": 0}
    initialize, prepped = nixl_agent.initialize_xfer, nixl_agent.make_prepped_xfer

    def counted(kind: str, real: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            made[kind] += 1
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(nixl_agent, "initialize_xfer", counted("runs", initialize))
    monkeypatch.setattr(nixl_agent, "make_prepped_xfer", counted("prepped", prepped))
    _two_processes("nixl", "cpu", NixlTransport, layer_groups, tables=contiguous_block_tables())
    assert made["runs"] > made["prepped"], made


def test_nixl_sender_has_no_progress_thread_and_its_writes_still_land(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's agent runs no UCX progress thread (it would poll without pause beside an
    engine's forward while a write is out): its writes progress when the announcer asks
    their state, and land bit exact, exactly once."""
    pytest.importorskip("nixl")
    from kvferry.transports.nixl import NixlTransport
    from nixl._api import nixl_agent

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    made: dict[str, bool] = {}
    real = nixl_agent.__init__

    def noted(self: Any, name: str, config: Any = None, *args: Any, **kwargs: Any) -> None:
        made[name.split("-")[1]] = config.enable_pthread
        real(self, name, config, *args, **kwargs)

    monkeypatch.setattr(nixl_agent, "__init__", noted)
    _two_processes("nixl", "cpu", NixlTransport, 1)
    assert made == {"tx": False}, made  # the receiver's agent is in the other process


def test_nixl_descriptors_per_write_are_one_per_run_layer_and_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of 16 blocks in 3 runs consecutive on both sides hands NIXL 3 descriptors per
    layer and segment on each side (16 before runs were coalesced) in one transfer; a write
    of scattered blocks takes the prepared per-block lists, one row per block, layer and
    segment. Both land bit exact (the destination NaN-poisoned), every other block keeps its
    poison, each request's notice arrives once and nothing stays leased. (Counts, not
    times: the per-descriptor cost is measured by `kvferry bench copy --transport nixl`.)"""
    pytest.importorskip("nixl")
    from kvferry.engine import ThreadCopyEngine
    from kvferry.transports.base import Write
    from kvferry.transports.nixl import NixlTransport
    from nixl._api import nixl_agent

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    counted: dict[str, list[int]] = {"descriptors": [], "prepped": [], "transfers": []}
    real_descs, real_init = nixl_agent.get_xfer_descs, nixl_agent.initialize_xfer
    real_prepped = nixl_agent.make_prepped_xfer

    def descs(self: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        counted["descriptors"].append(len(rows))
        return real_descs(self, rows, *args, **kwargs)

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        counted["transfers"].append(1)
        return real_init(self, *args, **kwargs)

    def prepped(self: Any, op: Any, local: Any, rows: Any, remote: Any, remote_rows: Any, *args: Any) -> Any:
        counted["prepped"].append(len(rows))
        assert len(remote_rows) == len(rows)
        return real_prepped(self, op, local, rows, remote, remote_rows, *args)

    monkeypatch.setattr(nixl_agent, "get_xfer_descs", descs)
    monkeypatch.setattr(nixl_agent, "initialize_xfer", init)
    monkeypatch.setattr(nixl_agent, "make_prepped_xfer", prepped)
    src, dst = POOLS.random(7), POOLS.nan()
    served = serve("nixl", dst)
    engine = ThreadCopyEngine()
    per_block = src.segments * LAYERS
    runs = (np.r_[0:10, 20:25, 40], np.r_[5:15, 30:35, 2])
    scattered = (np.array([50, 48, 46, 44]), np.array([60, 58, 56, 54]))
    try:
        tx = NixlTransport(served.endpoint.address, authkey=served.authkey, src=src)
        counted["descriptors"].clear()  # the per-block lists prepared once, at connect
        for rid, (s, d) in enumerate((runs, scattered), start=1):
            epoch = served.receiver.expect(rid, len(s) * TPB, dst_blocks=d)
            tx.announce([(rid, epoch)])
            notice = Notice(rid, 0, 0, len(s), True, epoch)
            assert tx.write(engine, Write(src, s, d, [notice])).wait(SLACK)
        assert counted["transfers"] == [1], counted
        assert counted["descriptors"] == [3 * per_block, 3 * per_block], counted
        assert counted["prepped"] == [4 * per_block], counted
        for rid in (1, 2):
            served.receiver.wait(rid, timeout=SLACK)
            assert len(served.receiver.notices(rid)) == 1
        moved = np.concatenate([runs[1], scattered[1]])
        src_ids = np.concatenate([runs[0], scattered[0]])
        untouched = torch.from_numpy(np.setdiff1d(np.arange(dst.num_blocks), moved))
        for s_layer, d_layer, layer in zip(src.segment_views(torch.int32), dst.segment_views(torch.int32), dst.layers):
            assert torch.equal(d_layer[:, torch.from_numpy(moved)], s_layer[:, torch.from_numpy(src_ids)])
            assert torch.isnan(layer.index_select(dst.block_dim, untouched)).all()
        for rid in (1, 2):
            served.receiver.release(rid)
        tx.close()
        assert_nothing_leased(served.receiver)
    finally:
        served.close()
        engine.close()


def test_nixl_runs_address_exactly_the_blocks_of_their_pairs() -> None:
    """`block_runs` cuts where either side's ids stop stepping by one; each run descriptor
    covers exactly the bytes of the per-block descriptors of its blocks, for both layouts
    and a layer slice."""
    from kvferry.transports.nixl import block_descriptors, block_runs, descriptor_indices, run_descriptors

    s0, d0, n = block_runs(np.array([3, 4, 5, 9, 10, 2]), np.array([0, 1, 2, 3, 8, 9]))
    assert s0.tolist() == [3, 9, 10, 2] and d0.tolist() == [0, 3, 8, 9] and n.tolist() == [3, 1, 1, 1]
    assert [len(x) for x in block_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64))] == [0, 0, 0]
    for block_dim in (0, 1):
        shape = (7, 2, 3) if block_dim == 0 else (2, 7, 3)
        pool = PagedKV(tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(3)), TPB, block_dim=block_dim)
        src = np.array([1, 2, 3, 6, 0, 1])
        dst = np.array([4, 5, 6, 0, 2, 3])
        for layers in ((0, 3), (1, 2)):
            s0, _, n = block_runs(src, dst)
            runs = run_descriptors(
                [t.data_ptr() for t in pool.layers],
                layers,
                pool.segments,
                pool.segment_bytes,
                pool.num_blocks,
                0,
                s0,
                n,
            )
            assert len(runs) == (layers[1] - layers[0]) * pool.segments * 3
            per_block = block_descriptors(pool)[descriptor_indices(src, layers, pool.segments, pool.num_blocks)]
            covered = sorted(
                (int(a) + i * pool.segment_bytes) for a, size, _ in runs for i in range(int(size) // pool.segment_bytes)
            )
            assert covered == sorted(int(a) for a in per_block[:, 0])
            assert all(int(size) % pool.segment_bytes == 0 for _, size, _ in runs)


@pytest.mark.cuda
@LAYERWISE
def test_nixl_cuda_two_processes_bit_exact(layer_groups: int) -> None:
    """NIXL between VRAM pools of two processes on one GPU."""
    pytest.importorskip("nixl")
    from kvferry.transports.nixl import NixlTransport

    _two_processes("nixl-cuda", "cuda", NixlTransport, layer_groups)


@pytest.mark.cuda
@LAYERWISE
def test_cuda_ipc_two_processes_bit_exact(layer_groups: int) -> None:
    _two_processes("cuda-ipc", "cuda", CudaIpcTransport, layer_groups)


@pytest.mark.cuda
def test_cuda_in_process_copies_wait_for_the_forward() -> None:
    """A copy queued right after a (slow) kernel that writes the source blocks sees the
    kernel's output: the copy stream waits for the producing stream."""
    src = POOLS.random(1, "cuda")
    dst = POOLS.zeros("cuda")
    receiver = KVReceiver(dst)
    receiver.expect(1, 16)
    sender = KVSender(src, InProcessTransport(receiver))
    sender.add(1, 16)
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the "forward" writes
    for layer in src.layers:
        layer[:4].fill_(42.0)
    table = np.arange(4)[None, :]
    sender.send_chunks([1], [0], [16], table, table)
    sender.flush(timeout=30)
    receiver.wait(1, timeout=30)
    assert all(bool((layer[:4] == 42.0).all()) for layer in dst.layers)
    sender.close()


@pytest.mark.cuda
def test_cuda_in_process_random_kv_bit_exact() -> None:
    src = POOLS.random(1, "cuda")
    dst, receiver, transport = in_process_receiver("cuda")
    sender = KVSender(src, transport)
    src_table, dst_table = block_tables(2)
    drive(sender, src_table, dst_table)
    sender.flush(timeout=30)
    for rid, _, _ in REQUESTS:
        receiver.wait(rid, timeout=30)
    assert digest(dst, dst_table) == digest(src, src_table)
    sender.close()


def _gated_pair() -> tuple[KVSender, KVReceiver, ManualEngine]:
    engine = ManualEngine()
    sender, receiver = in_process_pair(POOLS.random(0), POOLS.random(1), engine=engine, timeout=0.05)
    for rid in (1, 2):
        receiver.expect(rid, 16)
        sender.add(rid, 16, reused_len=8)
    return sender, receiver, engine


def test_cancel_waits_for_its_copies_and_drops_their_notices(sender_clock: FakeClock) -> None:
    # The sender's clock stands still: its 0.05 s copy timeout cannot pass while the test
    # thread waits for the CPU (on a loaded box it did, failing both requests).
    sender, receiver, engine = _gated_pair()
    table = np.arange(8).reshape(2, 4)
    sender.send_early([1, 2], table, table)
    with pytest.raises(TransferTimeoutError, match="request 1: copies reading its blocks"):
        sender.cancel(1, timeout=0.01)
    with pytest.raises(ValueError, match=r"\[1\] were cancelled"):  # revoked while its copy runs
        sender.send_chunks([1], [8], [16], table[:1], table[:1])
    engine.gates[0].opened = True
    ledger = sender.cancel(1, timeout=1)
    assert ledger.prefix_sent and 1 not in sender.book
    assert receiver.notices(2) and not receiver.notices(1)  # 2's notice went, 1's did not
    with pytest.raises(UnknownRequestError, match="unknown request_id=1"):  # it is gone
        sender.send_chunks([1], [8], [16], table[:1], table[:1])
    receiver.release(1)
    sender.send_chunks([2], [8], [16], table[1:], table[1:])
    engine.gates[1].opened = True
    sender.flush(timeout=1)
    receiver.wait(2, timeout=1)


def test_a_copy_past_its_timeout_fails_clearly(sender_clock: FakeClock) -> None:
    sender, receiver, engine = _gated_pair()
    table = np.arange(8).reshape(2, 4)
    sender.send_early([1, 2], table, table)
    sender_clock.advance(0.06)  # the copy is held by its gate: now past the 0.05 s timeout
    with pytest.raises(TransferTimeoutError, match=r"requests \[1, 2\] still running"):
        sender.poll()
    engine.gates[0].opened = True
    sender.flush(timeout=10)
    assert [len(receiver.notices(rid)) for rid in (1, 2)] == [1, 1]


def test_cancel_before_anything_was_sent() -> None:
    sender, receiver, _ = _gated_pair()
    assert sender.cancel(1).claimed_blocks == 0
    with pytest.raises(UnknownRequestError):
        sender.cancel(1)


def test_nixl_descriptors_and_indices_address_each_block() -> None:
    from kvferry.transports.nixl import block_descriptors, descriptor_indices

    pool = PagedKV(tuple(torch.zeros(2, 5, 3, dtype=torch.float16) for _ in range(3)), TPB, block_dim=1)
    desc = block_descriptors(pool)
    assert desc.shape == (3 * 2 * 5, 3) and desc.dtype == np.uint64
    rows = descriptor_indices(np.array([4, 1]), (0, 3), 2, 5)
    assert rows.dtype == np.int32 and len(rows) == 3 * 2 * 2
    for row in rows:
        layer, rem = divmod(int(row), 2 * 5)
        segment, block = divmod(rem, 5)
        assert block in (4, 1)
        assert int(desc[row, 0]) == pool.layers[layer][segment, block].data_ptr()
        assert int(desc[row, 1]) == pool.segment_bytes == 3 * 2
    # A layer slice addresses the same blocks in its layers only.
    rows = descriptor_indices(np.array([4, 1]), (1, 2), 2, 5)
    assert sorted(divmod(int(r), 2 * 5)[0] for r in rows) == [1] * 4
    assert sorted({int(r) % 5 for r in rows}) == [1, 4]


def test_nixl_notice_wire_format_round_trips() -> None:
    from kvferry.transports.nixl import _decode, _encode

    notices = [Notice(7, 0, 0, 21, False), Notice(-3, 4, 21, 32, True)]
    assert _decode(_encode(notices)) == notices
    with pytest.raises(TransferError, match="not a kvferry notification"):
        _decode(b"hello")


def test_staging_ring_reserves_contiguous_runs_and_starts_over_when_empty() -> None:
    from kvferry.transports.base import TransportFull
    from kvferry.transports.staging import StagingTransport

    ring = StagingTransport.__new__(StagingTransport)  # the slot arithmetic alone
    ring.capacity, ring._head, ring._used = 10, 0, 0
    ring._collect_frees = lambda: None  # type: ignore[method-assign]
    assert ring._reserve(6) == (0, 0)
    with pytest.raises(TransportFull, match="5 blocks wanted, 0 free"):
        ring._reserve(5)  # 4 free at the tail, and a wrap would need slots still in use
    assert (ring._head, ring._used) == (6, 6)  # a refused reservation changes nothing
    ring._used = 0  # the receiver freed everything
    assert ring._reserve(10) == (0, 0)
    ring._used = 4  # frees arrive for the oldest slots first
    ring._head = 8
    assert ring._reserve(3) == (0, 2)  # skips the 2-slot tail to stay contiguous
    assert ring._used == 4 + 2 + 3


def test_by_default_a_finished_copy_reaches_the_receiver_without_further_calls() -> None:
    """The README's case: send, then wait at the receiver; nobody calls poll or flush. The
    announcer posts each write's notices in queue order; `poll` alongside it posts nothing
    twice."""
    receiver = KVReceiver(POOLS.random(1))
    epoch = receiver.expect(1, 16)
    sender = KVSender(POOLS.random(0), InProcessTransport(receiver))
    sender.add(1, 16, reused_len=8, epoch=epoch)
    table = np.arange(4)[None, :]
    sender.send_early([1], table, table)
    sender.send_chunks([1], [8], [16], table, table)
    receiver.wait(1, timeout=30)
    assert [(n.slice_id, n.start, n.end) for n in receiver.notices(1)] == [(0, 0, 2), (1, 2, 4)]
    assert not sender.in_flight(1) and sender.poll() == [] and sender.remove(1).is_complete
    sender.close()


def test_with_progress_off_only_the_executor_posts() -> None:
    receiver = KVReceiver(POOLS.random(1))
    receiver.expect(1, 16)
    sender = KVSender(POOLS.random(0), InProcessTransport(receiver), progress=False)
    sender.add(1, 16)
    table = np.arange(4)[None, :]
    sender.send_chunks([1], [0], [16], table, table)
    with pytest.raises(
        TransferTimeoutError,
        match=r"blocks \[BlockRange\(0, 4\)\] did not arrive within 0.01 s; no sender announced it; 0 notices arrived",
    ):
        receiver.wait(1, timeout=0.01)  # the copy may have landed: its notice waits for a poll
    posted = sender.flush(timeout=30)
    assert [(n.start, n.end) for n in posted] == [(0, 4)] and receiver.is_complete(1)
    sender.close()


def test_a_wait_that_cannot_finish_says_why() -> None:
    """A request whose sender revoked it, or one awaiting blocks of a failed owner, fails its
    wait at once; one never expected is unknown; a wait that times out names what the
    receiver knows (its sender, the notices that came, the epoch)."""
    receiver = KVReceiver(POOLS.random(1))
    epoch = receiver.expect(1, 16)
    receiver.expect(2, 16, awaits=[(1, BlockRange(0, 4))])
    receiver.bind(1, "sender A", epoch)
    receiver.deliver(Notice(1, 0, 0, 2, False, epoch), "sender A")
    with pytest.raises(
        TransferTimeoutError,
        match=(
            r"request 1: blocks \[BlockRange\(2, 4\)\] did not arrive within 0.01 s; its sender is sender A; 1 "
            r"notices arrived \(epoch 1\)"
        ),
    ):
        receiver.wait(1, timeout=0.01)
    assert receiver.revoked(1, epoch, "sender A")
    with pytest.raises(TransferError, match="request 1: revoked by sender A before all its blocks arrived") as err:
        receiver.wait(1, timeout=None)
    assert not isinstance(err.value, TransferTimeoutError)
    with pytest.raises(TransferError, match="were to arrive with request 1's transfer, which failed") as err:
        receiver.wait(2, timeout=None)
    assert not isinstance(err.value, TransferTimeoutError)
    with pytest.raises(UnknownRequestError, match="unknown request_id=3"):
        receiver.wait(3, timeout=None)


def test_blocks_the_receiver_holds_never_cross() -> None:
    """Held blocks (with holes) are expected as arrived at the receiver and skipped by the
    sender: their destination blocks keep their own contents, the rest arrive bit exact."""
    from kvferry._core import BlockRange

    src = POOLS.random(5)
    dst = POOLS.nan()
    receiver = KVReceiver(dst)
    sender = KVSender(src, InProcessTransport(receiver))
    src_table, dst_table = block_tables(6)
    held = {11: [BlockRange(0, 2), BlockRange(4, 5)], 13: [BlockRange(1, 8)], 12: [], 14: [BlockRange(0, 3)]}
    for rid, prompt, _ in REQUESTS:
        receiver.expect(rid, prompt, held=held[rid])
    # A hold that does not fit the prompt is refused and registers nothing.
    with pytest.raises(InvalidArgumentError):
        sender.add(11, 30, reused_len=13, held=[BlockRange(0, 2), BlockRange(7, 99)])
    assert 11 not in sender.book
    ids = np.array([r for r, _, _ in REQUESTS])
    for rid, prompt, reused in REQUESTS:
        sender.add(rid, prompt, reused_len=reused, held=held[rid])
    sent = sender.send_early(ids, src_table, dst_table)
    sent += sender.send_chunks(
        ids, np.array([r for _, _, r in REQUESTS]), np.array([p for _, p, _ in REQUESTS]), src_table, dst_table
    )
    sender.flush(timeout=10)
    for i, (rid, prompt, _) in enumerate(REQUESTS):
        receiver.wait(rid, timeout=10)
        kept = {b for r in held[rid] for b in range(r.start, r.end)}
        crossed = [b for n in receiver.notices(rid) for b in range(n.start, n.end)]
        assert sorted(crossed) == sorted(set(range(-(-prompt // TPB))) - kept)
        for b in range(-(-prompt // TPB)):
            for sl, dl in zip(src.layers, dst.layers):
                got = dl[int(dst_table[i, b])]
                if b in kept:
                    assert bool(got.isnan().all())  # never written
                else:
                    assert torch.equal(got, sl[int(src_table[i, b])])
        assert sender.remove(rid).is_complete
    assert sum(n.end - n.start for n in sent) == sum(-(-p // TPB) for _, p, _ in REQUESTS) - sum(
        len(r) for rs in held.values() for r in rs
    )
    sender.close()


def test_awaited_blocks_complete_with_their_owner() -> None:
    """In-flight dedup at the receiver: a request's awaited blocks count as its own only once
    they arrived with the owner's transfer; an owner that fails, or is forgotten before
    they arrived, fails the request; a notice for awaited blocks is refused."""
    from kvferry._core import BlockRange

    def receiver() -> KVReceiver:
        return KVReceiver(POOLS.zeros())

    r = receiver()
    owner = r.expect(1, 40)  # blocks [0, 10)
    r.expect(2, 44, awaits=[(1, BlockRange(0, 8))])  # shares 8 blocks, brings [8, 11) itself
    with pytest.raises(InvalidArgumentError, match="owner request_id=9"):
        r.expect(3, 44, awaits=[(9, BlockRange(0, 8))])
    with pytest.raises(DuplicateTransferError):
        r.deliver(Notice(2, 0, 0, 2, False, 0))  # awaited blocks never come for request 2
    r = receiver()
    r.expect(1, 40)
    r.expect(2, 44, awaits=[(1, BlockRange(0, 8))])
    assert r.deliver(Notice(2, 0, 8, 11, True, 0))
    with pytest.raises(TransferTimeoutError):
        r.wait(2, timeout=0.05)  # its own blocks are in, the shared ones are not
    r.deliver(Notice(1, 0, 0, 8, False, 0))
    assert r.wait(2, timeout=1) > 0
    r.deliver(Notice(1, 1, 8, 10, True, 0))
    r.release(1)
    r.release(2)
    # Released after the shared blocks arrived: fine; before: the request fails.
    r = receiver()
    r.expect(1, 40)
    r.expect(2, 44, awaits=[(1, BlockRange(0, 8))])
    r.expect(3, 44, awaits=[(1, BlockRange(0, 8))])
    r.deliver(Notice(2, 0, 8, 11, True, 0))
    r.deliver(Notice(3, 0, 8, 11, True, 0))
    r.deliver(Notice(1, 0, 0, 4, False, 0))
    r.fail(1, TransferError("receiver of request 1 gone"))
    for rid in (2, 3):
        with pytest.raises(TransferError, match="request 1"):
            r.wait(rid, timeout=1)
    r = receiver()
    r.expect(1, 40)
    r.expect(2, 44, awaits=[(1, BlockRange(0, 8))])
    r.deliver(Notice(2, 0, 8, 11, True, 0))
    r.release_unfenced(1)
    with pytest.raises(TransferError, match="request 1's transfer, which failed"):
        r.wait(2, timeout=1)
    assert owner == 1


def test_hook_after_layer_streams_the_last_chunk_by_layer_group() -> None:
    """`TransferHook.after_layer`: a group leaves after its last layer (3 layers in 2
    groups: after layers 0 and 2), only for requests in their last chunk; `after_forward`
    then sends whole blocks only for the others."""
    from kvferry.hook import TransferHook

    src = POOLS.random(7)
    dst = POOLS.nan()
    receiver = KVReceiver(dst)
    hook = TransferHook(KVSender(src, InProcessTransport(receiver), layer_groups=2))
    for rid, prompt, blocks in [(1, 14, range(0, 4)), (2, 32, range(10, 18))]:
        epoch = receiver.expect(rid, prompt)
        hook.add_request(
            rid, prompt, reused_len=0, src_blocks=list(blocks), dst_blocks=[b + 40 for b in blocks], epoch=epoch
        )
    starts, ends = [0, 0], [14, 16]  # request 1's only chunk; request 2's first of two
    sent = [hook.after_layer([1, 2], starts, ends, layer) for layer in range(LAYERS)]
    assert [[(n.request_id, n.start, n.end, n.group, n.groups) for n in notices] for notices in sent] == [
        [(1, 0, 4, 0, 2)],
        [],
        [(1, 0, 4, 1, 2)],
    ]
    assert [(n.request_id, n.start, n.end, n.groups) for n in hook.after_forward([1, 2], starts, ends)] == [
        (2, 0, 4, 1)
    ]
    hook.sender.flush(timeout=10)
    receiver.wait(1, timeout=10)
    assert not receiver.is_complete(2)
    sent = [hook.after_layer([2], [16], [32], layer) for layer in range(LAYERS)]
    assert [[(n.start, n.end, n.group, n.last) for n in notices] for notices in sent] == [
        [(4, 8, 0, True)],
        [],
        [(4, 8, 1, True)],
    ]
    assert hook.after_forward([2], [16], [32]) == []
    hook.finish(1, timeout=10)
    hook.finish(2, timeout=10)
    receiver.wait(2, timeout=10)
    for rid, blocks in [(1, range(0, 4)), (2, range(10, 18))]:
        ids = torch.tensor(list(blocks))
        for a, b in zip(src.layers, dst.layers):
            assert torch.equal(a[ids], b[ids + 40]), rid
    hook.sender.close()


def test_cancel_between_layer_groups_fences_a_partly_arrived_request() -> None:
    """A request cancelled after one of its two layer groups arrived: the sender posts its
    fence, the receiver fails it (blocks half arrived never count as complete) and can
    release it at once; a later request with the same id and a new epoch streams whole."""
    src = POOLS.random(8)
    dst = POOLS.nan()
    receiver = KVReceiver(dst)
    sender = KVSender(src, InProcessTransport(receiver), layer_groups=2)
    table = np.arange(4)[None, :]
    epoch = receiver.expect(1, 16)
    sender.add(1, 16, epoch=epoch)
    sent = sender.send_layers([1], [0], [16], 0, table, table + 10)
    assert [(n.start, n.end, n.group, n.groups) for n in sent] == [(0, 4, 0, 2)]
    sender.flush(timeout=10)
    assert not receiver.is_complete(1)
    sender.cancel(1, timeout=10)
    assert receiver.fenced(1)
    with pytest.raises(TransferError, match="revoked"):
        receiver.wait(1, timeout=1)
    ledger = receiver.release(1, timeout=1)
    assert ledger.claimed_blocks == 0 and not ledger.is_complete  # group 0 alone claims nothing whole
    epoch = receiver.expect(1, 16)
    sender.add(1, 16, epoch=epoch)
    for group in (0, 1):
        sender.send_layers([1], [0], [16], group, table, table + 20)
    assert sender.send_chunks([1], [0], [16], table, table + 20) == []
    sender.flush(timeout=10)
    receiver.wait(1, timeout=10)
    ids = torch.arange(4)
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(a[ids], b[ids + 20])
    sender.remove(1)
    sender.close()


class _VanishingReceiver(InProcessTransport):
    """An in-process transport whose receiver is reported gone once ``gone`` is set; the
    check that first saw it sets ``seen``."""

    def __init__(self, receiver: KVReceiver) -> None:
        super().__init__(receiver)
        self.gone = threading.Event()
        self.seen = threading.Event()

    def check_peer(self) -> None:
        if self.gone.is_set():
            self.seen.set()
            raise TransferError("the receiver went away (test)")


def test_a_lost_receiver_is_raised_once_whoever_found_it() -> None:
    """The announcer finds the receiver gone and queues the loss for the executor; the next
    send raises it. A later flush must not raise the same loss again (it did: the announcer's
    queued copy stayed behind; a multi-peer test caught it under load)."""
    receiver = KVReceiver(POOLS.random(1))
    receiver.expect(1, 16)
    transport = _VanishingReceiver(receiver)
    sender = KVSender(POOLS.random(0), transport)  # the announcer is on by default
    sender.add(1, 16)
    transport.gone.set()
    assert transport.seen.wait(30)  # the announcer's periodic look found it, with request 1 registered
    table = np.arange(4)[None, :]
    with pytest.raises(TransferError, match="went away"):
        sender.send_chunks([1], [0], [16], table, table)
    assert sender.flush(timeout=10) == []  # raised once: nothing left to raise
    assert sender.poll() == []
    assert set(sender.failures()) == {1}
    sender.remove(1)
    sender.close()


@pytest.mark.parametrize("kind", ["shm", "staging"])
def test_a_transport_closed_by_its_sender_and_again_by_its_owner_closes_once(kind: str) -> None:
    """`KVSender.close` closes its transport; the code that made the transport may close it
    too (a `finally`): the second close does nothing, where it raised AttributeError."""
    from kvferry.transports.staging import StagingTransport

    served = serve(kind, pools=POOLS)
    try:
        cls = ShmTransport if kind == "shm" else StagingTransport
        tx = cls(served.endpoint.address, authkey=served.authkey)
        sender = KVSender(POOLS.random(3), tx)
        sender.close()
        tx.close()
        assert not hasattr(tx, "dst")
    finally:
        served.close()
