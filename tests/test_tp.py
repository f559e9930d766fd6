"""Tensor parallelism on the data path, without vLLM: every (prefill TP, decode TP) pair of
{1, 2, 4} where one divides the other, heads split as vLLM splits them (kvferry.ranks).

Each rank's cache is allocated as vLLM 0.32 allocates it (`test_kv_layouts.vllm_views`:
``[B, H, N, C]`` views of one buffer in a layout's physical order) with its own heads of a
random full-heads KV; each decode rank's buffer starts poisoned (0xFF). Every link of
`kvferry.ranks.links` is a real `KVSender` -> `KVReceiver` over head slices of the two
pools (`PagedKV.heads`; whole pools when both hold as many heads), in-process or through a
staging endpoint. Afterwards each decode rank's whole buffer equals the torch reference (the
full KV's blocks, sliced to that rank's heads, at the destination ids; poison elsewhere),
each receiver saw each block exactly once, and nothing stays leased.

Shared-memory endpoints are left out: their pool is one the receiver allocates in shared
memory, not vLLM's cache, so they say nothing about vLLM's per-rank shapes. The CUDA
variants (marked ``cuda``) run the same cases on the GPU: ``pytest -m cuda tests/test_tp.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch
from helpers import SLACK, assert_nothing_leased, decode_worker, reply_from, run_kernel_check
from kvferry.engine import CopyEngine, CudaCopyEngine, ThreadCopyEngine
from kvferry.errors import InvalidArgumentError
from kvferry.layout import LayoutMismatchError, PagedKV
from kvferry.ranks import Link, contributors, feeds, links, rank_heads, stage_slices, staged_links
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.inprocess import InProcessTransport
from test_kv_layouts import BLOCKS, DST_IDS, LAYERS, LAYOUTS, SRC_IDS, TOKENS, Cache, _five_strides, poison, vllm_views

SIZES = (1, 2, 4)
PAIRS = [(p, d) for p in SIZES for d in SIZES]  # in {1, 2, 4} one always divides the other
CONTENT = 2 * 8  # K|V content of head_size 8 (elements)
MLA_CONTENT = 576
RID = 5


# -- the rank map ---------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"P{p[0]}D{p[1]}")
def test_each_decode_head_has_one_source_holding_it(pair: tuple[int, int], heads: int) -> None:
    """Every head of every decode rank comes from exactly one prefill rank, which holds that
    head; a replicated head is sent by the lowest rank holding it."""
    p_tp, d_tp = pair
    all_links = links(p_tp, d_tp, heads)
    for d in range(d_tp):
        dlo, dhi = rank_heads(d, d_tp, heads)
        got = np.zeros(dhi - dlo, dtype=int)
        for link in contributors(d, all_links):
            plo, phi = rank_heads(link.prefill_rank, p_tp, heads)
            (slo, shi), (tlo, thi) = link.src_heads, link.dst_heads
            assert shi - slo == thi - tlo > 0
            assert plo + slo == dlo + tlo and plo + shi == dlo + thi  # the same global heads
            assert 0 <= slo < shi <= phi - plo
            got[tlo:thi] += 1
            holders = [
                p for p in range(p_tp) if rank_heads(p, p_tp, heads)[0] <= dlo + tlo < rank_heads(p, p_tp, heads)[1]
            ]
            assert link.prefill_rank == min(holders)
            assert link.whole == ((plo, phi) == (dlo, dhi))
        assert (got == 1).all(), f"decode rank {d}: heads covered {got.tolist()}"
    assert sum(len(feeds(p, all_links)) for p in range(p_tp)) == len(all_links)


def test_the_rank_map_of_the_module_doc() -> None:
    assert links(2, 4, 8) == (
        Link(0, 0, (0, 2), (0, 2), False),
        Link(0, 1, (2, 4), (0, 2), False),
        Link(1, 2, (0, 2), (0, 2), False),
        Link(1, 3, (2, 4), (0, 2), False),
    )
    assert [(k.prefill_rank, k.dst_heads) for k in links(4, 1, 8)] == [
        (0, (0, 2)),
        (1, (2, 4)),
        (2, (4, 6)),
        (3, (6, 8)),
    ]
    assert links(4, 2, 2) == (Link(0, 0, (0, 1), (0, 1), True), Link(2, 1, (0, 1), (0, 1), True))
    assert links(2, 4, 0, mla=True) == tuple(Link(0, d, (0, 1), (0, 1), True) for d in range(4))
    assert feeds(1, links(2, 4, 1, mla=True)) == ()  # MLA: the latent head leaves rank 0 once per decode rank


@pytest.mark.parametrize(
    ("args", "word"),
    [((3, 2, 8), "prefill_tp=3, decode_tp=2"), ((2, 2, 3), "num_kv_heads=3"), ((0, 1, 8), "prefill_tp=0")],
)
def test_splits_vllm_cannot_make_are_refused_by_name(args: tuple[int, int, int], word: str) -> None:
    with pytest.raises(InvalidArgumentError, match=word):
        links(*args)


def test_heads_refuses_a_range_outside_the_pool() -> None:
    pool = rank_pool(rank_cache("LBHNC", 2, torch.bfloat16, "cpu", poison))
    with pytest.raises(InvalidArgumentError, match=r"heads=\(1, 3\)"):
        pool.heads(1, 3)
    with pytest.raises(InvalidArgumentError, match="paged_kv_from_views"):
        pool.with_layers(pool.layers).heads(0, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_slices_of_one_width_agree_whatever_the_full_count(layout: str) -> None:
    """A 1-head slice of a 4-head pool and the whole of a 1-head pool, and a 2-head slice
    of a 4-head pool and the whole of a 2-head pool, have the same geometry."""
    four = rank_pool(rank_cache(layout, 4, torch.bfloat16, "cpu", poison))
    for width in (1, 2):
        other = rank_pool(rank_cache(layout, width, torch.bfloat16, "cpu", poison))
        for lo in range(0, 4, width):
            four.heads(lo, lo + width).check_compatible(other.heads(0, width))
    with pytest.raises(LayoutMismatchError):
        four.heads(0, 2).check_compatible(four.heads(0, 1))


# -- the transfers --------------------------------------------------------------------------


def full_kv(heads: int, content: int, seed: int) -> torch.Tensor:
    """The model's whole KV as bytes: ``[L, B, heads, N, content]`` int8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (LAYERS, BLOCKS, heads, TOKENS, content), dtype=torch.int8, generator=g)


def rank_cache(
    layout: str, heads: int, dtype: torch.dtype, device: str, fill: Callable, content: int = CONTENT
) -> Cache:
    return vllm_views(layout, heads, content, dtype, device, fill)


def rank_pool(cache: Cache) -> PagedKV:
    from kvferry.layout import paged_kv_from_views

    return paged_kv_from_views(cache.views, num_blocks=BLOCKS, tokens_per_block=TOKENS)


def fill_heads(cache: Cache, full: torch.Tensor, lo: int, hi: int) -> None:
    """Writes heads ``[lo, hi)`` of ``full`` into ``cache``'s views (every block)."""
    with torch.inference_mode():
        for layer, view in enumerate(cache.views):
            view.view(torch.int8).copy_(full[layer, :, lo:hi].to(view.device))


def expected(cache: Cache, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``cache``'s poisoned buffer after blocks ``SRC_IDS`` of heads ``[lo, hi)`` of ``full``
    landed in blocks ``DST_IDS``, by torch indexing on the logical views."""
    want = cache.raw.cpu().clone()
    v = cache.views[0]
    shape = (LAYERS, BLOCKS, *v.shape[1:-1], v.shape[-1] * v.element_size())
    five = torch.as_strided(want, shape, _five_strides(cache))
    for s, d in zip(SRC_IDS, DST_IDS):
        five[:, int(d)] = full[:, int(s), lo:hi]
    return want


def make_engine(device: str) -> CopyEngine:
    return CudaCopyEngine(torch.device(device)) if device == "cuda" else ThreadCopyEngine()


def link_pools(link: Link, src: PagedKV, dst: PagedKV) -> tuple[PagedKV, PagedKV]:
    if link.whole:
        return src, dst
    return src.heads(*link.src_heads), dst.heads(*link.dst_heads)


def send_one(sender: KVSender, epoch: int) -> None:
    """One request of ``len(SRC_IDS)`` blocks in two chunks, flushed."""
    n = len(SRC_IDS)
    sender.add(RID, n * TOKENS, epoch=epoch)
    src_table, dst_table = SRC_IDS[None, :], DST_IDS[None, :]
    half = (n // 2) * TOKENS
    sender.send_chunks([RID], [0], [half], src_table, dst_table)
    sender.send_chunks([RID], [half], [n * TOKENS], src_table, dst_table)
    sender.flush(timeout=SLACK)


def run_link(path: str, src: PagedKV, dst: PagedKV, device: str) -> KVReceiver:
    """One link's request through ``path``; returns its receiver once the request is
    complete and released, the sender and endpoint closed and checked."""
    receiver = KVReceiver(dst)
    epoch = receiver.expect(RID, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS)
    engine = make_engine(device)
    threads = set(threading.enumerate())
    try:
        if path == "inprocess":
            sender = KVSender(src, InProcessTransport(receiver), engine=engine)
            send_one(sender, epoch)
            receiver.wait(RID, timeout=SLACK)
            sender.remove(RID)
            assert_nothing_leased(sender=sender)
            sender.close()
        else:
            from kvferry.transports.nixl import NixlEndpoint, NixlTransport
            from kvferry.transports.staging import StagingEndpoint, StagingTransport

            authkey = secrets.token_bytes(32)
            endpoint: Any
            if path == "nixl":  # the receiver's head slice described by its strides in the hello
                endpoint = NixlEndpoint(receiver, authkey=authkey)
                transport: Any = NixlTransport(endpoint.address, authkey=authkey, src=src)
            else:
                endpoint = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=4)  # wraps around
                transport = StagingTransport(endpoint.address, authkey=authkey)
            try:
                sender = KVSender(src, transport, engine=engine)
                send_one(sender, epoch)
                receiver.wait(RID, timeout=SLACK)
                sender.remove(RID)
                assert_nothing_leased(sender=sender)
                sender.close()
            finally:
                endpoint.close()
            assert_nothing_leased(endpoint=endpoint)
    finally:
        engine.close()
    notices = receiver.notices(RID)
    assert sum(n.end - n.start for n in notices) == len(DST_IDS)  # each block exactly once
    assert receiver.refused_count == 0 and receiver.duplicate_count == 0
    assert receiver.release(RID).is_complete
    assert_nothing_leased(receiver, threads=threads)
    return receiver


def tp_transfer(
    pair: tuple[int, int], layout: str, heads: int, path: str, device: str, *, mla: bool = False
) -> dict[tuple[int, int], int]:
    """Every link of ``pair`` moves its heads; each decode rank's buffer checked whole.
    Returns how many blocks each (prefill rank, decode rank) link moved."""
    p_tp, d_tp = pair
    content = MLA_CONTENT if mla else CONTENT
    dtype = torch.bfloat16
    item = torch.empty((), dtype=dtype).element_size()
    full = full_kv(heads, content * item, seed=heads * 100 + p_tp * 10 + d_tp)

    def span(rank: int, tp: int) -> tuple[int, int]:
        return (0, 1) if mla else rank_heads(rank, tp, heads)

    prefill = []
    for p in range(p_tp):
        lo, hi = span(p, p_tp)
        cache = rank_cache(layout, hi - lo, dtype, device, poison, content)
        fill_heads(cache, full, lo, hi)
        prefill.append(cache)
    decode = [
        rank_cache(layout, span(d, d_tp)[1] - span(d, d_tp)[0], dtype, device, poison, content) for d in range(d_tp)
    ]
    wants = [expected(decode[d], full, *span(d, d_tp)) for d in range(d_tp)]
    moved: dict[tuple[int, int], int] = {}
    for link in links(p_tp, d_tp, heads, mla=mla):
        src, dst = link_pools(link, rank_pool(prefill[link.prefill_rank]), rank_pool(decode[link.decode_rank]))
        run_link(path, src, dst, device)
        key = (link.prefill_rank, link.decode_rank)
        assert key not in moved
        moved[key] = len(DST_IDS)
    for d in range(d_tp):
        got = decode[d].raw.cpu()
        assert_rank_bytes(d, got, wants[d])
    return moved


def assert_rank_bytes(rank: int, got: torch.Tensor, want: torch.Tensor) -> None:
    """Decode rank ``rank``'s whole buffer equals the reference, byte for byte."""
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"decode rank {rank}: {diff.shape[0]} bytes differ, the first at byte {int(diff[0, 0])}"


PATHS = ["inprocess", "staging"]
PAIR_IDS = [f"P{p}D{d}" for p, d in PAIRS]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_cpu_tp_pairs_bit_exact(pair: tuple[int, int], layout: str, path: str) -> None:
    """8 KV heads: every rank holds its own (2 to 8); heterogeneous pairs move head slices,
    head-major (LBHNC, vLLM's CPU layout) as a run inside each block, token-major (LBNHC,
    NHD) as one segment per token."""
    moved = tp_transfer(pair, layout, 8, path, "cpu")
    p_tp, d_tp = pair
    assert len(moved) == max(p_tp, d_tp)  # each decode rank fed by exactly its overlapping prefill ranks


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x not in ("LBHNC", "LBNHC")])
@pytest.mark.parametrize("pair", [(2, 4), (4, 1)], ids=["P2D4", "P4D1"])
def test_cpu_tp_other_layouts_bit_exact(pair: tuple[int, int], layout: str) -> None:
    """vLLM's other physical orders (layer- and block-outer) slice the same way."""
    tp_transfer(pair, layout, 8, "inprocess", "cpu")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pair", [(2, 4), (4, 1), (1, 2)], ids=["P2D4", "P4D1", "P1D2"])
def test_cpu_tp_nixl_head_slices_bit_exact(monkeypatch: pytest.MonkeyPatch, pair: tuple[int, int], layout: str) -> None:
    """NIXL (UCX on loopback) between head slices of every layout: the receiving slice is
    not a packed pool (head-major: one run inside each block; token-major: one segment per
    token; block-outer: both), and the sender addresses it by the strides its hello
    carries. (1, 2) sends a slice of a whole pool into a whole pool."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    moved = tp_transfer(pair, layout, 8, "nixl", "cpu")
    assert len(moved) == max(pair)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", [(4, 2), (2, 4), (4, 1), (1, 4)], ids=["P4D2", "P2D4", "P4D1", "P1D4"])
def test_cpu_replicated_heads_cross_once(pair: tuple[int, int], path: str) -> None:
    """2 KV heads over 4 ranks: each head is on two ranks; only the lowest sends it, once
    per decode rank that needs it."""
    moved = tp_transfer(pair, "LBNHC", 2, path, "cpu")
    p_tp, d_tp = pair
    for p, _d in moved:
        assert p == rank_heads(p, p_tp, 2)[0] * p_tp // 2  # the lowest holder of its head


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", [(2, 1), (1, 2), (2, 4), (4, 2)], ids=["P2D1", "P1D2", "P2D4", "P4D2"])
def test_cpu_mla_moves_once_per_decode_rank(pair: tuple[int, int], path: str) -> None:
    """MLA's latent head is on every rank: prefill rank 0 alone sends it, once per decode
    rank, whole blocks."""
    moved = tp_transfer(pair, "LBHNC", 1, path, "cpu", mla=True)
    assert sorted(moved) == [(0, d) for d in range(pair[1])]


KERNEL_CHECK = """
import numpy as np, torch
from kvferry import _triton_copy
from kvferry.ranks import links, rank_heads
from test_tp import expected, fill_heads, full_kv, link_pools, rank_cache, rank_pool
from test_kv_layouts import DST_IDS, SRC_IDS, poison
ids = torch.from_numpy(np.stack([SRC_IDS, DST_IDS]))
for layout in ("LBHNC", "LBNHC", "BLNHC"):  # head-major, token-major, block-outer
    for p_tp, d_tp in ((1, 2), (4, 1)):
        full = full_kv(8, 32, seed=p_tp * 10 + d_tp)
        pre = []
        for p in range(p_tp):
            lo, hi = rank_heads(p, p_tp, 8)
            c = rank_cache(layout, hi - lo, torch.bfloat16, "cpu", poison)
            fill_heads(c, full, lo, hi)
            pre.append(c)
        dec = [rank_cache(layout, 8 // d_tp, torch.bfloat16, "cpu", poison) for _ in range(d_tp)]
        wants = [expected(dec[d], full, *rank_heads(d, d_tp, 8)) for d in range(d_tp)]
        for link in links(p_tp, d_tp, 8):
            a, b = link_pools(link, rank_pool(pre[link.prefill_rank]), rank_pool(dec[link.decode_rank]))
            assert _triton_copy.supports(a, b), (layout, link)
            _triton_copy.copy_blocks(a, b, ids, _triton_copy.LaunchConfig(32, 16, 4, True))
        for d in range(d_tp):
            assert torch.equal(dec[d].raw, wants[d]), (layout, p_tp, d_tp, d)
print("kernel ok")
"""


def test_fused_kernel_moves_head_slices_under_the_interpreter() -> None:
    """The Triton kernel (`copy_blocks` on CUDA) on CPU under TRITON_INTERPRET=1: head slices
    of head-major, token-major and block-outer pools, bit exact against the reference."""
    pytest.importorskip("triton")
    run_kernel_check(KERNEL_CHECK)


# -- CUDA (run on the GPU machine) ----------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_cuda_tp_pairs_bit_exact(pair: tuple[int, int], layout: str, path: str) -> None:
    tp_transfer(pair, layout, 8, path, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["BLNHC", "BHLNC"])
@pytest.mark.parametrize("pair", [(2, 4), (4, 1)], ids=["P2D4", "P4D1"])
def test_cuda_tp_block_outer_layouts_bit_exact(pair: tuple[int, int], layout: str) -> None:
    """Block-outer pools (the fused copy's strided path) sliced by heads."""
    tp_transfer(pair, layout, 8, "inprocess", "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", [(4, 2), (1, 4)], ids=["P4D2", "P1D4"])
def test_cuda_replicated_heads_cross_once(pair: tuple[int, int], path: str) -> None:
    tp_transfer(pair, "LBNHC", 2, path, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", [(2, 1), (1, 2), (2, 4)], ids=["P2D1", "P1D2", "P2D4"])
def test_cuda_mla_moves_once_per_decode_rank(pair: tuple[int, int], path: str) -> None:
    tp_transfer(pair, "LBNHC", 1, path, "cuda", mla=True)


def _ipc_decode_rank(conn: Any, authkey: bytes, layout: str, heads: int, dst_heads: tuple[int, int]) -> None:
    """A decode rank over CUDA IPC in its own process: a poisoned cache of ``heads`` heads,
    the head slice ``dst_heads`` served; sends back its buffer once the request arrived."""
    from kvferry.transports.cuda_ipc import CudaIpcEndpoint

    cache = rank_cache(layout, heads, torch.bfloat16, "cuda", poison)
    pool = rank_pool(cache)
    receiver = KVReceiver(pool.heads(*dst_heads))
    endpoint = CudaIpcEndpoint(receiver, authkey=authkey)
    epoch = receiver.expect(RID, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS)
    conn.send((endpoint.address, epoch))
    try:
        receiver.wait(RID, timeout=SLACK)
        conn.send(("ok", cache.raw.cpu().numpy()))
    except Exception as err:  # reported to the test, which fails with it
        conn.send(("error", repr(err)))
    conn.recv()
    endpoint.close()


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_cuda_ipc_head_slice_bit_exact(layout: str) -> None:
    """P TP=1 -> D TP=2 over CUDA IPC: decode rank 1's process receives heads [4, 8) of the
    prefill rank's 8, written by the fused copy into its own cache's head slice."""
    from kvferry.transports.cuda_ipc import CudaIpcTransport

    full = full_kv(8, CONTENT * 2, seed=7)  # bf16: 2 bytes an element
    src_cache = rank_cache(layout, 8, torch.bfloat16, "cuda", poison)
    fill_heads(src_cache, full, 0, 8)
    (link,) = [k for k in links(1, 2, 8) if k.decode_rank == 1]
    want = expected(rank_cache(layout, 4, torch.bfloat16, "cpu", poison), full, 4, 8)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    authkey = secrets.token_bytes(32)
    proc = ctx.Process(target=_ipc_decode_rank, args=(child, authkey, layout, 4, link.dst_heads), daemon=True)
    proc.start()
    try:
        address, epoch = reply_from(parent, proc, "decode rank")
        engine = CudaCopyEngine(torch.device("cuda"))
        sender = KVSender(
            rank_pool(src_cache).heads(*link.src_heads), CudaIpcTransport(address, authkey=authkey), engine=engine
        )
        send_one(sender, epoch)
        status, got = reply_from(parent, proc, "decode rank")
        assert status == "ok", got
        diff = (torch.from_numpy(got) != want).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ"
        sender.remove(RID)
        sender.close()
        engine.close()
        parent.send("done")
        proc.join(timeout=SLACK)
    finally:
        if proc.is_alive():
            proc.kill()


# -- the decode worker's parts (no engine; needs vLLM's connector base classes) ---------------


@pytest.fixture
def decode_p2(tmp_path: Any) -> Any:
    """A decode worker of TP 1 over vLLM's token-major cache of 2 KV heads, fed by prefill
    servers of TP 2: one receiver per prefill rank, each over that rank's head."""
    pytest.importorskip("vllm")
    pool = rank_pool(rank_cache("LBNHC", 2, torch.bfloat16, "cpu", poison))
    with decode_worker(
        str(tmp_path), BLOCKS, TOKENS, pool=pool, config={"prefill_tp_size": 2}, num_kv_heads=2
    ) as worker:
        yield worker


def _recv_spec(rid: str, kv: int, transfer: str) -> Any:
    from kvferry.vllm.metadata import RecvSpec

    return RecvSpec(rid, kv, transfer, 2 * TOKENS, [[3, 7]], 0, "d", 60.0)


def test_decode_rank_waits_for_every_prefill_ranks_part(decode_p2: Any) -> None:
    """Published once per prefill rank (``T@p0of2``, ``T@p1of2``), each with its own receiver's
    epoch; a lookup of each part gets an endpoint of its own, and a prefill rank that writes
    nothing here gets none; the request has arrived only once both parts did."""
    from kvferry.notice import Notice
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p2
    assert sorted(worker.receivers) == [(2, 0), (2, 1)]  # (prefill size, prefill rank)
    assert worker.receivers[(2, 0)].pool.check_compatible(worker.common.pool.heads(0, 1)) is None
    spec = _recv_spec("r", 11, "T")
    worker.bind(KvferryMetadata(recvs=[spec]))
    address = worker.rendezvous.address
    dests = [rendezvous.lookup(address, b"k" * 32, f"T@p{p}of2", 5, f"eng@p{p}of2") for p in (0, 1)]
    assert dests[0]["endpoint"] != dests[1]["endpoint"]
    assert [d["epoch"] for d in dests] == [worker.receivers[(2, p)].epoch(11) for p in (0, 1)]
    worker.receivers[(2, 0)].deliver(Notice(11, 0, 0, 2, True, dests[0]["epoch"]))
    assert worker.results(set()) == (set(), set())  # prefill rank 1's head is still missing
    worker.receivers[(2, 1)].deliver(Notice(11, 0, 0, 2, True, dests[1]["epoch"]))
    assert worker.results(set()) == ({"r"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())
    worker.bind(KvferryMetadata(recvs=[_recv_spec("s", 12, "U")]))
    with pytest.raises(Exception, match="prefill rank 5 of 2 writes nothing"):
        rendezvous.lookup(address, b"k" * 32, "U@p0of2", 5, "eng@p5of2")
    # A prefill server of another tensor parallel size is refused at once, not at its timeout.
    with pytest.raises(Exception, match="takes prefill servers of tensor parallel size 2 .* has 4"):
        rendezvous.lookup(address, b"k" * 32, "U@p0of4", 3600, "eng@p0of4")
    with pytest.raises(Exception, match="takes prefill servers of tensor parallel size 2 .* has 1"):
        rendezvous.lookup(address, b"k" * 32, "U", 3600, "eng")


def test_a_lookup_of_a_size_not_configured_waits_for_its_request_to_name_it(decode_p2: Any) -> None:
    """A prefill server of TP 1 pairs with this decode rank though ``prefill_tp_size`` says 2:
    its lookup waits (a router's decode request may name size 1 after the prefill looked up).
    Forced order: the lookup is waiting before each publish. A request that names no size
    publishes size 2's parts: the waiting TP-1 lookup is refused then, naming both sizes. A
    request whose router named size 1 teaches it: the waiting lookup takes its destination."""
    import threading

    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata, RecvSpec

    worker = decode_p2
    rdv = worker.rendezvous
    waiting = {"L": threading.Event(), "M": threading.Event()}
    real_stranger = rdv._stranger

    def stranger(transfer: str, sender: str) -> Any:
        why = real_stranger(transfer, sender)
        if why is None and transfer in waiting:
            waiting[transfer].set()  # under the rendezvous's lock: no publish before it waits
        return why

    rdv._stranger = stranger
    answers: dict[str, Any] = {}

    def look(name: str) -> None:
        try:
            answers[name] = rendezvous.lookup(rdv.address, KEY, name, 60, "eng1")
        except Exception as err:  # the refusal, asserted below
            answers[name] = err

    threads = {name: threading.Thread(target=look, args=(name,)) for name in waiting}
    threads["L"].start()
    assert waiting["L"].wait(30)
    worker.bind(KvferryMetadata(recvs=[_recv_spec("l", 31, "L")]))
    threads["L"].join(30)
    assert isinstance(answers["L"], Exception), answers["L"]
    assert "takes prefill servers of tensor parallel size 2" in str(answers["L"]) and "has 1" in str(answers["L"])
    threads["M"].start()
    assert waiting["M"].wait(30)
    worker.bind(KvferryMetadata(recvs=[RecvSpec("m", 33, "M", 2 * TOKENS, [[1, 2]], 0, "d", 60.0, prefill_tp=1)]))
    threads["M"].join(30)
    assert isinstance(answers["M"], dict) and answers["M"]["epoch"] == worker.receivers[(1, 0)].epoch(33)
    assert worker.sizes == (2, 1)


def test_a_part_revoked_by_its_preempted_sender_is_offered_again(decode_p2: Any) -> None:
    """Prefill rank 0 revokes its part of R (its engine preempted the request): at the next
    step that part is expected again under a new epoch and offered again to rank 0 only;
    rank 1's part goes on under its epoch. R arrives once rank 0 wrote its part again; a
    notice of the revoked epoch is refused as stale."""
    from kvferry.notice import Notice
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p2
    worker.bind(KvferryMetadata(recvs=[_recv_spec("r", 41, "R")]))
    address = worker.rendezvous.address
    dests = [rendezvous.lookup(address, KEY, f"R@p{p}of2", 5, f"eng@p{p}of2") for p in (0, 1)]
    assert worker.receivers[(2, 0)].revoked(41, dests[0]["epoch"])
    assert worker.results(set()) == (set(), set())  # not failed: offered again
    with pytest.raises(Exception, match="taken by another prefill engine"):
        rendezvous.lookup(address, KEY, "R@p0of2", 5, "other@p0of2")
    again = rendezvous.lookup(address, KEY, "R@p0of2", 5, "eng@p0of2")
    assert again["epoch"] > dests[0]["epoch"] and again["dst_blocks"] == dests[0]["dst_blocks"]
    assert worker.tally.totals["reoffered_parts"] == 1
    assert worker.receivers[(2, 0)].deliver(Notice(41, 0, 0, 2, True, dests[0]["epoch"])) is False  # stale
    worker.receivers[(2, 1)].deliver(Notice(41, 0, 0, 2, True, dests[1]["epoch"]))
    assert worker.results(set()) == (set(), set())  # rank 0's part, sent again, still missing
    worker.receivers[(2, 0)].deliver(Notice(41, 0, 0, 2, True, again["epoch"]))
    assert worker.results(set()) == ({"r"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())


def test_a_part_whose_other_group_failed_otherwise_is_not_offered_again(decode_p2: Any) -> None:
    """A part of several KV cache groups: its first group's request was revoked by its sender,
    its second failed otherwise (here: refused). The request is not offered again (it gives
    up); before, the first revoked group decided for the whole part."""
    from kvferry.errors import TransferError
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p2
    worker.bind(KvferryMetadata(recvs=[_recv_spec("g", 45, "G")]))
    for p in (0, 1):
        rendezvous.lookup(worker.rendezvous.address, KEY, f"G@p{p}of2", 5, f"eng@p{p}of2")

    class TwoGroups:  # receiver (2, 0) as two groups' requests 45 and 46 stand
        def wait(self, kv: int, timeout: float) -> None:
            raise TransferError(f"request {kv} failed")

        def revoked_by_sender(self, kv: int) -> bool:
            return kv == 45  # 46 failed for another reason

    real = worker.receivers[(2, 0)]
    worker.receivers[(2, 0)] = TwoGroups()
    try:
        st = worker._recv["g"]
        assert worker._offer_again(st, st.live(), [45, 46], 0.0) is False
        assert worker.rendezvous.taker("G@p0of2") == "eng@p0of2"  # nothing offered again
    finally:
        worker.receivers[(2, 0)] = real


def test_an_abandoned_part_fails_the_request_and_frees_every_part(decode_p2: Any) -> None:
    """Prefill rank 1 gives its part up before writing; rank 0 had taken its part: the request
    fails, rank 1's part is freed at once, rank 0's at its sender's fence."""
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p2
    worker.bind(KvferryMetadata(recvs=[_recv_spec("r", 21, "T")]))
    dest = rendezvous.lookup(worker.rendezvous.address, b"k" * 32, "T@p0of2", 5, "eng@p0of2")
    rendezvous.abandon(worker.rendezvous.address, b"k" * 32, "T@p1of2", "preempted")
    assert worker.results(set()) == (set(), set())  # given up; rank 0's part waits for its fence
    assert len(worker.receivers[(2, 1)]) == 0 and len(worker.receivers[(2, 0)]) == 1
    worker.receivers[(2, 0)].revoked(21, dest["epoch"])  # rank 0's sender fences it
    assert worker.results(set()) == ({"r"}, {"r"})
    assert all(len(r) == 0 for r in worker.receivers.values())


# -- one decode server taking prefill servers of several tensor parallel sizes -----------------

KEY = b"k" * 32


@pytest.fixture
def decode_p12(tmp_path: Any, request: pytest.FixtureRequest) -> Any:
    """A decode worker of TP 1 over vLLM's token-major cache of 2 KV heads (poisoned), taking
    prefill servers of TP 1 and TP 2 (``prefill_tp_size [1, 2]``, or the order a test gives
    indirectly: the order its parts are published and released in): a receiver over the whole
    pool for the TP-1 servers' one rank, one over each head for the TP-2 servers' two."""
    pytest.importorskip("vllm")
    cache = rank_cache("LBNHC", 2, torch.bfloat16, "cpu", poison)
    sizes = getattr(request, "param", [1, 2])
    with decode_worker(
        str(tmp_path), BLOCKS, TOKENS, pool=rank_pool(cache), config={"prefill_tp_size": sizes}, num_kv_heads=2
    ) as worker:
        worker.cache = cache
        yield worker


def _landed(cache: Cache, full: torch.Tensor, moves: list[tuple[int, int]]) -> torch.Tensor:
    """``cache``'s poisoned buffer after each ``(src, dst)`` block of ``full`` (every head)
    landed at ``dst``, by torch indexing on the logical views."""
    want = cache.raw.cpu().clone()
    v = cache.views[0]
    five = torch.as_strided(
        want, (LAYERS, BLOCKS, *v.shape[1:-1], v.shape[-1] * v.element_size()), _five_strides(cache)
    )
    for src, dst in moves:
        five[:, dst] = full[:, src]
    return want


def _send(pool: PagedKV, dest: dict[str, Any], src: list[int]) -> KVSender:
    """A prefill rank's send of one request into ``dest`` (a looked-up destination) from its
    blocks ``src``, as the prefill worker does it: over the destination's endpoint, one chunk,
    flushed; the sender closed once the receiver holds every block (the caller waits)."""
    from kvferry.transports import registry

    sender = KVSender(pool, registry.connect(dest["endpoint"], authkey=KEY, src=pool))
    n = len(src)
    sender.add(dest["request_id"], n * TOKENS, epoch=dest["epoch"])
    dst = np.array(dest["dst_blocks"])[None, :]
    sender.send_chunks([dest["request_id"]], [0], [n * TOKENS], np.array(src)[None, :], dst)
    sender.flush(timeout=SLACK)
    return sender


def test_one_decode_rank_takes_a_tp1_and_a_tp2_prefill_server_bit_exact(decode_p12: Any) -> None:
    """``prefill_tp_size [1, 2]``: request A comes from a TP-1 prefill rank (whole blocks, into
    the whole-pool receiver), request B from a TP-2 pair (each rank's head into its slice),
    through the worker's own staging endpoints. The buffer, poisoned before, ends equal to the
    torch reference (A's and B's blocks at their destinations, poison elsewhere); each part of
    the size that sent holds each block exactly once, the other size's receivers got nothing;
    each request's bytes count one size's parts; nothing stays leased."""
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata, RecvSpec

    worker = decode_p12
    assert sorted(worker.receivers) == [(1, 0), (2, 0), (2, 1)]
    assert worker.receivers[(1, 0)].pool is worker.common.pool  # TP 1 -> TP 1: whole blocks
    item = torch.empty((), dtype=torch.bfloat16).element_size()
    full = full_kv(2, CONTENT * item, seed=12)
    tp1 = rank_cache("LBNHC", 2, torch.bfloat16, "cpu", poison)
    fill_heads(tp1, full, 0, 2)
    tp2 = [rank_cache("LBNHC", 1, torch.bfloat16, "cpu", poison) for _ in range(2)]
    for p, cache in enumerate(tp2):
        fill_heads(cache, full, p, p + 1)
    src_a, dst_a, src_b, dst_b = [7, 2, 9], [3, 10, 1], [0, 4, 11], [6, 8, 5]
    specs = [
        RecvSpec("a", 31, "A", 3 * TOKENS, [dst_a], 0, "d", 60.0),
        RecvSpec("b", 41, "B", 3 * TOKENS, [dst_b], 0, "d", 60.0),
    ]
    ended: list[tuple[str, str, Any]] = []
    real_ended = worker.common.ended
    worker.common.ended = lambda side, transfer, rid, state, error=None, **landed: (
        ended.append((transfer, state, landed.get("nbytes"))),
        real_ended(side, transfer, rid, state, error, **landed),
    )
    worker.bind(KvferryMetadata(recvs=specs))
    address = worker.rendezvous.address
    dest_a = rendezvous.lookup(address, KEY, "A", 5, "eng1")
    dest_b = [rendezvous.lookup(address, KEY, f"B@p{p}of2", 5, f"eng2@p{p}of2") for p in (0, 1)]
    assert dest_a["epoch"] == worker.receivers[(1, 0)].epoch(31)
    assert [d["epoch"] for d in dest_b] == [worker.receivers[(2, p)].epoch(41) for p in (0, 1)]
    senders = [_send(rank_pool(tp1), dest_a, src_a)]
    senders += [_send(rank_pool(tp2[p]).heads(0, 1), dest_b[p], src_b) for p in (0, 1)]
    for part, kv in [((1, 0), 31), ((2, 0), 41), ((2, 1), 41)]:
        worker.receivers[part].wait(kv, timeout=SLACK)
        assert sum(n.end - n.start for n in worker.receivers[part].notices(kv)) == 3  # each block once
    # Not yet seen by the worker: the other size's parts still expected, nothing written there.
    assert worker.receivers[(1, 0)].notices(41) == []
    assert worker.receivers[(2, 0)].notices(31) == [] and worker.receivers[(2, 1)].notices(31) == []
    assert worker.results(set()) == ({"a", "b"}, set())
    block = worker.common.pool.block_bytes * LAYERS
    assert sorted(ended) == [("A", "done", 3 * block), ("B", "done", 3 * block)]
    for sender, kv in zip(senders, [31, 41, 41]):
        sender.remove(kv)
        assert_nothing_leased(sender=sender)
        sender.close()
    for receiver in worker.receivers.values():
        assert receiver.refused_count == 0 and receiver.duplicate_count == 0
        assert_nothing_leased(receiver)
    for served in worker.endpoints.values():
        assert_nothing_leased(endpoint=served.endpoint)
    want = _landed(worker.cache, full, list(zip(src_a, dst_a)) + list(zip(src_b, dst_b)))
    diff = (worker.cache.raw != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, the first at byte {int(diff[0, 0])}"


def test_a_request_taken_by_one_size_refuses_the_others_lookups(decode_p12: Any) -> None:
    """The first lookup of C (prefill TP 2, rank 0) chooses size 2: a lookup of C's TP-1
    name is refused, naming the size that took it; a TP-1 engine cannot take a TP-2 name
    either; the TP-1 part is released at the next step (a write into it is refused), nothing
    of it was written, and an abandon of its name does not fail C. C arrives from the TP-2
    parts alone. A prefill server of a size not listed is refused naming the list."""
    from kvferry.notice import Notice
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p12
    before = worker.cache.raw.clone()
    worker.bind(KvferryMetadata(recvs=[_recv_spec("c", 51, "C")]))
    address = worker.rendezvous.address
    epoch1 = worker.receivers[(1, 0)].epoch(51)
    dest0 = rendezvous.lookup(address, KEY, "C@p0of2", 5, "eng2@p0of2")
    with pytest.raises(
        Exception, match="ended on the decode server: .* taken by prefill servers of tensor parallel size 2, not 1"
    ):
        rendezvous.lookup(address, KEY, "C", 5, "eng1")
    with pytest.raises(
        Exception, match="a name for prefill servers of tensor parallel size 2; prefill engine 'eng1' has 1"
    ):
        rendezvous.lookup(address, KEY, "C@p1of2", 5, "eng1")
    with pytest.raises(Exception, match=r"takes prefill servers of tensor parallel sizes \[1, 2\] .* has 4"):
        rendezvous.lookup(address, KEY, "C@p0of4", 3600, "eng4@p0of4")
    assert worker.results(set()) == (set(), set())  # the choice seen: the TP-1 part released
    assert len(worker.receivers[(1, 0)]) == 0
    # No write can land in it any more: a notice of its epoch is dropped as stale.
    assert worker.receivers[(1, 0)].deliver(Notice(51, 0, 0, 2, True, epoch1)) is False
    assert [d.request_id for d in worker.receivers[(1, 0)].discarded()] == [51] and len(worker.receivers[(1, 0)]) == 0
    rendezvous.abandon(address, KEY, "C", "a TP-1 prefill server gave its copy up")
    assert worker.results(set()) == (set(), set())  # not C's chosen size: C goes on
    dest1 = rendezvous.lookup(address, KEY, "C@p1of2", 5, "eng2@p1of2")  # the refusal took nothing
    worker.receivers[(2, 0)].deliver(Notice(51, 0, 0, 2, True, dest0["epoch"]))
    assert worker.results(set()) == (set(), set())  # rank 1's head is still missing
    worker.receivers[(2, 1)].deliver(Notice(51, 0, 0, 2, True, dest1["epoch"]))
    assert worker.results(set()) == ({"c"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())
    assert torch.equal(worker.cache.raw, before)  # notices only: no byte written by anyone


def test_a_size_chosen_between_two_publishes_withdraws_the_later_names(decode_p12: Any) -> None:
    """The race of a lookup against the engine thread's publishing: a TP-1 lookup takes E
    right after E's TP-1 name is published, before its TP-2 names are (forced: the lookup runs
    from inside the publishing). The TP-2 names are then never handed out: a lookup of one
    is refused; their parts are released at the next step; E arrives from its TP-1 part."""
    from kvferry.notice import Notice
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p12
    address = worker.rendezvous.address
    real_publish = worker.rendezvous.publish
    taken: list[dict[str, Any]] = []

    def publish(name: str, destination: dict[str, Any], **kw: Any) -> None:
        real_publish(name, destination, **kw)
        if name == "E":
            taken.append(rendezvous.lookup(address, KEY, "E", 5, "eng1"))

    worker.rendezvous.publish = publish
    worker.bind(KvferryMetadata(recvs=[_recv_spec("e", 61, "E")]))
    assert len(taken) == 1
    with pytest.raises(Exception, match="taken by prefill servers of tensor parallel size 1, not 2"):
        rendezvous.lookup(address, KEY, "E@p0of2", 5, "eng2@p0of2")
    assert worker.results(set()) == (set(), set())
    assert len(worker.receivers[(2, 0)]) == 0 and len(worker.receivers[(2, 1)]) == 0
    worker.receivers[(1, 0)].deliver(Notice(61, 0, 0, 2, True, taken[0]["epoch"]))
    assert worker.results(set()) == ({"e"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())


def test_given_up_before_any_lookup_releases_every_size(decode_p12: Any) -> None:
    """H, aborted before any lookup: every part of both sizes released in that step (reported
    aborted, not failed), each of its names refused after."""
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_p12
    worker.bind(KvferryMetadata(recvs=[_recv_spec("h", 71, "H")]))
    assert all(len(r) == 1 for r in worker.receivers.values())
    assert worker.results({"h"}) == ({"h"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())
    for name, sender in [("H", "eng1"), ("H@p0of2", "eng2@p0of2"), ("H@p1of2", "eng2@p1of2")]:
        with pytest.raises(Exception, match="ended on the decode server"):
            rendezvous.lookup(worker.rendezvous.address, KEY, name, 5, sender)


# (published first, then the lookup that sneaks in after its release, taking a name of the
# other size: the part that then waits for its fence), per order of prefill_tp_size.
SNEAKS = {
    "1-then-2": ([1, 2], "F", ("F@p0of2", "eng2@p0of2"), (2, 0)),
    "2-then-1": ([2, 1], "F@p0of2", ("F", "eng1"), (1, 0)),
}


@pytest.mark.parametrize(
    ("decode_p12", "sneak"), [(v[0], k) for k, v in SNEAKS.items()], indirect=["decode_p12"], ids=list(SNEAKS)
)
def test_a_lookup_racing_a_give_up_waits_for_its_fence_and_the_rest_go_at_once(decode_p12: Any, sneak: str) -> None:
    """F, aborted; while the worker releases its parts one by one, a lookup of the other size
    takes one of F's names right after the worker released the first part (forced: the lookup
    runs from inside that release). That size is then chosen: its taken part waits for its
    sender's fence; every other part goes at once (its name untaken, or of the size not
    chosen and so never handed out), not at the fence timeout; then F is reported (aborted,
    not failed) and nothing stays expected."""
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    _, first, (name, sender), fenced = SNEAKS[sneak]
    worker = decode_p12
    address = worker.rendezvous.address
    worker.bind(KvferryMetadata(recvs=[_recv_spec("f", 81, "F")]))
    real_withdraw = worker.rendezvous.withdraw_untaken
    taken: list[dict[str, Any]] = []

    def withdraw_untaken(withdrawn: str, reason: str) -> bool:
        done = real_withdraw(withdrawn, reason)
        if withdrawn == first:
            taken.append(rendezvous.lookup(address, KEY, name, 5, sender))
        return done

    worker.rendezvous.withdraw_untaken = withdraw_untaken
    assert worker.results({"f"}) == (set(), set())  # the taken part waits for its fence
    assert len(taken) == 1
    assert {part: len(r) for part, r in worker.receivers.items()} == {
        part: int(part == fenced) for part in worker.receivers
    }
    worker.receivers[fenced].revoked(81, taken[0]["epoch"])  # its sender fences it
    assert worker.results(set()) == ({"f"}, set())
    assert all(len(r) == 0 for r in worker.receivers.values())


@pytest.mark.parametrize(
    ("value", "word"),
    [
        ([1, 2, 1], r"prefill_tp_size=\[1, 2, 1\]: lists \[1\] more than once"),
        ([1, "2"], r"prefill_tp_size=\[1, '2'\]: must be a positive integer or a non-empty list"),
        ([], r"prefill_tp_size=\[\]: must be"),
        ([2, True], r"prefill_tp_size=\[2, True\]: must be"),
        (0, r"prefill_tp_size=0: must be"),
        ("2", r"prefill_tp_size='2': must be"),
    ],
)
def test_a_list_of_prefill_tp_sizes_is_checked_by_name(value: Any, word: str) -> None:
    pytest.importorskip("vllm")
    from kvferry.vllm.config import ConnectorConfig

    with pytest.raises(InvalidArgumentError, match=word):
        ConnectorConfig.from_extra({"prefill_tp_size": value})
    assert ConnectorConfig.from_extra({"prefill_tp_size": [2, 1]}).prefill_tp_sizes == (2, 1)
    assert ConnectorConfig.from_extra({"prefill_tp_size": 2}).prefill_tp_sizes == (2,)


def test_a_listed_prefill_tp_size_that_does_not_pair_is_refused_by_name(tmp_path: Any) -> None:
    """A decode server of TP 2 told its prefill servers run TP 1 or TP 3: refused at startup,
    naming the key, the list and the size that does not pair."""
    pytest.importorskip("vllm")
    from kvferry.errors import KvFerryError
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(
        ConnectorConfig.from_extra({"rendezvous_dir": str(tmp_path), "prefill_tp_size": [1, 3]}),
        block_size=TOKENS,
        num_blocks=BLOCKS,
        authkey=KEY,
        tp_size=2,
        num_kv_heads=2,
    )
    common.pool = rank_pool(rank_cache("LBHNC", 1, torch.bfloat16, "cpu", poison))
    with pytest.raises(
        KvFerryError, match=r"prefill_tp_size=\[1, 3\] with this server's tensor_parallel_size=2: its size 3: "
    ):
        DecodeWorker(common).start()


def _vllm_config(tmp_path: Any, pp: int, tp: int = 1, extra: Any = None, role: str = "kv_consumer") -> Any:
    from types import SimpleNamespace

    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))  # a key file of one repeated byte is refused
    key.chmod(0o600)
    transfer = SimpleNamespace(
        kv_connector_extra_config={"authkey_file": str(key), **(extra or {})}, kv_role=role, engine_id="e"
    )
    model = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2, get_total_num_hidden_layers=lambda: 4)
    return SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        model_config=model,
        cache_config=SimpleNamespace(block_size=TOKENS),
    )


def test_pipeline_parallelism_off_a_prefill_server_is_refused_by_name(tmp_path: Any) -> None:
    """A decode (or kv_both) server with pipeline stages: refused at startup, naming the role."""
    pytest.importorskip("vllm")
    from kvferry.vllm.connector import KvferryConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(InvalidArgumentError, match="invalid pipeline_parallel_size=2 with kv_role='kv_consumer'"):
        KvferryConnector(_vllm_config(tmp_path, pp=2, tp=2), KVConnectorRole.SCHEDULER)


def test_a_prefill_tp_size_that_does_not_divide_is_refused_by_name(tmp_path: Any) -> None:
    """A decode server of TP 2 told its prefill servers run TP 3: refused at startup."""
    pytest.importorskip("vllm")
    from kvferry.errors import KvFerryError
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(
        ConnectorConfig(rendezvous_dir=str(tmp_path), prefill_tp_size=3),
        block_size=TOKENS,
        num_blocks=BLOCKS,
        authkey=b"k" * 32,
        tp_size=2,
        num_kv_heads=2,
    )
    common.pool = rank_pool(rank_cache("LBHNC", 1, torch.bfloat16, "cpu", poison))
    with pytest.raises(KvFerryError, match="prefill_tp_size=3 with this server's tensor_parallel_size=2"):
        DecodeWorker(common).start()


def test_the_hello_names_every_decode_rank_and_signs_them_together(tmp_path: Any) -> None:
    """A TP-2 decode server's hello: both ranks' rendezvous in rank order, one signature over
    both; a prefill scheduler plans one link per (prefill rank, decode rank) from it."""
    pytest.importorskip("vllm")
    from kvferry.errors import KvFerryError
    from kvferry.vllm import trust
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import Handshake
    from kvferry.vllm.scheduler import SchedulerSide

    key = b"k" * 32

    def side(tp: int) -> Any:
        return SchedulerSide(
            ConnectorConfig(),
            block_size=TOKENS,
            role="kv_both",
            engine_id="e",
            kv_cache_manager_getter=None,
            authkey=key,
            tp_size=tp,
            num_kv_heads=2,
        )

    decode = side(2)
    decode.set_handshakes({1: Handshake("e1", "unix:///r/b.sock"), 0: Handshake("e0", "unix:///r/a.sock")})
    hello = decode._hello()
    assert hello["peer"] == "unix:///r/a.sock unix:///r/b.sock" and hello["engine"] == "e0"
    assert trust.check_peer(key, (), hello["peer"], hello["peer_mac"]) == hello["peer"]
    with pytest.raises(trust.UntrustedPeerError):  # the ranks swapped: not what was signed
        trust.check_peer(key, (), "unix:///r/b.sock unix:///r/a.sock", hello["peer_mac"])
    assert trust.check_peer(key, ("unix:///r/a.sock", "unix:///r/b.sock"), hello["peer"], None)
    with pytest.raises(trust.UntrustedPeerError):  # trusted_peers must list every rank's
        trust.check_peer(key, ("unix:///r/a.sock",), hello["peer"], None)
    plan = side(2)._plan(hello["peer"])
    assert plan is not None and [(k.prefill_rank, k.decode_rank, a) for k, a in plan] == [
        (0, 0, "unix:///r/a.sock"),
        (1, 1, "unix:///r/b.sock"),
    ]
    assert side(1)._plan("unix:///r/a.sock") is None  # one rank each side: one lookup, as before
    assert [k.prefill_rank for k, _ in side(2)._plan("unix:///r/a.sock") or ()] == [0, 1]
    with pytest.raises(KvFerryError, match="3 tensor-parallel ranks"):
        side(2)._plan("unix:///a unix:///b unix:///c")


# -- tensor parallelism with HMA: two KV cache groups over the same regions -------------------

# vLLM's hybrid layout (kvferry.groups): each group's layer j overlays region j of one
# allocation, one block pool for both groups. A sliding-window group (W=20) and a
# full-attention group, 3 regions of 16-token blocks; a prompt of 70 tokens is 5 blocks.
HMA_P, HMA_W, HMA_REUSED, HMA_HELD = 70, 20, 32, 1  # prefill prefix hit 2 blocks, decode 1
HMA_CHUNKS = [(32, 48), (48, 70)]
# The tables, disjoint ids of one pool of BLOCKS; the window group's blocks that left the
# window are vLLM's null block 0 (its live window is [3, 5)).
HMA_SRC = [[0, 0, 0, 7, 2], [9, 4, 11, 1, 5]]
HMA_DST = [[0, 0, 0, 3, 10], [8, 6, 1, 9, 2]]
HMA_MOVES = [[3, 4], [1, 2, 3, 4]]  # per group: the window; every block but the held one
HMA_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4), (4, 1), (1, 4)]


def hma_groups() -> Any:
    from kvferry.groups import Group, GroupSet

    sw = Group(0, tuple(f"l{2 * j}" for j in range(LAYERS)), HMA_W, "SlidingWindowSpec")
    fa = Group(1, tuple(f"l{2 * j + 1}" for j in range(LAYERS)), None, "FullAttentionSpec")
    return GroupSet((sw, fa), TOKENS)


def hma_pool(cache: Cache, groups: Any) -> PagedKV:
    """The rank's pool as the connector builds it: `groups.pool_layers` over every group's
    layers, each view shared by the groups' layers of its region."""
    from kvferry.groups import pool_layers
    from kvferry.layout import paged_kv_from_views

    views = {name: cache.views[j] for g in groups.groups for j, name in enumerate(g.layers)}
    regions, _ = pool_layers(views, groups.groups, lambda n: int(n[1:]))
    return paged_kv_from_views([views[n] for n in regions], num_blocks=BLOCKS, tokens_per_block=TOKENS)


def hma_expected(cache: Cache, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A decode rank's poisoned buffer after each group's moved blocks landed, every region
    of them, heads ``[lo, hi)``: the null block, the held block and the rest stay poison."""
    want = cache.raw.cpu().clone()
    v = cache.views[0]
    shape = (LAYERS, BLOCKS, *v.shape[1:-1], v.shape[-1] * v.element_size())
    five = torch.as_strided(want, shape, _five_strides(cache))
    for g, moves in enumerate(HMA_MOVES):
        for i in moves:
            five[:, HMA_DST[g][i]] = full[:, HMA_SRC[g][i], lo:hi]
    return want


def hma_link(groups: Any, src: PagedKV, dst: PagedKV, base: int, device: str) -> dict[int, list[int]]:
    """One link as the workers drive it: the decode rank's receiver of that prefill rank
    expects every group (`expect_groups`, as `DecodeWorker._expect`), the prefill rank's
    hook adds them from the published destination (`add_groups`, as `PrefillWorker._start`)
    and sends chunk by chunk (the tables so far, the early send, each chunk after its
    forward). Returns the blocks each group's notices covered, every lease released."""
    from kvferry.groups import add_groups, expect_groups
    from kvferry.hook import TransferHook

    receiver = KVReceiver(dst)
    sender = KVSender(src, InProcessTransport(receiver), engine=make_engine(device), record=True)
    hook = TransferHook(sender)
    epoch = expect_groups(receiver, groups, base, HMA_P, HMA_HELD, HMA_DST)
    destination = {"dst_blocks": [b for t in HMA_DST for b in t], "held_blocks": HMA_HELD, "epoch": epoch}
    add_groups(hook, groups, base, HMA_P, HMA_REUSED, destination)
    kvs = groups.kv_ids(base)
    for kv, table in zip(kvs, HMA_SRC):
        hook.update_src_blocks(kv, table[: HMA_REUSED // TOKENS + 1])
    hook.before_forward(kvs)
    for start, end in HMA_CHUNKS:
        for kv, table in zip(kvs, HMA_SRC):
            hook.update_src_blocks(kv, table)
        if end == HMA_P:
            groups.check_live(HMA_SRC, HMA_P, "the prefill request")
        hook.after_forward(kvs, [start] * len(kvs), [end] * len(kvs))
    for kv in kvs:
        receiver.wait(kv, timeout=SLACK)
    sender.flush(timeout=SLACK)
    assert sender.records is not None
    sent: dict[int, list[int]] = {g: [] for g in range(len(kvs))}
    for rec in sender.records:
        for n in rec.notices:
            sent[n.request_id - base] += list(range(n.start, n.end))
    got = {g: sorted(sum((list(range(n.start, n.end)) for n in receiver.notices(kv)), [])) for g, kv in enumerate(kvs)}
    assert got == {g: sorted(b) for g, b in sent.items()}  # the receiver saw what was sent, once
    assert receiver.refused_count == 0 and receiver.duplicate_count == 0
    for kv in kvs:
        hook.finish(kv)
        assert receiver.release(kv).is_complete
    assert_nothing_leased(receiver, sender=sender)
    sender.close()
    return sent


HMA_KINDS = ["LBHNC", "LBNHC", "MLA"]  # head-major, token-major; MLA: the latent head on every rank


@pytest.mark.parametrize("kind", HMA_KINDS)
@pytest.mark.parametrize("pair", HMA_PAIRS, ids=[f"P{p}D{d}" for p, d in HMA_PAIRS])
def test_tp_with_hma_moves_each_groups_head_slices_once(pair: tuple[int, int], kind: str) -> None:
    """Tensor parallelism and HMA together: every link (prefill rank -> decode rank, a head
    slice when the two split 4 heads differently; MLA's one latent head whole, from prefill
    rank 0) moves both groups of a request, each as its own kvferry request (kv id
    ``base + g``, epoch ``epoch + g`` of that link's receiver) over the regions the groups
    share. Each decode rank's whole buffer equals the reference (poison outside what moved:
    the null block, the held block, the window's dropped blocks are never written), and each
    (group, block, decode rank) head crosses exactly once: from the one prefill rank holding
    it."""
    hma_tp(pair, kind, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", HMA_KINDS)
@pytest.mark.parametrize("pair", HMA_PAIRS, ids=[f"P{p}D{d}" for p, d in HMA_PAIRS])
def test_cuda_tp_with_hma_moves_each_groups_head_slices_once(pair: tuple[int, int], kind: str) -> None:
    """The same on the GPU: CUDA caches, `kvferry.engine.CudaCopyEngine` doing the copies."""
    hma_tp(pair, kind, "cuda")


def hma_tp(pair: tuple[int, int], kind: str, device: str) -> None:
    p_tp, d_tp = pair
    mla = kind == "MLA"
    layout, heads, content = ("LBHNC", 1, MLA_CONTENT) if mla else (kind, 4, CONTENT)

    def span(rank: int, tp: int) -> tuple[int, int]:
        return (0, 1) if mla else rank_heads(rank, tp, heads)

    groups = hma_groups()
    item = torch.empty((), dtype=torch.bfloat16).element_size()
    full = full_kv(heads, content * item, seed=1000 + p_tp * 10 + d_tp)
    prefill = []
    for p in range(p_tp):
        lo, hi = span(p, p_tp)
        cache = rank_cache(layout, hi - lo, torch.bfloat16, device, poison, content)
        fill_heads(cache, full, lo, hi)
        prefill.append(cache)
    width = span(0, d_tp)[1] - span(0, d_tp)[0]
    decode = [rank_cache(layout, width, torch.bfloat16, device, poison, content) for _ in range(d_tp)]
    wants = [hma_expected(decode[d], full, *span(d, d_tp)) for d in range(d_tp)]
    # Per (group, block, decode rank): how many times each of that rank's heads arrived.
    crossed = {(g, i, d): np.zeros(width, dtype=int) for g in range(2) for i in range(5) for d in range(d_tp)}
    base = 100
    for link in links(p_tp, d_tp, heads, mla=mla):
        src, dst = link_pools(
            link, hma_pool(prefill[link.prefill_rank], groups), hma_pool(decode[link.decode_rank], groups)
        )
        sent = hma_link(groups, src, dst, base, device)
        for g, blocks in sent.items():
            for i in blocks:
                crossed[(g, i, link.decode_rank)][slice(*link.dst_heads)] += 1
        base += len(groups)
    for (g, i, d), count in crossed.items():
        want = 1 if i in HMA_MOVES[g] else 0
        assert (count == want).all(), f"group {g} block {i} decode rank {d}: heads crossed {count.tolist()}"
    for d in range(d_tp):
        got = decode[d].raw.cpu()
        assert_rank_bytes(d, got, wants[d])
        v = decode[d].views[0]
        five = torch.as_strided(got, (LAYERS, BLOCKS, *v.shape[1:-1], v.shape[-1] * item), _five_strides(decode[d]))
        assert (five[:, 0] == -1).all()  # vLLM's null block: never written, by any link


# -- pipeline parallelism on the prefill side: each stage's ranks send their layers -----------

# LAYERS = 3: vLLM's partition (get_pp_indices) of 3 layers over 2 stages is [0, 2), [2, 3).
STAGES = {2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}
# (prefill TP, prefill PP, decode TP)
PP_CASES = [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 4), (4, 2, 2), (1, 3, 1), (2, 3, 2)]
PP_IDS = [f"P{t}x{s}D{d}" for t, s, d in PP_CASES]


def test_staged_links_give_each_stage_one_stages_links_under_global_ranks() -> None:
    one = links(2, 4, 8)
    staged = staged_links(2, 3, 4, 8)
    assert len(staged) == 3 * len(one)
    for s in range(3):
        mine = [k for k in staged if k.stage == s]
        assert [(k.prefill_rank - 2 * s, k.decode_rank, k.src_heads, k.dst_heads, k.whole) for k in mine] == [
            (k.prefill_rank, k.decode_rank, k.src_heads, k.dst_heads, k.whole) for k in one
        ]
        assert {k.prefill_rank for k in mine} == {2 * s, 2 * s + 1}  # vLLM's global ranks of stage s
    assert staged_links(2, 1, 4, 8) == one
    with pytest.raises(InvalidArgumentError, match="prefill_pp=0"):
        staged_links(2, 0, 4, 8)


def test_stage_slices_map_each_stage_onto_a_run_of_the_pool() -> None:
    assert stage_slices([0, 1, 2, 3], [(0, 2), (2, 4)]) == [(0, 2), (2, 4)]
    # A pool of the model's attention layers 1, 3, 5, 7 (others hold none): positions, not ids.
    assert stage_slices([1, 3, 5, 7], [(0, 3), (3, 8)]) == [(0, 1), (1, 4)]
    with pytest.raises(InvalidArgumentError, match=r"stage 1 holds the model's layers \[5, 8\)"):
        stage_slices([0, 1, 2, 3], [(0, 2), (5, 8)])  # layers 2-3 in no stage
    with pytest.raises(InvalidArgumentError, match="hold 2 of the pool's 4 layers"):
        stage_slices([0, 1, 2, 3], [(0, 1), (1, 2)])
    with pytest.raises(InvalidArgumentError, match=r"stage 0 holds the model's layers \[2, 4\)"):
        stage_slices([0, 1, 2, 3], [(2, 4), (0, 2)])  # out of order


def pp_transfer(case: tuple[int, int, int], layout: str, path: str, device: str) -> None:
    """Every link of `staged_links` as the connector drives it: the prefill worker of
    (stage, TP rank) sends from its stage's layers of its heads; the decode rank's receiver of
    that link is over its head slice and that stage's run of layers (`stage_slices`, as
    `DecodeWorker.start`). Each decode rank's whole buffer equals the reference: every layer
    of every block arrived once, from the one stage holding it."""
    from kvferry.layout import paged_kv_from_views

    p_tp, pp, d_tp = case
    heads = 8
    dtype = torch.bfloat16
    item = torch.empty((), dtype=dtype).element_size()
    full = full_kv(heads, CONTENT * item, seed=7000 + p_tp * 100 + pp * 10 + d_tp)
    prefill = []
    for p in range(p_tp):  # a stage's pool is its layers of the rank's heads
        lo, hi = rank_heads(p, p_tp, heads)
        cache = rank_cache(layout, hi - lo, dtype, device, poison)
        fill_heads(cache, full, lo, hi)
        prefill.append(cache)
    width = heads // d_tp
    decode = [rank_cache(layout, width, dtype, device, poison) for _ in range(d_tp)]
    wants = [expected(decode[d], full, *rank_heads(d, d_tp, heads)) for d in range(d_tp)]
    layer_runs = stage_slices(range(LAYERS), STAGES[pp])
    moved: dict[tuple[int, int], int] = {}
    for link in staged_links(p_tp, pp, d_tp, heads):
        stage, tp_rank = divmod(link.prefill_rank, p_tp)
        assert stage == link.stage
        # The stage's worker registers its own layers' views (vLLM gives it no others).
        first, end = STAGES[pp][stage]
        views = prefill[tp_rank].views[first:end]
        own = paged_kv_from_views(views, num_blocks=BLOCKS, tokens_per_block=TOKENS)
        src, dst = link_pools(link, own, rank_pool(decode[link.decode_rank]))
        run = layer_runs[stage]
        run_link(path, src, dst.layer_slice(*run), device)
        assert (link.prefill_rank, link.decode_rank) not in moved
        moved[(link.prefill_rank, link.decode_rank)] = run[1] - run[0]
    for d in range(d_tp):
        assert sum(n for (p, dd), n in moved.items() if dd == d) == LAYERS * len(links(p_tp, d_tp, heads)) // d_tp
        got = decode[d].raw.cpu()
        assert_rank_bytes(d, got, wants[d])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("case", PP_CASES, ids=PP_IDS)
def test_cpu_pp_stages_bit_exact(case: tuple[int, int, int], layout: str, path: str) -> None:
    pp_transfer(case, layout, path, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize("case", PP_CASES, ids=PP_IDS)
def test_cuda_pp_stages_bit_exact(case: tuple[int, int, int], layout: str, path: str) -> None:
    if layout == "BLNHC" and path != "inprocess":
        pytest.skip("block-outer layouts: the in-process path only, as test_cuda_tp_block_outer_layouts_bit_exact")
    pp_transfer(case, layout, path, "cuda")


# -- the connector's pipeline-parallel parts (no engine; needs vLLM's connector base classes) --


@pytest.fixture
def decode_pp2(tmp_path: Any) -> Any:
    """A decode worker of TP 1 over 3 layers of 2 KV heads, fed by prefill servers of TP 1 and
    two stages (layers [0, 2) and [2, 3)): one receiver per stage, over its layers."""
    pytest.importorskip("vllm")
    pool = rank_pool(rank_cache("LBNHC", 2, torch.bfloat16, "cpu", poison))
    config = {"prefill_pp_size": 2}
    with decode_worker(
        str(tmp_path), BLOCKS, TOKENS, pool=pool, config=config, num_kv_heads=2, prefill_stages=STAGES[2]
    ) as worker:
        yield worker


def test_decode_rank_waits_for_every_prefill_stages_layers(decode_pp2: Any) -> None:
    """Published once per stage (``T@p0of1x2``, ``T@p1of1x2``: vLLM's global rank, TP size,
    stages), each receiver over that stage's layers; the request has arrived only once both
    stages' parts did. A prefill server of another stage count is refused at once."""
    from kvferry.notice import Notice
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import KvferryMetadata

    worker = decode_pp2
    pool = worker.common.pool
    assert sorted(worker.receivers) == [(1, 0), (1, 1)]  # (prefill TP size, global rank)
    assert worker.receivers[(1, 0)].pool.check_compatible(pool.layer_slice(0, 2)) is None
    assert worker.receivers[(1, 1)].pool.check_compatible(pool.layer_slice(2, 3)) is None
    worker.bind(KvferryMetadata(recvs=[_recv_spec("r", 31, "T")]))
    address = worker.rendezvous.address
    dests = [rendezvous.lookup(address, b"k" * 32, f"T@p{p}of1x2", 5, f"eng@p{p}of1x2") for p in (0, 1)]
    assert dests[0]["endpoint"] != dests[1]["endpoint"]  # each stage's rank writes through its own
    worker.receivers[(1, 1)].deliver(Notice(31, 0, 0, 2, True, dests[1]["epoch"]))
    assert worker.results(set()) == (set(), set())  # stage 0's layers are still missing
    worker.receivers[(1, 0)].deliver(Notice(31, 0, 0, 2, True, dests[0]["epoch"]))
    assert worker.results(set()) == ({"r"}, set())
    worker.bind(KvferryMetadata(recvs=[_recv_spec("s", 32, "U")]))
    for name, sender, stages in (("U", "eng", 1), ("U@p0of1x3", "eng@p0of1x3", 3)):
        with pytest.raises(Exception, match=f"takes prefill servers of pipeline parallel size 2 .* has {stages}"):
            rendezvous.lookup(address, b"k" * 32, name, 3600, sender)


def test_a_stage_partition_that_does_not_fit_the_pool_is_refused_by_name(tmp_path: Any) -> None:
    pytest.importorskip("vllm")
    from kvferry.errors import KvFerryError

    pool = rank_pool(rank_cache("LBNHC", 2, torch.bfloat16, "cpu", poison))
    with pytest.raises(KvFerryError, match=r"cannot map the prefill pipeline stages .* hold 2 of the pool's 3"):
        with decode_worker(str(tmp_path), BLOCKS, TOKENS, pool=pool, config={"prefill_pp_size": 2},
                           num_kv_heads=2, prefill_stages=[(0, 1), (1, 2)]):  # fmt: skip
            pass


def test_a_staged_prefill_scheduler_plans_each_stages_links(tmp_path: Any) -> None:
    """A prefill server of TP 2 and two stages, a decode server of TP 1: four links, each
    stage's two ranks (vLLM's global ranks 0-1, then 2-3) with their heads; the names looked
    up and abandoned carry the global rank and both sizes."""
    pytest.importorskip("vllm")
    from kvferry.vllm.config import ConnectorConfig, RequestParams
    from kvferry.vllm.metadata import leg_name, leg_rank
    from kvferry.vllm.scheduler import SchedulerSide

    side = SchedulerSide(
        ConnectorConfig(),
        block_size=TOKENS,
        role="kv_producer",
        engine_id="e",
        kv_cache_manager_getter=None,
        authkey=b"k" * 32,
        tp_size=2,
        num_kv_heads=2,
        pp_size=2,
    )
    plan = side._plan("unix:///r/a.sock")
    assert plan is not None
    assert [(k.prefill_rank, k.stage, k.dst_heads) for k, _ in plan] == [
        (0, 0, (0, 1)),
        (1, 0, (1, 2)),
        (2, 1, (0, 1)),
        (3, 1, (1, 2)),
    ]
    params = RequestParams(op="send", transfer="T", peer="unix:///r/a.sock")
    assert [name for _, name in side._abandon_targets(params)] == [f"T@p{r}of2x2" for r in range(4)]
    assert leg_rank(leg_name("eng", 3, 2, 2)) == (3, 2, 2)
    assert leg_rank(leg_name("eng", 1, 2)) == (1, 2, 1)
    assert leg_name("eng", 0, 1) == "eng" and leg_rank("eng") is None
    assert leg_name("eng", 1, 1, 2) == "eng@p1of1x2"  # one TP rank, two stages: still marked


def test_pipeline_parallelism_with_several_kv_cache_groups_is_refused_by_name(tmp_path: Any) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvferry.vllm.connector import KvferryConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    class FullAttentionSpec(SimpleNamespace):  # stand-ins named as vLLM's (groups_of reads the name)
        sliding_window = None

    class SlidingWindowSpec(SimpleNamespace):
        extra_retained_tokens = 0

    specs = [(SlidingWindowSpec(sliding_window=64), ["l0", "l2"]), (FullAttentionSpec(), ["l1", "l3"])]
    groups = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=a, layer_names=b, enable_kv_transfer=True) for a, b in specs]
    )
    with pytest.raises(InvalidArgumentError, match="pipeline_parallel_size=2 with 2 KV cache groups"):
        KvferryConnector(_vllm_config(tmp_path, pp=2, role="kv_producer"), KVConnectorRole.SCHEDULER, groups)
    # A decode server told its prefill servers have two stages: the same, by its key.
    config = _vllm_config(tmp_path, pp=1, extra={"prefill_pp_size": 2})
    with pytest.raises(InvalidArgumentError, match="prefill_pp_size=2 with 2 KV cache groups"):
        KvferryConnector(config, KVConnectorRole.SCHEDULER, groups)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_prefill_pp_size_is_checked_by_name(value: Any) -> None:
    pytest.importorskip("vllm")
    from kvferry.vllm.config import ConnectorConfig

    assert (
        ConnectorConfig().prefill_pp_size == 1
        and ConnectorConfig.from_extra({"prefill_pp_size": 4}).prefill_pp_size == 4
    )
    with pytest.raises(InvalidArgumentError, match=rf"invalid kv_connector_extra_config prefill_pp_size={value!r}"):
        ConnectorConfig.from_extra({"prefill_pp_size": value})
