"""Per-block checksums (kvferry.checksum): the sums themselves (the Rust core, the torch
reference, the Triton kernel), and end to end on every transport: a byte flipped where a
block landed, before its notice is delivered, fails the request naming the block, while an
untouched transfer passes."""

from __future__ import annotations

import multiprocessing as mp
import re
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch
from helpers import POOLS, SLACK, Pools, reply_from, run_kernel_check, serve
from kvferry import _core, checksum
from kvferry.checksum import block_checksums, reference_checksums
from kvferry.copy import copy_blocks
from kvferry.errors import ChecksumError, InvalidArgumentError, TransferError
from kvferry.layout import PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.frames import TRANSPORT, Notices, Staged
from kvferry.transports.inprocess import InProcessTransport
from kvferry.transports.registry import connect
from test_kv_layouts import ATTN, DST_IDS, MIXED, SRC_IDS, poison, random_bytes, register, vllm_views

# bf16 blocks of 2 segments (K|V) of 4 tokens x 2 heads x 8: 128-byte segments.
BF16 = Pools(shape=(2, 24, 4, 2, 8), layers=3, tpb=4, block_dim=1, dtype=torch.bfloat16)


def _cpu(pool: PagedKV, ids: np.ndarray, layers: Optional[tuple[int, int]] = None) -> np.ndarray:
    return block_checksums(pool, ids, layers)


def _reference(pool: PagedKV, ids: np.ndarray, layers: Optional[tuple[int, int]] = None) -> np.ndarray:
    return reference_checksums(pool, ids, layers).cpu().numpy().view(np.uint64)


def test_the_core_and_the_torch_reference_agree_and_layer_groups_add_up() -> None:
    pool = BF16.random_bytes(3)
    ids = np.array([5, 0, 23, 5, 11])
    whole = _cpu(pool, ids)
    assert whole.dtype == np.uint64 and len(whole) == 5
    assert np.array_equal(whole, _reference(pool, ids))
    assert whole[0] == whole[3] and len(set(whole[:3].tolist())) == 3
    parts = [_cpu(pool, ids, pool.group_layers(g, 2)) for g in range(2)]
    assert np.array_equal(parts[0] + parts[1], whole)  # uint64 wraps: sums of sums
    assert np.array_equal(parts[1], _reference(pool, ids, pool.group_layers(1, 2)))


def test_every_flipped_bit_of_a_block_changes_its_sum() -> None:
    pool = BF16.random_bytes(4)
    want = _cpu(pool, np.array([7]))[0]
    raw = pool.layers[2].view(torch.uint8)  # (2, 24, 4, 2, 16) bytes: block 7 of the last layer
    for seg, tok, byte, bit in [(0, 0, 0, 0), (1, 3, 15, 7), (1, 0, 9, 3), (0, 2, 31 % 16, 5)]:
        raw[seg, 7, tok, 0, byte] ^= 1 << bit
        assert _cpu(pool, np.array([7]))[0] != want, (seg, tok, byte, bit)
        raw[seg, 7, tok, 0, byte] ^= 1 << bit
    assert _cpu(pool, np.array([7]))[0] == want


@pytest.mark.parametrize("layouts", MIXED, ids="->".join)
def test_pools_of_other_strides_sum_the_blocks_they_exchange_the_same(layouts: tuple[str, str]) -> None:
    """A block copied between two physical layouts (layer-outer and block-outer vLLM views)
    sums the same on both sides, and so does a head slice of it: the sums follow the
    geometry the pools share, not their strides."""
    src = register(vllm_views(layouts[0], *ATTN, torch.bfloat16, "cpu", random_bytes(1)))
    dst = register(vllm_views(layouts[1], *ATTN, torch.bfloat16, "cpu", poison))
    copy_blocks(src, dst, SRC_IDS, DST_IDS)
    sent = _cpu(src, SRC_IDS)
    assert np.array_equal(sent, _cpu(dst, DST_IDS))
    assert np.array_equal(_cpu(src.heads(1, 2), SRC_IDS), _cpu(dst.heads(1, 2), DST_IDS))
    assert not np.array_equal(_cpu(dst, SRC_IDS), sent)  # other blocks: other sums


def test_bad_input_is_refused_by_name() -> None:
    pool = BF16.random_bytes(1)
    views = [v.numpy() for v in pool.segment_views(torch.uint8)]
    with pytest.raises(InvalidArgumentError, match=r"invalid block_ids=.*24.*\[0, 24\)"):
        _core.block_checksums(views, np.array([24]), 0)
    with pytest.raises(InvalidArgumentError, match=r"invalid layers=\[\]"):
        _core.block_checksums([], np.array([0]), 0)
    with pytest.raises(TypeError, match="layers must be a list of 3-d uint8 arrays"):
        _core.block_checksums([np.zeros((2, 3), dtype=np.uint8)], np.array([0]), 0)
    odd = Pools(shape=(4, 3), layers=1, tpb=1, dtype=torch.uint8).zeros()  # 3-byte blocks
    with pytest.raises(InvalidArgumentError, match="invalid layers=<segments of 3 bytes>"):
        _core.block_checksums([v.numpy() for v in odd.segment_views(torch.uint8)], np.array([0]), 0)
    assert not checksum.supports(odd)
    assert not checksum.checksum_option(None, odd)
    with pytest.raises(InvalidArgumentError, match=r"invalid checksum=True: .* \(segments of 3 bytes"):
        KVReceiver(odd, checksum=True)
    with pytest.raises(TypeError, match="checksum must be a bool or None, got str 'yes'"):
        KVReceiver(pool, checksum="yes")  # type: ignore[arg-type]


def test_the_default_follows_one_constant_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``checksum=None`` (every default: the sender, the receiver, the connector's key) is
    `CHECKSUM_DEFAULT` for the pool's device; an explicit value wins."""
    pool = POOLS.zeros()
    assert not KVReceiver(pool).checksum  # CPU: off unless asked for (the sums cost the copy's order)
    monkeypatch.setitem(checksum.CHECKSUM_DEFAULT, "cpu", True)
    receiver = KVReceiver(pool)
    assert receiver.checksum and not KVReceiver(pool, checksum=False).checksum
    sender = KVSender(POOLS.random(0), InProcessTransport(receiver))
    try:
        assert sender.checksum
    finally:
        sender.close()
    monkeypatch.delitem(checksum.CHECKSUM_DEFAULT, "cpu")
    assert not KVReceiver(pool).checksum  # a device the constant does not name: off


KERNEL_CHECK = """
import numpy as np, torch
from kvferry import _triton_checksum
from kvferry.checksum import reference_checksums
from test_checksum import BF16
from test_kv_layouts import ATTN, LAYOUTS, random_bytes, register, vllm_views
ids = np.array([7, 2, 9, 0, 4, 11, 7])
views = [register(vllm_views(x, *ATTN, torch.bfloat16, "cpu", random_bytes(2))) for x in LAYOUTS]
for pool in [BF16.random_bytes(3), *views, views[0].heads(1, 2)]:
    for layers in [(0, pool.num_layers), (1, pool.num_layers)]:
        got = _triton_checksum.checksums(pool, ids, layers)
        want = reference_checksums(pool, ids, layers)
        assert torch.equal(got, want), (pool, layers, got, want)
print("kernel ok")
"""


def test_the_kernel_sums_as_the_reference_under_the_interpreter() -> None:
    """The Triton kernel (what sums a CUDA pool) on CPU under TRITON_INTERPRET=1, over
    every vLLM layout and a layer slice: bit for bit the torch reference's sums."""
    pytest.importorskip("triton")
    run_kernel_check(KERNEL_CHECK)


@pytest.mark.cuda
def test_cuda_kernel_sums_as_the_reference_and_reads_only_its_blocks() -> None:
    """On the GPU, at a real block's size (16 tokens x 8 heads x 128, K and V): random blocks
    among poisoned ones (0xFF bytes: a kernel that read a wrong block, or past a segment,
    sums poison), a scattered id list with a repeat, a layer slice; the kernel's sums are
    the torch reference's and the Rust core's over the same bytes on the host."""
    from kvferry import _triton_checksum

    shape = BF16.but(shape=(2, 64, 16, 8, 128))
    pool = shape.filled_bytes(0xFF, "cuda")
    ids = np.array([7, 2, 63, 0, 41, 7, 13])
    index = torch.from_numpy(ids).cuda()
    randomized = shape.random_bytes(9, "cuda")
    for t, r in zip(pool.layers, randomized.layers):
        t.index_copy_(1, index, r.index_select(1, index))
    for layers in [(0, 3), (1, 3)]:
        poisoned = _triton_checksum.checksums(pool, np.array([1]), layers)  # a block no id names
        got = _triton_checksum.checksums(pool, ids, layers)
        want = reference_checksums(pool, ids, layers)
        assert torch.equal(got, want), (layers, got, want)
        assert not bool((got == poisoned).any())
    host = block_checksums(pool.with_layers([t.cpu() for t in pool.layers]), ids, (1, 3))
    assert np.array_equal(host, got.cpu().numpy().view(np.uint64))


def test_frames_carry_the_notices_checksums() -> None:
    sums = np.array([1, 2**64 - 1, 3], dtype=np.uint64)
    notices = [Notice(4, 0, 0, 2, False, 1).with_checksums(sums[:2]), Notice(4, 1, 2, 3, True, 1)]
    assert notices[0] == Notice(4, 0, 0, 2, False, 1)  # the sums are not part of equality
    whole = [notices[0], notices[1].with_checksums(sums[2:])]
    for frame in (Notices(whole, np.array([5, 6, 7])), Staged(whole, 0, 3, None, np.array([5, 6, 7]))):
        back = TRANSPORT.decode(TRANSPORT.encode(frame), 1 << 20)
        assert [n.sums().tolist() for n in back.notices] == [[1, 2**64 - 1], [3]]  # type: ignore[attr-defined]
    # A notice without sums: the frame carries none, and none come back.
    back = TRANSPORT.decode(TRANSPORT.encode(Notices(notices, None)), 1 << 20)
    assert all(n.checksums is None for n in back.notices)  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="invalid checksums=<3 checksums>: must be one checksum per block"):
        _core.wire_encode("notices", {"notices": [whole[0].as_tuple()], "dst_ids": None, "checksums": sums})
    with pytest.raises(ValueError, match="3 checksums for notice"):
        Notice(4, 0, 0, 2, False, 1).with_checksums(sums)


# --- end to end: a byte flipped where a block landed, before its notice is delivered --------

REQUESTS = ((1, 16), (2, 16))  # (request, prompt tokens): 4 blocks each of POOLS' 4 tokens
FLIPPED = (2, 2)  # request 2's block 2 is corrupted after it landed


def _flip_before_delivery(receiver: KVReceiver, patch: Callable[[Any, str, Any], None]) -> list[int]:
    """Corrupts one byte of the destination block that `FLIPPED` names, where it landed,
    just before its notice is delivered (what a bad link or a stray write leaves); returns
    the list the corrupted destination block is recorded in. ``patch``: how ``deliver`` is
    replaced (``monkeypatch.setattr``, or ``setattr`` in a spawned receiver)."""
    real = receiver.deliver
    hit: list[int] = []

    def deliver(notice: Notice, source: Any = None, *, dst_ids: Optional[np.ndarray] = None) -> bool:
        rid, block = FLIPPED
        if notice.request_id == rid and notice.start <= block < notice.end and not hit:
            assert dst_ids is not None, "every transport names the blocks a write used"
            dst = int(dst_ids[block - notice.start])
            hit.append(dst)
            lo, _ = (0, 0) if notice.whole else receiver.pool.group_layers(notice.group, notice.groups)
            layer = receiver.pool.layers[lo]  # a layer this notice's write put there
            layer.view(torch.uint8).select(receiver.pool.block_dim, dst).reshape(-1)[5] ^= 0x20
        return real(notice, source, dst_ids=dst_ids)

    patch(receiver, "deliver", deliver)
    return hit


def _send(sender: KVSender, epochs: dict[int, int], layer_groups: int) -> None:
    table = np.arange(8).reshape(2, 4)
    dst_table = table + 20
    for rid, prompt in REQUESTS:
        sender.add(rid, prompt, epoch=epochs[rid])
    if layer_groups > 1:
        for group in range(layer_groups):
            sender.send_layers([1, 2], [0, 0], [16, 16], group, table, dst_table)
    sender.send_chunks([1, 2], [0, 0], [16, 16], table, dst_table)
    sender.flush(timeout=SLACK)


@pytest.fixture
def receiving() -> Iterator[Callable[[str], tuple[KVReceiver, PagedKV, Callable[[], Any]]]]:
    """``(receiver, source pool, make transport)`` for a transport name: a receiver of
    POOLS in this process, behind an endpoint for the cross-process transports (closed at
    the end of the test)."""
    closing: list[Callable[[], None]] = []

    def make(name: str) -> tuple[KVReceiver, PagedKV, Callable[[], Any]]:
        src = POOLS.random(0)
        if name == "in-process":
            receiver = KVReceiver(POOLS.nan())
            return receiver, src, lambda: InProcessTransport(receiver)
        if name == "nixl":
            pytest.importorskip("nixl")
        served = serve(name, None if name == "shm" else POOLS.nan())
        closing.append(served.close)
        address = f"{name}+{served.endpoint.address}"
        return served.receiver, src, lambda: connect(address, authkey=served.authkey, src=src)

    yield make
    for close in closing:
        close()


@pytest.mark.parametrize("layer_groups", [1, 2])
@pytest.mark.parametrize("name", ["in-process", "shm", "staging", "nixl"])
def test_a_byte_flipped_in_flight_fails_its_request_naming_the_block(
    name: str, layer_groups: int, receiving: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(checksum.CHECKSUM_DEFAULT, "cpu", True)  # the default, on both sides and the endpoint's
    receiver, src, transport = receiving(name)
    hit = _flip_before_delivery(receiver, monkeypatch.setattr)
    epochs = {
        rid: receiver.expect(rid, prompt, dst_blocks=np.arange(4) + 20 + 4 * (rid - 1)) for rid, prompt in REQUESTS
    }
    sender = KVSender(src, transport(), layer_groups=layer_groups)
    assert sender.checksum and receiver.checksum
    try:
        _send(sender, epochs, layer_groups)
        receiver.wait(1, timeout=SLACK)  # the untouched request lands and counts
        with pytest.raises(TransferError) as raised:
            receiver.wait(2, timeout=SLACK)
    finally:
        sender.close()
    cause = raised.value.__cause__
    assert isinstance(cause, ChecksumError) and cause.block == 2 and cause.request_ids == (2,)
    assert hit == [26]
    assert re.search(
        r"request 2: block 2 \(destination block 26(, layer group 0 of 2)?\) arrived with checksum", str(cause)
    )
    assert receiver.checksum_failures == 1
    assert isinstance(receiver.refused()[-1].error, ChecksumError)
    assert receiver.checksummed_blocks >= 4 * layer_groups  # request 1's blocks were checked


def test_without_checksums_the_flip_goes_unseen(receiving: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same flip with a sender that sums nothing is taken (the notice
    carries no sums to compare), so the test above fails without the check."""
    receiver, src, transport = receiving("shm")
    hit = _flip_before_delivery(receiver, monkeypatch.setattr)
    epochs = {rid: receiver.expect(rid, prompt) for rid, prompt in REQUESTS}
    sender = KVSender(src, transport(), checksum=False)
    try:
        _send(sender, epochs, 1)
        for rid, _ in REQUESTS:
            receiver.wait(rid, timeout=SLACK)
    finally:
        sender.close()
    assert hit and receiver.checksum_failures == 0 and receiver.checksummed_blocks == 0


# cuda-ipc has a test of its own below: a process cannot open its own CUDA IPC handles (on an
# H100, 2026-12-07: "invalid device context"), so its receiver runs in a spawned process.
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["staging", "in-process"])
def test_cuda_a_byte_flipped_in_flight_fails_its_request_naming_the_block(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA pools on both sides: the sender sums on its copy stream (the Triton kernel),
    the receiver where the blocks landed."""
    monkeypatch.setitem(checksum.CHECKSUM_DEFAULT, "cuda", True)  # on both sides and the endpoint's
    dst = POOLS.nan("cuda")
    src = POOLS.random(0, "cuda")
    if name == "in-process":
        receiver = KVReceiver(dst)
        transport: Any = InProcessTransport(receiver)
        close: Callable[[], None] = lambda: None  # noqa: E731
    else:
        served = serve(name, dst)
        receiver, close = served.receiver, served.close
        transport = connect(f"{name}+{served.endpoint.address}", authkey=served.authkey, src=src)
    hit = _flip_before_delivery(receiver, monkeypatch.setattr)
    epochs = {rid: receiver.expect(rid, prompt) for rid, prompt in REQUESTS}
    sender = KVSender(src, transport)
    try:
        _send(sender, epochs, 1)
        receiver.wait(1, timeout=SLACK)
        with pytest.raises(TransferError) as raised:
            receiver.wait(2, timeout=SLACK)
    finally:
        sender.close()
        close()
    cause = raised.value.__cause__
    assert isinstance(cause, ChecksumError) and cause.block == 2 and hit == [26]
    assert receiver.checksum_failures == 1


def _flipping_cuda_ipc_receiver(conn: Any) -> None:
    """A spawned process: a CUDA receiver behind a cuda-ipc endpoint, sums on, whose
    ``deliver`` flips `FLIPPED`'s byte where it landed. Answers its address, key and the
    requests' epochs, then what became of request 2 (or the error it met)."""
    try:
        checksum.CHECKSUM_DEFAULT["cuda"] = True
        served = serve("cuda-ipc", POOLS.nan("cuda"))
        receiver = served.receiver
        hit = _flip_before_delivery(receiver, setattr)
        epochs = {rid: receiver.expect(rid, prompt) for rid, prompt in REQUESTS}
        conn.send((f"cuda-ipc+{served.endpoint.address}", served.authkey, epochs))
        receiver.wait(1, timeout=SLACK)
        try:
            receiver.wait(2, timeout=SLACK)
            cause: Optional[BaseException] = None
        except TransferError as err:
            cause = err.__cause__
        conn.send(
            {
                "cause": type(cause).__name__,
                "block": getattr(cause, "block", None),
                "request_ids": getattr(cause, "request_ids", None),
                "message": str(cause),
                "hit": hit,
                "failures": receiver.checksum_failures,
            }
        )
        conn.recv()  # the sender is closed: the endpoint may go
        served.close()
    except BaseException as err:  # said to the test, which names it
        conn.send({"error": repr(err)})


@pytest.mark.cuda
def test_cuda_ipc_a_byte_flipped_in_flight_fails_its_request_naming_the_block() -> None:
    """CUDA pools in two processes over cuda-ipc (the connector's direct GPU path): the
    sender sums each block on its copy stream before writing it into the receiver's pool,
    the receiver (another process) sums where it landed; the flipped block fails its
    request by name, and the other request lands."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_flipping_cuda_ipc_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        hello = reply_from(parent, proc, "receiver")
        assert isinstance(hello, tuple), hello
        address, authkey, epochs = hello
        src = POOLS.random(0, "cuda")
        sender = KVSender(src, connect(address, authkey=authkey, src=src), checksum=True)
        try:
            _send(sender, epochs, 1)
            seen = reply_from(parent, proc, "receiver")
        finally:
            sender.close()
        parent.send("closed")
    finally:
        proc.join(timeout=SLACK)
        if proc.is_alive():
            proc.kill()
    assert "error" not in seen, seen
    assert seen["cause"] == "ChecksumError" and seen["block"] == 2 and tuple(seen["request_ids"]) == (2,), seen
    assert seen["hit"] == [26] and seen["failures"] == 1, seen
    assert "request 2: block 2 (destination block 26) arrived with checksum" in seen["message"]
