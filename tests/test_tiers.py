"""Reused prefixes split across the device pool and the host tier (kvferry.tiers).

* A prefix whose blocks lie in both pools arrives bit exact through every transport that runs
  here (in-process, shared memory, staging, NIXL on DRAM, NIXL's split path).
* The tier's own copies race the send and lose nothing: an offload still writing a host
  block, or an onboard still writing a device block, when the send is queued; with
  `order_after` the receiver gets the final bytes. Controls show the race is real: without
  it the same send delivers the stale bytes. Every interleaving is forced by events the test
  releases, never by timing.
* CUDA variants (pinned host pool read in place, `torch.cuda.Event` signals, host signals on
  the CUDA engine's launcher) are marked ``cuda``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from conftest import FakeClock
from helpers import TRANSFER_POOLS as POOLS
from helpers import ManualEngine, in_process_pair
from kvferry.engine import ThreadCopyEngine
from kvferry.errors import TransferError
from kvferry.hook import TransferHook
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender, as_table
from kvferry.transports.inprocess import InProcessTransport
from kvferry.transports.shm import ShmTransport
from test_transfer import (
    LAYERS,
    REQUESTS,
    SHAPE,
    TPB,
    block_tables,
    check_layer_coverage,
    drive,
    in_process_receiver,
    run_with_receiver,
)

DEVICE_BLOCKS = SHAPE[0]  # 96
HOST_BLOCKS = 64
HOST_POOLS = POOLS.but(shape=(HOST_BLOCKS, *SHAPE[1:]))


def pools(seed: int, device: str = "cpu") -> tuple[PagedKV, PagedKV]:
    """A device pool and a host tier of random KV (the host pool pinned for CUDA)."""
    host = HOST_POOLS.random(seed + 1)
    if device == "cuda":
        host = HOST_POOLS.of(t.pin_memory() for t in host.layers)
    return POOLS.random(seed, device), host


def tiered_pair(
    dev: PagedKV, host: PagedKV, *requests: tuple[int, int, int], device: str = "cpu", **sender_options: Any
) -> tuple[KVReceiver, KVSender]:
    """A NaN-poisoned receiver on ``device`` and a sender of ``dev`` with host tier ``host``
    over an in-process transport, each ``(request id, prompt, reused)`` registered at both."""
    sender, receiver = in_process_pair(dev, POOLS.nan(device), host_pool=host, **sender_options)
    for rid, prompt, reused in requests:
        receiver.expect(rid, prompt)
        sender.add(rid, prompt, reused_len=reused)
    return receiver, sender


def tiered_tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint random source blocks per request from both tiers (combined ids: host blocks
    from DEVICE_BLOCKS on), about half of each prefix on the host; random destinations."""
    rng = np.random.default_rng(seed)
    widths = [-(-p // TPB) for _, p, _ in REQUESTS]
    src = rng.permutation(DEVICE_BLOCKS + HOST_BLOCKS)
    _, dst_table = block_tables(seed)
    offsets = np.cumsum([0, *widths])
    rows = [src[offsets[i] : offsets[i + 1]] for i in range(len(REQUESTS))]
    table = as_table(rows, max(widths))
    assert (table >= DEVICE_BLOCKS).any() and ((table >= 0) & (table < DEVICE_BLOCKS)).any()
    return table, dst_table


def block(dev: PagedKV, host: PagedKV, layer: int, combined: int) -> torch.Tensor:
    """Block ``combined`` of one layer, from whichever tier holds it."""
    if combined < dev.num_blocks:
        return dev.layers[layer][combined]
    return host.layers[layer][combined - dev.num_blocks]


def expected_digest(dev: PagedKV, host: PagedKV, src_table: np.ndarray) -> str:
    """`test_transfer.digest` of what the receiver must hold: each request's blocks in logical
    order, every layer, read from the tier its combined id names."""
    h = hashlib.sha256()
    for i, (_, prompt, _) in enumerate(REQUESTS):
        ids = src_table[i, : -(-prompt // TPB)]
        for layer in range(LAYERS):
            h.update(
                torch.stack([block(dev, host, layer, int(b)).cpu() for b in ids])
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .tobytes()
            )
    return h.hexdigest()


def received_digest(dst: PagedKV, dst_table: np.ndarray) -> str:
    from test_transfer import digest

    return digest(dst, dst_table)


# --- a mixed-tier prefix, bit exact ---------------------------------------------------------


@pytest.mark.parametrize("max_write_blocks, layer_groups", [(None, 1), (3, 1), (1, 1), (None, 3), (3, 2)])
def test_mixed_tier_prefix_in_process_bit_exact(max_write_blocks: Optional[int], layer_groups: int) -> None:
    """Every request's source blocks come from both tiers (the early slice included); each
    write is one job over both pools, its notices posted once both parts landed. With layer
    groups, the last chunk streams group by group from both tiers' layer slices."""
    dev, host = pools(1)
    dst, receiver, transport = in_process_receiver(max_write_blocks=max_write_blocks)
    sender = KVSender(dev, transport, host_pool=host, record=True, layer_groups=layer_groups)
    src_table, dst_table = tiered_tables(2)
    sent = drive(sender, src_table, dst_table, layerwise=layer_groups > 1)
    sender.flush(timeout=10)
    for rid, _, _ in REQUESTS:
        receiver.wait(rid, timeout=10)
    check_layer_coverage(dst, [n for rid, _, _ in REQUESTS for n in receiver.notices(rid)])
    assert received_digest(dst, dst_table) == expected_digest(dev, host, src_table)
    assert len(sent) == sum(len(receiver.notices(r)) for r, _, _ in REQUESTS)
    assert (
        sender.records is not None
        and sum(r.nbytes for r in sender.records)
        == sum(-(-p // TPB) for _, p, _ in REQUESTS) * dev.block_bytes * LAYERS
    )
    for rid, _, _ in REQUESTS:
        assert sender.remove(rid).is_complete
    sender.close()


def test_hook_takes_host_ids_and_order_after(tier_waits: threading.Event) -> None:
    """Through the executor hook: ``src_blocks`` with host ids, the tier's copy declared with
    `TransferHook.order_after`."""
    dev, host = pools(3)
    receiver = KVReceiver(POOLS.nan())
    sender = KVSender(dev, InProcessTransport(receiver), host_pool=host)
    hook = TransferHook(sender)
    epoch = receiver.expect(7, 17)
    src = [DEVICE_BLOCKS + 5, 2, DEVICE_BLOCKS + 63, 9, 10]
    hook.add_request(7, 17, reused_len=12, src_blocks=src, dst_blocks=[0, 1, 2, 3, 4], epoch=epoch)
    written = threading.Event()
    hook.order_after([DEVICE_BLOCKS + 63], written)
    final = [torch.full(HOST_POOLS.shape[1:], float(layer)) for layer in range(LAYERS)]
    hook.before_forward([7])
    assert tier_waits.wait(10)
    assert not receiver.notices(7)  # the early copy waits for the tier
    for layer in range(LAYERS):
        host.layers[layer][63].copy_(final[layer])
    written.set()
    hook.after_forward([7], [12], [17])
    hook.finish(7, timeout=10)
    receiver.wait(7, timeout=10)
    for layer in range(LAYERS):
        for b, s in enumerate(src):
            assert torch.equal(receiver.pool.layers[layer][b], block(dev, host, layer, s))
        assert torch.equal(receiver.pool.layers[layer][2], final[layer])
    assert not hook.leased(7)
    sender.close()


# --- across processes -----------------------------------------------------------------------


def _two_processes(
    kind: str, make: Callable[[str, bytes, PagedKV, PagedKV], Any], device: str = "cpu", layer_groups: int = 1
) -> None:
    """`test_transfer.run_with_receiver` with a host tier: the receiver's digest is compared
    with the blocks read from both tiers here."""
    tables = tiered_tables(3)

    def connect(address: str, authkey: bytes) -> tuple[KVSender, str]:
        dev, host = pools(4, device)
        sender = KVSender(dev, make(address, authkey, dev, host), host_pool=host, layer_groups=layer_groups)
        return sender, expected_digest(dev, host, tables[0])

    run_with_receiver(kind, tables, connect, layerwise=layer_groups > 1)


def test_mixed_tier_prefix_shared_memory_bit_exact() -> None:
    _two_processes("shm", lambda address, key, dev, host: ShmTransport(address, authkey=key))


@pytest.mark.parametrize("layer_groups", [1, 2])
def test_mixed_tier_prefix_staging_bit_exact(layer_groups: int) -> None:
    """The staging ring takes each write's blocks in order, whichever tier each comes from
    (a small ring: writes wrap and wait for frees); also layer group by layer group."""
    from kvferry.transports.staging import StagingTransport

    _two_processes(
        "staging", lambda address, key, dev, host: StagingTransport(address, authkey=key), layer_groups=layer_groups
    )


@pytest.mark.parametrize(
    "split, layer_groups", [(False, 1), (True, 1), (True, 2)], ids=["one-list", "split", "split-layerwise"]
)
def test_mixed_tier_prefix_nixl_bit_exact(monkeypatch: pytest.MonkeyPatch, split: bool, layer_groups: int) -> None:
    """NIXL registers the host pool too. DRAM and DRAM: one descriptor list over both pools,
    one transfer per write. ``split``: one transfer per tier and the notices sent after both
    (the path of VRAM plus a DRAM host tier), forced here on DRAM; with layer groups, each
    tier's rows of a group's layers."""
    pytest.importorskip("nixl")
    from kvferry.transports import nixl

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setattr(nixl, "SPLIT_TIERS", split)
    _two_processes(
        "nixl",
        lambda address, key, dev, host: nixl.NixlTransport(address, authkey=key, src=dev, host_src=host),
        layer_groups=layer_groups,
    )


# --- the tier's own copies racing the send ---------------------------------------------------


def _signal(kind: str) -> tuple[Any, Callable[[], None]]:
    """A tier completion signal of ``kind`` and the function that completes it."""
    if kind == "event":
        event = threading.Event()
        return event, event.set
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    return future, lambda: future.set_result(None)


class SlowTierCopy:
    """The tier's copy of one block, run by a thread that starts only when the test releases
    it and then writes layer by layer, completing ``signal`` at the end."""

    def __init__(self, write_layer: Callable[[int], None], complete: Callable[[], None]) -> None:
        self.release = threading.Event()
        self._write_layer = write_layer
        self._complete = complete
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.release.wait(10)
        for layer in range(LAYERS):
            self._write_layer(layer)
        self._complete()


def _race_setup(seed: int) -> tuple[PagedKV, PagedKV, KVReceiver, KVSender]:
    dev, host = pools(seed)
    receiver, sender = tiered_pair(dev, host, (1, 17, 16))  # 4 complete reused blocks leave early
    return dev, host, receiver, sender


@pytest.mark.parametrize("signal_kind", ["event", "future"])
@pytest.mark.parametrize("ordered", [True, False], ids=["order_after", "control"])
def test_an_offload_racing_the_send_delivers_the_final_bytes(
    signal_kind: str, ordered: bool, tier_waits: threading.Event
) -> None:
    """Host block 7 is being written by an offload (device block 30 -> host block 7) when
    the early send of a prefix that holds it is queued. With `order_after` the copy waits for
    the offload and the receiver gets its final bytes. The control declares nothing: the copy
    runs at once and the receiver gets the stale bytes (the offload is released only after
    the send completed), so this test would fail if ordering were lost."""
    dev, host, receiver, sender = _race_setup(10)
    stale = [host.layers[layer][7].clone() for layer in range(LAYERS)]
    signal, complete = _signal(signal_kind)
    offload = SlowTierCopy(lambda layer: host.layers[layer][7].copy_(dev.layers[layer][30]), complete)
    src = np.array([[3, DEVICE_BLOCKS + 7, 50, DEVICE_BLOCKS + 12, 60]])
    dst = np.array([[0, 1, 2, 3, 4]])
    if ordered:
        sender.order_after([DEVICE_BLOCKS + 7], signal)
    sender.send_early([1], src, dst)
    if ordered:
        assert tier_waits.wait(10)
        assert sender.poll() == [] and sender.in_flight(1) and sender.leased(1)  # waiting for the tier
    else:
        sender.flush(timeout=10)  # the send completes before the offload even starts
    offload.release.set()
    offload.thread.join(10)
    sender.flush(timeout=10)
    sender.send_chunks([1], [16], [17], src, dst)
    sender.flush(timeout=10)
    receiver.wait(1, timeout=10)
    for layer in range(LAYERS):
        got = receiver.pool.layers[layer][1]
        assert torch.equal(got, dev.layers[layer][30] if ordered else stale[layer])
        assert torch.equal(receiver.pool.layers[layer][3], host.layers[layer][12])  # the untouched host block
        assert torch.equal(receiver.pool.layers[layer][0], dev.layers[layer][3])
    assert not torch.equal(stale[0], dev.layers[0][30])  # the two outcomes differ
    sender.remove(1)
    sender.close()


@pytest.mark.parametrize("ordered", [True, False], ids=["order_after", "control"])
def test_an_onboard_racing_the_send_delivers_the_onboarded_bytes(ordered: bool) -> None:
    """Device block 40 is being written from host block 9 (an onboard) when the send that
    reads it is queued; ordered after the onboard's Future the receiver gets the onboarded
    bytes, without it (control) the device block's old bytes."""
    dev, host, receiver, sender = _race_setup(11)
    old = [dev.layers[layer][40].clone() for layer in range(LAYERS)]
    signal, complete = _signal("future")
    onboard = SlowTierCopy(lambda layer: dev.layers[layer][40].copy_(host.layers[layer][9]), complete)
    src, dst = np.array([[40, 1, 2, 3, 4]]), np.array([[5, 6, 7, 8, 9]])
    if ordered:
        sender.order_after(np.array([40]), signal)
    sender.send_early([1], src, dst)
    if not ordered:
        sender.flush(timeout=10)
    onboard.release.set()
    onboard.thread.join(10)
    sender.flush(timeout=10)
    for layer in range(LAYERS):
        assert torch.equal(receiver.pool.layers[layer][5], host.layers[layer][9] if ordered else old[layer])
    sender.cancel(1)
    sender.close()


def test_only_writes_reading_a_declared_block_wait(tier_waits: threading.Event) -> None:
    """Writes of at most two blocks: the first write (device blocks) lands while the second,
    which reads the host block being offloaded into, waits for the tier. (The engine runs
    copies in order: once the second waits, the first has finished, and `poll` has posted
    it if the announcer had not.)"""
    dev, host, receiver, sender = _race_setup(12)
    receiver.expect(2, 9)
    transport = sender.transport
    transport.max_write_blocks = 2
    sender.add(2, 9, reused_len=8)
    written = threading.Event()
    sender.order_after([DEVICE_BLOCKS + 20], written)
    sender.send_early(
        [1, 2],
        np.array([[1, 2, DEVICE_BLOCKS + 20, 4, 5], [6, 7, 8, 0, 0]]),
        np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
    )
    assert tier_waits.wait(10)
    sender.poll()
    assert [(n.start, n.end) for n in receiver.notices(1)] == [(0, 2)]  # the first write only
    sender.poll()
    assert [(n.start, n.end) for n in receiver.notices(1)] == [(0, 2)]
    assert not receiver.notices(2)  # queued behind the waiting write (copies keep their order)
    written.set()
    sender.flush(timeout=10)
    assert [(n.start, n.end) for n in receiver.notices(1)] == [(0, 2), (2, 4)]
    assert [(n.start, n.end) for n in receiver.notices(2)] == [(0, 2)]
    sender.close()


def test_the_announcer_queues_a_failed_write_under_the_lock_that_found_it() -> None:
    """The announcer thread finds a failed write and queues its error for the executor in one
    hold of the sender's lock. Queued after letting go, a flush taken in between saw neither
    the write nor the error and returned as if it had landed (test above, 1 run in 15 under
    load)."""
    dev, host, receiver, sender = _race_setup(14)
    assert sender._progress is not None  # the announcer is on by default
    held: list[bool] = []
    deferred = threading.Event()
    defer = sender._defer

    def watched(err: BaseException) -> None:
        if threading.current_thread() is sender._progress:
            held.append(sender._lock._is_owned())  # type: ignore[attr-defined]
            deferred.set()
        defer(err)

    sender._defer = watched  # type: ignore[method-assign]
    onboard: concurrent.futures.Future[None] = concurrent.futures.Future()
    sender.order_after([DEVICE_BLOCKS + 1], onboard)
    sender.send_early([1], np.array([[DEVICE_BLOCKS + 1, 2, 3, 4, 5]]), np.array([[0, 1, 2, 3, 4]]))
    onboard.set_exception(OSError("DMA error"))
    assert deferred.wait(60)
    assert held == [True]
    with pytest.raises(TransferError, match="DMA error"):
        sender.flush(timeout=10)
    sender.cancel(1)
    sender.close()


def test_a_failed_tier_copy_fails_the_write_and_fences_the_request() -> None:
    """The onboard's Future ends in an exception: the write ordered after it never reads the
    block; its request fails (raised once, naming it) and gets its fence; a request not
    reading the block is unaffected."""
    dev, host, receiver, sender = _race_setup(13)
    receiver.expect(2, 9)
    sender.add(2, 9, reused_len=8)
    onboard: concurrent.futures.Future[None] = concurrent.futures.Future()
    sender.order_after([DEVICE_BLOCKS + 1], onboard)
    sender.send_early([2], np.array([[10, 11, 0]]), np.array([[20, 21, 22]]))
    sender.send_early([1], np.array([[DEVICE_BLOCKS + 1, 2, 3, 4, 5]]), np.array([[0, 1, 2, 3, 4]]))
    onboard.set_exception(OSError("DMA error"))
    with pytest.raises(TransferError, match=r"requests \[1\] failed.*ordered after failed.*DMA error"):
        sender.flush(timeout=10)
    assert torch.isnan(receiver.pool.layers[0][0]).all()  # never written
    assert receiver.fenced(1) and not receiver.notices(1)
    assert [(n.start, n.end) for n in receiver.notices(2)] == [(0, 2)]
    assert not sender.leased(1)
    sender.cancel(1)  # acknowledges the failure
    sender.close()


def test_a_declaration_ends_with_its_signal_and_the_engine_can_close_on_a_stuck_one() -> None:
    """Once the tier's signal completed, later copies no longer wait for it; a copy waiting
    for a signal that never comes is failed by the engine's close, which does not hang."""
    dev, host, receiver, sender = _race_setup(14)
    done = threading.Event()
    done.set()
    sender.order_after([0, 1], done)
    stuck = threading.Event()
    sender.order_after([DEVICE_BLOCKS + 2], stuck)
    assert len(sender._ordering) == 1  # the completed one is gone
    sender.send_early([1], np.array([[0, 1, DEVICE_BLOCKS + 2, 3, 4]]), np.array([[0, 1, 2, 3, 4]]))
    engine = sender.engine
    assert isinstance(engine, ThreadCopyEngine)
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(30)  # a bound for a hang only: close fails the waiting copy at once
    assert not closing.is_alive()
    with pytest.raises(TransferError, match="closed while a copy waited for a tier copy"):
        sender.flush(timeout=5)
    sender.close()


def test_a_copy_waiting_for_the_tier_times_out_and_cancels_like_any_copy(sender_clock: FakeClock) -> None:
    """The wait for a tier signal counts in the sender's timeout: `poll` raises, `cancel`
    keeps the request leased while the copy has not run, and once the tier is done the copy
    ends, the cancel returns and the request is fenced with none of its notices posted."""
    dev, host = pools(16)
    receiver, sender = tiered_pair(dev, host, (1, 17, 16), timeout=0.05)
    written = threading.Event()
    sender.order_after([DEVICE_BLOCKS + 3], written)
    sender.send_early([1], np.array([[DEVICE_BLOCKS + 3, 1, 2, 3, 4]]), np.array([[0, 1, 2, 3, 4]]))
    sender_clock.advance(0.1)  # the copy waits for `written`: it is past the timeout
    with pytest.raises(TransferError, match=r"requests \[1\] still running"):
        sender.poll()
    with pytest.raises(TransferError, match="request 1: copies reading its blocks still running"):
        sender.cancel(1, timeout=0.01)
    assert sender.leased(1) and not receiver.fenced(1)
    written.set()
    sender.cancel(1, timeout=10)
    assert not sender.leased(1) and receiver.fenced(1) and not receiver.notices(1)
    sender.close()


def test_leases_cover_host_blocks() -> None:
    """A request whose blocks are all in the host tier stays leased while its copy is queued
    and after, until `remove`; the tier must keep those host blocks until then."""
    dev, host = pools(15)
    engine = ManualEngine()
    receiver, sender = tiered_pair(dev, host, (1, 8, 0), engine=engine)
    sender.send_chunks([1], [0], [8], np.array([[DEVICE_BLOCKS + 4, DEVICE_BLOCKS + 5]]), np.array([[0, 1]]))
    assert sender.leased(1)
    engine.gates[0].opened = True
    sender.flush(timeout=1)
    assert sender.leased(1)  # registered: a later send may still read its blocks
    sender.remove(1)
    assert not sender.leased(1)
    for layer in range(LAYERS):
        assert torch.equal(receiver.pool.layers[layer][1], host.layers[layer][5])
    sender.close()


# --- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("layer_groups", [1, 2])
def test_cuda_mixed_tier_prefix_bit_exact(layer_groups: int) -> None:
    """CUDA pools with a pinned host tier: host blocks are read in place (a CUDA view of the
    pinned memory) by the same copy kernel, on the copy stream (also by layer group)."""
    dev, host = pools(20, "cuda")
    dst, receiver, transport = in_process_receiver("cuda")
    sender = KVSender(dev, transport, host_pool=host, layer_groups=layer_groups)
    src_table, dst_table = tiered_tables(21)
    drive(sender, src_table, dst_table, layerwise=layer_groups > 1)
    sender.flush(timeout=30)
    for rid, _, _ in REQUESTS:
        receiver.wait(rid, timeout=30)
    assert received_digest(dst, dst_table) == expected_digest(dev, host, src_table)
    sender.close()


@pytest.mark.cuda
def test_cuda_refuses_an_unpinned_host_tier() -> None:
    from kvferry.errors import InvalidArgumentError

    dev, _ = pools(22, "cuda")
    host = HOST_POOLS.zeros()
    with pytest.raises(InvalidArgumentError, match="not pinned"):
        KVSender(dev, InProcessTransport(KVReceiver(POOLS.nan("cuda"))), host_pool=host)


def _cuda_race(kind: str, ordered: bool) -> None:
    """An offload (device 30 -> host 7) or an onboard (host 9 -> device 40) on a side stream,
    held back by a ~100 ms GPU sleep, signalled by a CUDA event; the send is queued meanwhile."""
    dev, host = pools(23, "cuda")
    receiver, sender = tiered_pair(dev, host, (1, 17, 16), (2, 17, 16), device="cuda")
    side = torch.cuda.Stream()
    done = torch.cuda.Event()
    if kind == "offload":
        before = [host.layers[layer][7].clone() for layer in range(LAYERS)]
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            for layer in range(LAYERS):
                host.layers[layer][7].copy_(dev.layers[layer][30], non_blocking=True)
            done.record()
        declared, src = DEVICE_BLOCKS + 7, np.array([[3, DEVICE_BLOCKS + 7, 50, DEVICE_BLOCKS + 12, 60]])
        final = [dev.layers[layer][30] for layer in range(LAYERS)]
    else:
        before = [dev.layers[layer][40].clone() for layer in range(LAYERS)]
        staged = [host.layers[layer][9].to("cuda") for layer in range(LAYERS)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            for layer in range(LAYERS):
                dev.layers[layer][40].copy_(staged[layer], non_blocking=True)
            done.record()
        declared, src = 40, np.array([[40, 1, 2, 3, 4]])
        final = staged
    # A first copy of the same shape, from other blocks: the copy path's one-time setup
    # (kernel graphs per pool pair) is done before the race, so the unordered send runs at
    # once instead of after anything that setup may wait for.
    warm = np.where(src >= DEVICE_BLOCKS, src + 20, src + 1)
    sender.send_early([2], warm, np.array([[10, 11, 12, 13, 14]]))
    sender.flush(timeout=30)
    if ordered:
        sender.order_after([declared], done)
    sender.send_early([1], src, np.array([[0, 1, 2, 3, 4]]))
    sender.flush(timeout=30)
    torch.cuda.synchronize()
    slot = 1 if kind == "offload" else 0
    for layer in range(LAYERS):
        assert torch.equal(receiver.pool.layers[layer][slot].cpu(), (final[layer] if ordered else before[layer]).cpu())
    sender.cancel(1)
    sender.close()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["offload", "onboard"])
def test_cuda_tier_copy_racing_the_send_is_ordered_by_its_event(kind: str) -> None:
    _cuda_race(kind, ordered=True)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["offload", "onboard"])
def test_cuda_tier_copy_racing_the_send_control(kind: str) -> None:
    """Without `order_after` the copy stream does not wait for the side stream's 100 ms
    sleep: the receiver gets the bytes from before the tier's copy."""
    _cuda_race(kind, ordered=False)


@pytest.mark.cuda
def test_cuda_engine_waits_for_a_host_signal_without_blocking_the_executor(tier_waits: threading.Event) -> None:
    """A host-side offload (a CPU thread writing the pinned host block) signalled by a
    threading.Event: the CUDA engine's launcher enqueues the copy once it is set, and a later
    write of another request queues behind it; `send_*` never blocks (both return while the
    offload, which only the test can release, has not even started)."""
    dev, host = pools(24, "cuda")
    receiver, sender = tiered_pair(dev, host, (1, 17, 16), (2, 9, 8), device="cuda")
    signal, complete = _signal("event")
    offload = SlowTierCopy(lambda layer: host.layers[layer][7].copy_(dev.layers[layer][30].cpu()), complete)
    sender.order_after([DEVICE_BLOCKS + 7], signal)
    sender.send_early([1], np.array([[3, DEVICE_BLOCKS + 7, 50, 51, 52]]), np.array([[0, 1, 2, 3, 4]]))
    sender.send_early([2], np.array([[60, 61, 0]]), np.array([[10, 11, 12]]))
    assert tier_waits.wait(30)  # the launcher holds the first copy, the second queues behind it
    assert sender.poll() == [] and sender.in_flight(1) and sender.in_flight(2)
    offload.release.set()
    sender.flush(timeout=30)
    for layer in range(LAYERS):
        assert torch.equal(receiver.pool.layers[layer][1], dev.layers[layer][30])
        assert torch.equal(receiver.pool.layers[layer][10], dev.layers[layer][60])
    sender.cancel(1)
    sender.cancel(2)
    sender.close()


@pytest.mark.cuda
def test_cuda_staging_mixed_tier_prefix_bit_exact() -> None:
    from kvferry.transports.staging import StagingTransport

    _two_processes("staging-cuda", lambda address, key, dev, host: StagingTransport(address, authkey=key), "cuda")


@pytest.mark.cuda
def test_cuda_nixl_mixed_tier_prefix_bit_exact() -> None:
    """VRAM device pool and a DRAM host tier: one NIXL transfer per memory type, the notices
    sent after both."""
    pytest.importorskip("nixl")
    from kvferry.transports.nixl import NixlTransport

    _two_processes(
        "nixl-cuda", lambda address, key, dev, host: NixlTransport(address, authkey=key, src=dev, host_src=host), "cuda"
    )


@pytest.mark.cuda
def test_cuda_ipc_mixed_tier_prefix_bit_exact() -> None:
    """The receiver's CUDA pool mapped through CUDA IPC: both parts of each write go through
    the copy kernel, the host part read from the pinned tier in place."""
    from kvferry.transports.cuda_ipc import CudaIpcTransport

    _two_processes("cuda-ipc", lambda address, key, dev, host: CudaIpcTransport(address, authkey=key), "cuda")
