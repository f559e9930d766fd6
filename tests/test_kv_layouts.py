"""vLLM's KV cache layouts through the connector's worker data path, without vLLM.

vLLM 0.32 allocates one buffer for every layer and hands the connector one ``[B, H, N, C]``
view per layer (blocks, KV heads, tokens, K|V content; MLA: one latent head, C = 576), in
the physical order of its resolved ``KVCacheLayout`` (vllm/v1/kv_cache_layout.py; the
views are made by vllm/v1/kv_cache_interface.py ``create_kv_cache_views``). `vllm_views`
makes the same views the same way (checked against vLLM's own stride function where vLLM
is installed), under ``torch.inference_mode`` as vLLM does; `WorkerCommon.register_kv_caches`
registers them; a real transfer between two such pools (in-process, staging; CUDA: the
fused copy, CUDA IPC, staging) must leave the destination buffer equal, byte for byte, to
a torch reference copy of the same blocks on vLLM's logical views: every listed block
exact, and every other byte of the poisoned buffer (other blocks, other layers) untouched.

The CUDA tests are self-contained: ``pytest -m cuda tests/test_kv_layouts.py``.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from helpers import assert_nothing_leased, reply_from, run_kernel_check
from kvferry.copy import copy_blocks
from kvferry.engine import CopyEngine, CudaCopyEngine, ThreadCopyEngine
from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.layout import LayoutMismatchError, PagedKV, paged_kv_from_views
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports.base import Transport, Write
from kvferry.transports.inprocess import InProcessTransport

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (.venv-vllm)")

# vLLM's KVCacheLayout members: the logical axes [L, B, H, N, C] in physical order.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# bf16/fp16 caches; fp8 as vLLM's CUDA backends store it (uint8) and as float8_e4m3fn;
# fp32 (vLLM's CPU backend and Triton attention take it).
DTYPES = [torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.float32]
LAYERS, BLOCKS, TOKENS = 3, 12, 16
ATTN = (2, 2 * 8)  # (KV heads, K|V content of head_size 8)
MLA = (1, 576)  # one latent head: kv_lora_rank 512 + rope 64, no separate V
SRC_IDS = np.array([7, 2, 9, 0, 4, 11])
DST_IDS = np.array([3, 10, 1, 6, 8, 0])
SLACK = 60.0


@dataclass
class Cache:
    """One engine's KV cache as vLLM holds it: the backing buffer and each layer's view."""

    raw: torch.Tensor  # int8, every layer's bytes
    views: list[torch.Tensor]  # [B, H, N, C] per layer, inference tensors

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(self.views)}


def vllm_views(
    layout: str,
    heads: int,
    content: int,
    dtype: torch.dtype,
    device: str,
    fill: Callable,
    *,
    layers: int = LAYERS,
    blocks: int = BLOCKS,
    tokens: int = TOKENS,
) -> Cache:
    """vLLM's allocation (one int8 buffer, zeroed then filled by ``fill``) viewed per layer
    as ``[B, H, N, C]`` with the strides of ``layout``: the innermost physical axis has
    stride 1 and each one outward the product of the sizes inside it."""
    item = torch.empty((), dtype=dtype).element_size()
    shape = (layers, blocks, heads, tokens, content * item)  # C in bytes, as vLLM counts it
    strides = [0] * 5
    step = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = step
        step *= shape[axis]
    with torch.inference_mode():
        raw = torch.zeros(step, dtype=torch.int8, device=device)
        fill(raw)
        five = torch.as_strided(raw, shape, strides)
        views = [five[layer].view(dtype) for layer in range(layers)]
    return Cache(raw, views)


def random_bytes(seed: int) -> Callable[[torch.Tensor], None]:
    def fill(raw: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))

    return fill


def poison(raw: torch.Tensor) -> None:
    raw.fill_(-1)  # 0xFF bytes: a NaN in every float dtype, and no byte a copy leaves


def register(cache: Cache) -> PagedKV:
    """The pool the connector's `WorkerCommon.register_kv_caches` makes of ``cache``."""
    return paged_kv_from_views(cache.views, num_blocks=BLOCKS, tokens_per_block=TOKENS)


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def worker_common(num_blocks: int = BLOCKS) -> Any:
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.worker import WorkerCommon

    return WorkerCommon(ConnectorConfig(), block_size=TOKENS, num_blocks=num_blocks, authkey=b"k" * 32)


def reference(src: Cache, dst: Cache) -> torch.Tensor:
    """The destination buffer after copying block ``SRC_IDS[i]`` of every layer into block
    ``DST_IDS[i]``, by torch indexing on vLLM's logical views."""
    with torch.inference_mode():
        want = dst.raw.clone()
        item = dst.views[0].element_size()
        shape = (LAYERS, BLOCKS, *dst.views[0].shape[1:-1], dst.views[0].shape[-1] * item)
        five = torch.as_strided(want, shape, _five_strides(dst))
        for layer, view in enumerate(src.views):
            for s, d in zip(SRC_IDS, DST_IDS):
                five[layer][int(d)] = view[int(s)].view(torch.int8)
    return want


def _five_strides(cache: Cache) -> tuple[int, ...]:
    v = cache.views[0]
    item = v.element_size()
    layer = (cache.views[1].data_ptr() - v.data_ptr()) if len(cache.views) > 1 else v.numel() * item
    return (layer, *(s * item for s in v.stride()[:-1]), 1)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.cpu() != want.cpu()).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, the first at byte {int(diff[0, 0])}"


def write_through(transport: Transport, engine: CopyEngine, receiver: KVReceiver, src: PagedKV) -> None:
    """One request's blocks through ``transport``: the write, its notice, the receiver's
    completion (a request of ``len(DST_IDS)`` blocks whose lease names its blocks)."""
    rid = 5
    epoch = receiver.expect(rid, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS)
    notice = Notice(rid, 0, 0, len(DST_IDS), True, epoch)
    transport.announce([(rid, epoch)])
    assert transport.write(engine, Write(src, SRC_IDS, DST_IDS, [notice])).wait(SLACK)
    transport.post([notice])
    receiver.wait(rid, timeout=SLACK)
    assert receiver.release(rid).is_complete


def in_process(src: PagedKV, dst: PagedKV, engine: CopyEngine) -> None:
    receiver = KVReceiver(dst)
    write_through(InProcessTransport(receiver), engine, receiver, src)


def staging(src: PagedKV, dst: PagedKV, engine: CopyEngine) -> None:
    from kvferry.transports.staging import StagingEndpoint, StagingTransport

    receiver = KVReceiver(dst)
    authkey = secrets.token_bytes(32)
    endpoint = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=8)
    try:
        transport = StagingTransport(endpoint.address, authkey=authkey)
        try:
            write_through(transport, engine, receiver, src)
        finally:
            transport.close()
    finally:
        endpoint.close()


def fused_copy(src: PagedKV, dst: PagedKV, engine: CopyEngine) -> None:
    copy_blocks(src, dst, SRC_IDS, DST_IDS)
    if src.device.type == "cuda":
        torch.cuda.synchronize(src.device)


CPU_PATHS = {"copy_blocks": fused_copy, "inprocess": in_process, "staging": staging}


def transfer(
    path: Callable[[PagedKV, PagedKV, CopyEngine], None],
    layouts: tuple[str, str],
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: str,
) -> None:
    src = vllm_views(layouts[0], *shape, dtype, device, random_bytes(1))
    dst = vllm_views(layouts[1], *shape, dtype, device, poison)
    want = reference(src, dst)
    engine: CopyEngine = CudaCopyEngine(torch.device(device)) if device == "cuda" else ThreadCopyEngine()
    try:
        path(register(src), register(dst), engine)
    finally:
        engine.close()
    assert_bytes_equal(dst.raw, want)


# -- the views are vLLM's ------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mla", [False, True])
def test_vllm_views_have_vllms_strides(layout: str, mla: bool) -> None:
    """`vllm_views` strides each layer as vLLM's ``compute_layout_strides`` does."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, MLAAttentionSpec, compute_layout_strides

    heads, content = MLA if mla else ATTN
    spec: Any = (
        MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=content, dtype=torch.bfloat16)
        if mla
        else FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=content // 2, dtype=torch.bfloat16)
    )
    want = compute_layout_strides(spec, BLOCKS, LAYERS, KVCacheLayout[layout])
    cache = vllm_views(layout, heads, content, torch.bfloat16, "cpu", poison)
    assert _five_strides(cache) == want
    assert tuple(cache.views[0].shape) == (BLOCKS, heads, TOKENS, content)


# -- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_registration_reads_each_layout_where_it_lies(layout: str) -> None:
    """Every layout registers without a copy of the cache: the pool's tensors are the
    views' memory (same addresses), no longer inference tensors (kvferry's threads write
    them), with the segments and block stride of the layout's physical order."""
    cache = vllm_views(layout, *ATTN, torch.bfloat16, "cpu", poison)
    pool = register(cache)
    page = ATTN[0] * TOKENS * ATTN[1] * 2
    assert [t.data_ptr() for t in pool.layers] == [v.data_ptr() for v in cache.views]
    assert not any(t.is_inference() for t in pool.layers)
    heads_outer = layout in ("LHBNC", "BHLNC")  # heads outside the blocks: one segment per head
    assert pool.segments == (ATTN[0] if heads_outer else 1)
    assert pool.block_bytes == page
    assert pool.block_stride == (LAYERS * page if layout.startswith("B") else pool.segment_bytes)
    assert pool.packed == (not layout.startswith("B"))
    assert pool.block_layout == ("N16.H2.C16" if "NH" in layout else "H2.N16.C16")


def test_mla_label_leaves_out_its_one_head() -> None:
    """MLA's one latent head places nothing: LBHNC and LBNHC caches hold the same bytes in
    the same order, and get one label (so they exchange blocks)."""
    a = register(vllm_views("LBHNC", *MLA, torch.bfloat16, "cpu", poison))
    b = register(vllm_views("LBNHC", *MLA, torch.bfloat16, "cpu", poison))
    assert a.block_layout == b.block_layout == "N16.C576"
    a.check_compatible(b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_connectors_registration_is_paged_kv_from_views(layout: str) -> None:
    """`WorkerCommon.register_kv_caches` (the connector's call) makes the same pool, layers
    in vLLM's layer order."""
    cache = vllm_views(layout, *ATTN, torch.bfloat16, "cpu", poison)
    common = worker_common()
    views = dict(reversed(cache.as_dict().items()))  # vLLM's dict order is not the layer order
    common.register_kv_caches(views, layer_index)
    pool = register(cache)
    assert [t.data_ptr() for t in common.pool.layers] == [t.data_ptr() for t in pool.layers]
    assert common.pool.geometry() == pool.geometry()
    assert (common.pool.segment_stride, common.pool.block_stride) == (pool.segment_stride, pool.block_stride)
    assert common.layer_of == {name: i for i, name in enumerate(cache.as_dict())}


# A view with no dense run: its content axis takes every other element.
with torch.inference_mode():
    SPARSE = torch.zeros(2 * BLOCKS * 1024, dtype=torch.bfloat16).as_strided((BLOCKS, 2, TOKENS, 16), (1024, 16, 32, 2))
SPARSE_NAMED = r"shape \(12, 2, 16, 16\), stride \(1024, 16, 32, 2\), dtype torch.bfloat16"


def test_views_it_cannot_read_are_refused_by_shape_strides_and_dtype() -> None:
    with pytest.raises(InvalidArgumentError, match=SPARSE_NAMED):
        paged_kv_from_views([SPARSE], num_blocks=BLOCKS, tokens_per_block=TOKENS)
    # A block count that is not the engine's (kernel blocks smaller than vLLM's blocks).
    with pytest.raises(InvalidArgumentError, match="holds 12 blocks, the engine has num_blocks=24"):
        paged_kv_from_views([SPARSE], num_blocks=2 * BLOCKS, tokens_per_block=TOKENS)
    # A raw (1-d) buffer, as vLLM hands layers without views (Mamba state).
    with pytest.raises(InvalidArgumentError, match=r"shape \(64,\).*1 dimensions, dims='BHNC' names 4"):
        paged_kv_from_views([torch.zeros(64, dtype=torch.int8)], num_blocks=BLOCKS, tokens_per_block=TOKENS)
    # Blocks that overlap (a broadcast block axis).
    with pytest.raises(InvalidArgumentError, match=r"stride \(0, 256, 16, 1\).*zero or negative stride"):
        paged_kv_from_views(
            [torch.zeros(2, TOKENS, 16).expand(BLOCKS, 2, TOKENS, 16)], num_blocks=BLOCKS, tokens_per_block=TOKENS
        )


def test_the_connector_refuses_them_in_one_line() -> None:
    with pytest.raises(KvFerryError, match="kvferry: cannot register vLLM's KV cache: .*" + SPARSE_NAMED):
        worker_common().register_kv_caches({"model.layers.0.attn": SPARSE}, layer_index)


# Engines (older vLLMs, others) whose views split K and V or drop the head axis: the same
# function reads them with the dimensions named.
LEGACY = [
    # FlashAttention NHD and HND: (2, B, N, H, D) logical, HND stored as (2, B, H, N, D)
    ("KBNHD", (2, BLOCKS, TOKENS, 2, 8), (0, 1, 2, 3, 4), 2, "K2.N16.H2.D8"),
    ("KBNHD", (2, BLOCKS, TOKENS, 2, 8), (0, 1, 3, 2, 4), 2, "K2.H2.N16.D8"),
    # FlashInfer / Triton attention: (B, 2, N, H, D), K and V inside the block
    ("BKNHD", (BLOCKS, 2, TOKENS, 2, 8), (0, 1, 2, 3, 4), 1, "K2.N16.H2.D8"),
    # MLA: (B, N, D)
    ("BND", (BLOCKS, TOKENS, 576), (0, 1, 2), 1, "N16.D576"),
]


@pytest.mark.parametrize("dims, shape, order, segments, label", LEGACY)
def test_split_kv_layouts_copy_bit_exact(
    dims: str, shape: tuple[int, ...], order: tuple[int, ...], segments: int, label: str
) -> None:
    def make(fill: Callable) -> tuple[torch.Tensor, list[torch.Tensor]]:
        physical = tuple(shape[d] for d in order)
        raw = torch.zeros((LAYERS, *physical), dtype=torch.int16)
        fill(raw.view(torch.int8).view(-1))
        inverse = tuple(order.index(d) for d in range(len(order)))
        return raw, [raw[i].permute(inverse) for i in range(LAYERS)]

    src_raw, src = make(random_bytes(3))
    dst_raw, dst = make(poison)
    want = dst_raw.clone()
    b = dims.index("B")
    for layer in range(LAYERS):
        view = want[layer].permute(tuple(order.index(d) for d in range(len(order))))
        for s, d in zip(SRC_IDS, DST_IDS):
            view.select(b, int(d)).copy_(src[layer].select(b, int(s)))
    a = paged_kv_from_views(src, num_blocks=BLOCKS, tokens_per_block=TOKENS, dims=dims)
    z = paged_kv_from_views(dst, num_blocks=BLOCKS, tokens_per_block=TOKENS, dims=dims)
    assert (a.segments, a.block_layout) == (segments, label)
    copy_blocks(a, z, SRC_IDS, DST_IDS)
    assert_bytes_equal(dst_raw.view(torch.int8), want.view(torch.int8))


# -- transfers on CPU -----------------------------------------------------------------------


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_transfer_bit_exact(layout: str, dtype: torch.dtype, path: str) -> None:
    transfer(CPU_PATHS[path], (layout, layout), ATTN, dtype, "cpu")


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_mla_transfer_bit_exact(layout: str, path: str) -> None:
    transfer(CPU_PATHS[path], (layout, layout), MLA, torch.bfloat16, "cpu")


# Layer-outer on one side, block-outer on the other: the same elements in the same order,
# other strides; the copy converts as it goes (no second pass).
MIXED = [("LBNHC", "BLNHC"), ("BLHNC", "LBHNC"), ("LHBNC", "BHLNC")]


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("layouts", MIXED, ids="->".join)
def test_cpu_mixed_strides_convert_in_the_copy(layouts: tuple[str, str], path: str) -> None:
    transfer(CPU_PATHS[path], layouts, ATTN, torch.bfloat16, "cpu")


@pytest.mark.parametrize(
    "layouts, field",
    [(("LBNHC", "LBHNC"), "block_layout is N16.H2.C16 on the source and H2.N16.C16"), (("LBHNC", "LHBNC"), "segments")],
    ids=["NHC->HNC", "one-segment->per-head"],
)
def test_blocks_of_another_order_are_refused_at_the_handshake(layouts: tuple[str, str], field: str) -> None:
    """Token-major blocks into head-major ones (or per-head segments) would land scrambled:
    the sender refuses the receiver's pool before any byte moves, naming what differs."""
    from kvferry.sender import KVSender
    from kvferry.transports.staging import StagingEndpoint, StagingTransport

    src = register(vllm_views(layouts[0], *ATTN, torch.bfloat16, "cpu", random_bytes(1)))
    dst_cache = vllm_views(layouts[1], *ATTN, torch.bfloat16, "cpu", poison)
    receiver = KVReceiver(register(dst_cache))
    authkey = secrets.token_bytes(32)
    endpoint = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=4)
    try:
        transport = StagingTransport(endpoint.address, authkey=authkey)
        try:
            with pytest.raises(LayoutMismatchError, match=field):
                KVSender(src, transport)
        finally:
            transport.close()
    finally:
        endpoint.close()
    assert bool((dst_cache.raw == -1).all())


def nixl(src: PagedKV, dst: PagedKV, engine: CopyEngine) -> None:
    from kvferry.transports.nixl import NixlEndpoint, NixlTransport

    receiver = KVReceiver(dst)
    authkey = secrets.token_bytes(32)
    endpoint = NixlEndpoint(receiver, authkey=authkey)
    try:
        transport = NixlTransport(endpoint.address, authkey=authkey, src=src)
        try:
            write_through(transport, engine, receiver, src)
        finally:
            transport.close()
    finally:
        endpoint.close()
    assert_nothing_leased(receiver)


# Into each of vLLM's six layouts as the receiver, from a layer-outer sender and from a
# block-outer one of the same block order (token-major, head-major, per-head segments).
NIXL_PAIRS = [
    (src, dst)
    for family in (("LBHNC", "BLHNC"), ("LBNHC", "BLNHC"), ("LHBNC", "BHLNC"))
    for dst in family
    for src in family
]


def count_descriptors(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The rows each write hands NIXL: ``runs`` (descriptors of a transfer made for the
    write, per side) and ``prepped`` (indices into the prepared per-block lists)."""
    from nixl._api import nixl_agent

    counted: dict[str, list[int]] = {"runs": [], "prepped": []}
    real_descs, real_prepped = nixl_agent.get_xfer_descs, nixl_agent.make_prepped_xfer

    def descs(self: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        counted["runs"].append(len(rows))
        return real_descs(self, rows, *args, **kwargs)

    def prepped(self: Any, op: Any, local: Any, rows: Any, remote: Any, remote_rows: Any, *args: Any) -> Any:
        assert len(remote_rows) == len(rows)
        counted["prepped"].append(len(rows))
        return real_prepped(self, op, local, rows, remote, remote_rows, *args)

    monkeypatch.setattr(nixl_agent, "get_xfer_descs", descs)
    monkeypatch.setattr(nixl_agent, "make_prepped_xfer", prepped)
    return counted


@pytest.mark.parametrize("layouts", NIXL_PAIRS, ids="->".join)
def test_cpu_nixl_between_any_layouts_bit_exact(monkeypatch: pytest.MonkeyPatch, layouts: tuple[str, str]) -> None:
    """NIXL (UCX on loopback) from a pool of each layout into a pool of each layout of the
    same block order: each side's blocks described at its own strides (the receiver's from
    its hello); scattered blocks, one prepared descriptor per (layer, segment, block), or one
    per block between two block-outer pools of one layout (a block's layers are one span on
    both sides); the receiver's whole buffer equals the reference (the rest keeps its
    poison)."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    counted = count_descriptors(monkeypatch)
    transfer(nixl, layouts, ATTN, torch.bfloat16, "cpu")
    segments = register(vllm_views(layouts[1], *ATTN, torch.bfloat16, "cpu", poison)).segments
    prepared = [LAYERS * segments * BLOCKS] * 2  # each side's per-block list, once at connect
    if layouts[0] == layouts[1] and layouts[0].startswith("B"):  # a block's layers adjacent on both sides
        assert counted == {"runs": prepared + [len(SRC_IDS)] * 2, "prepped": []}
    else:
        assert counted == {"runs": prepared, "prepped": [len(SRC_IDS) * LAYERS * segments]}


@pytest.mark.parametrize("layouts", NIXL_PAIRS, ids="->".join)
def test_cpu_nixl_runs_between_any_layouts_bit_exact(monkeypatch: pytest.MonkeyPatch, layouts: tuple[str, str]) -> None:
    """The same with blocks consecutive on both sides (two runs): one descriptor per run,
    layer and segment when both pools are layer-outer; one per run, every layer, between two
    block-outer pools of one layout; one per (layer, segment, block) when only one is
    block-outer (nothing is adjacent on both sides); bit exact every way."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "SRC_IDS", np.array([2, 3, 4, 5, 9, 10]))
    monkeypatch.setattr(module, "DST_IDS", np.array([6, 7, 8, 9, 0, 1]))
    counted = count_descriptors(monkeypatch)
    transfer(nixl, layouts, ATTN, torch.bfloat16, "cpu")
    src, dst = (register(vllm_views(x, *ATTN, torch.bfloat16, "cpu", poison)) for x in layouts)
    prepared = [LAYERS * dst.segments * BLOCKS] * 2  # each side's per-block list, once at connect
    if src.packed and dst.packed:
        assert counted == {"runs": prepared + [2 * LAYERS * dst.segments] * 2, "prepped": []}
    elif layouts[0] == layouts[1]:  # block-outer on both sides: a run of blocks, every layer, is one span
        assert counted == {"runs": prepared + [2] * 2, "prepped": []}
    else:
        assert counted == {"runs": prepared, "prepped": [6 * LAYERS * dst.segments]}


def test_nixl_joins_pieces_only_where_both_sides_continue_within_one_region() -> None:
    """`joined_spans`: pieces adjacent on both sides join (in local address order, whatever
    the write's order); a piece whose local or remote side starts another registered region,
    or whose remote side jumps, starts a new descriptor."""
    from kvferry.transports.nixl import joined_spans

    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    local = u(132, 100, 116, 148, 164)  # pieces of 16 bytes, written out of order
    remote = u(1032, 1000, 1016, 1048, 2000)
    lo, ro, sizes = joined_spans(local, remote, 16, u(0), u(0))
    assert (lo.tolist(), ro.tolist(), sizes.tolist()) == ([100, 164], [1000, 2000], [64, 16])
    # The same, with a local registration starting at 132 and a remote one at 1048.
    lo, ro, sizes = joined_spans(local, remote, 16, u(0, 132), u(0, 1048))
    assert (lo.tolist(), ro.tolist(), sizes.tolist()) == (
        [100, 132, 148, 164],
        [1000, 1032, 1048, 2000],
        [32, 16, 16, 16],
    )


def test_nixl_registers_a_block_outer_pool_as_one_span_and_addresses_its_blocks() -> None:
    """The layers of a block-outer pool are interleaved views of one allocation: registered
    as one span covering them all; each (layer, segment, block) descriptor is where the
    pool's strides put that block's bytes."""
    from kvferry.transports.nixl import block_descriptors, registered_regions

    cache = vllm_views("BLHNC", *ATTN, torch.bfloat16, "cpu", poison)
    pool = register(cache)
    assert not pool.packed
    regions = registered_regions(pool)
    assert regions.tolist() == [[cache.raw.data_ptr(), cache.raw.numel(), 0]]
    rows = block_descriptors(pool)
    for layer, view in enumerate(cache.views):
        for block in (0, 5, BLOCKS - 1):
            for seg in range(pool.segments):
                address, length, _ = rows[(layer * pool.segments + seg) * pool.num_blocks + block]
                assert int(length) == pool.segment_bytes
                assert int(address) == view[block].data_ptr() + seg * pool.segment_stride
    packed = register(vllm_views("LBHNC", *ATTN, torch.bfloat16, "cpu", poison))
    # Layer-outer: each layer's own span, as when NIXL registered the layer tensors.
    assert registered_regions(packed).tolist() == [
        [v.data_ptr(), v.numel() * v.element_size(), 0] for v in packed.layers
    ]


def test_the_data_path_does_not_import_vllm() -> None:
    """What the GPU tests drive imports no vLLM (vLLM cannot run on the GPU machine): a
    finder that refuses any ``vllm`` import makes the imports fail if one does."""
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm imported: ' + name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import kvferry.layout, kvferry.copy, kvferry.engine, kvferry.sender, kvferry.receiver\n"
        "import kvferry.transports.staging, kvferry.transports.cuda_ipc, kvferry.transports.inprocess\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SLACK)
    assert done.returncode == 0, done.stderr


KERNEL_CHECK = """
import numpy as np, torch
from kvferry import _triton_copy
from test_kv_layouts import ATTN, DST_IDS, LAYOUTS, MIXED, MLA, SRC_IDS, assert_bytes_equal, poison, random_bytes
from test_kv_layouts import reference, register, vllm_views
ids = torch.from_numpy(np.stack([SRC_IDS, DST_IDS]))
pairs = [*((x, x) for x in LAYOUTS), *MIXED]
for shape, dtype, layouts in [(ATTN, torch.bfloat16, p) for p in pairs] + [(MLA, torch.uint8, ("LBNHC", "BLNHC"))]:
    src = vllm_views(layouts[0], *shape, dtype, "cpu", random_bytes(1))
    dst = vllm_views(layouts[1], *shape, dtype, "cpu", poison)
    want = reference(src, dst)
    a, b = register(src), register(dst)
    assert _triton_copy.supports(a, b), layouts
    _triton_copy.copy_blocks(a, b, ids, _triton_copy.LaunchConfig(32, 16, 4, True))
    assert_bytes_equal(dst.raw, want)
print("kernel ok")
"""


def test_fused_kernel_addresses_each_side_by_its_strides_under_the_interpreter() -> None:
    """The Triton kernel (what `copy_blocks` runs on CUDA) on CPU under TRITON_INTERPRET=1:
    every layout, and layer-outer <-> block-outer pairs, bit exact against the reference."""
    pytest.importorskip("triton")
    run_kernel_check(KERNEL_CHECK)


# -- transfers on CUDA ----------------------------------------------------------------------


def _ipc_receiver(conn: Any, authkey: bytes, layout: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """The decode side over CUDA IPC: vLLM's views of a poisoned cache, registered, served;
    sends back the destination buffer once the request completed."""
    from kvferry.transports.cuda_ipc import CudaIpcEndpoint

    cache = vllm_views(layout, *shape, dtype, "cuda", poison)
    receiver = KVReceiver(register(cache))
    endpoint = CudaIpcEndpoint(receiver, authkey=authkey)
    epoch = receiver.expect(5, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS)
    conn.send((endpoint.address, epoch))
    try:
        receiver.wait(5, timeout=SLACK)
        conn.send(("ok", cache.raw.cpu().numpy()))
    except Exception as err:  # reported to the test, which fails with it
        conn.send(("error", repr(err)))
    conn.recv()
    endpoint.close()


def cuda_ipc(layouts: tuple[str, str], shape: tuple[int, int], dtype: torch.dtype) -> None:
    from kvferry.transports.cuda_ipc import CudaIpcTransport

    src_cache = vllm_views(layouts[0], *shape, dtype, "cuda", random_bytes(1))
    want = reference(src_cache, vllm_views(layouts[1], *shape, dtype, "cuda", poison))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    authkey = secrets.token_bytes(32)
    proc = ctx.Process(target=_ipc_receiver, args=(child, authkey, layouts[1], shape, dtype), daemon=True)
    proc.start()
    try:
        address, epoch = reply_from(parent, proc, "receiver")
        transport = CudaIpcTransport(address, authkey=authkey)
        engine = CudaCopyEngine(torch.device("cuda"))
        notice = Notice(5, 0, 0, len(DST_IDS), True, epoch)
        transport.announce([(5, epoch)])
        assert transport.write(engine, Write(register(src_cache), SRC_IDS, DST_IDS, [notice])).wait(SLACK)
        transport.post([notice])
        status, got = reply_from(parent, proc, "receiver")
        assert status == "ok", got
        assert_bytes_equal(torch.from_numpy(got), want)
        transport.close()
        engine.close()
        parent.send("done")
        proc.join(timeout=SLACK)
    finally:
        if proc.is_alive():
            proc.kill()


CUDA_PATHS = {"copy_blocks": fused_copy, "inprocess": in_process, "staging": staging}
# fp32 is not a vLLM GPU cache dtype for FlashAttention; the CUDA matrix keeps the GPU ones.
CUDA_DTYPES = [torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn]


@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_transfer_bit_exact(layout: str, dtype: torch.dtype, path: str) -> None:
    transfer(CUDA_PATHS[path], (layout, layout), ATTN, dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_mla_transfer_bit_exact(layout: str, path: str) -> None:
    transfer(CUDA_PATHS[path], (layout, layout), MLA, torch.bfloat16, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("layouts", MIXED, ids="->".join)
def test_cuda_mixed_strides_convert_in_the_copy(layouts: tuple[str, str], path: str) -> None:
    transfer(CUDA_PATHS[path], layouts, ATTN, torch.bfloat16, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layouts", [*((x, x) for x in LAYOUTS), *MIXED], ids="->".join)
def test_cuda_ipc_transfer_bit_exact(layouts: tuple[str, str], dtype: torch.dtype) -> None:
    """Two processes on one GPU: the sender opens the receiver's one allocation (every layer
    a view of it) from its IPC handles and the fused copy writes into it."""
    cuda_ipc(layouts, ATTN, dtype)


@pytest.mark.cuda
def test_cuda_ipc_mla_transfer_bit_exact() -> None:
    cuda_ipc(("LBNHC", "LBNHC"), MLA, torch.bfloat16)


@pytest.mark.cuda
def test_cuda_fused_copy_runs_the_triton_kernel_on_strided_pools() -> None:
    """The block-outer pools take the Triton kernel (not the torch fallback): 16-byte
    aligned segments and strides."""
    from kvferry import _triton_copy

    a = register(vllm_views("BHLNC", *ATTN, torch.bfloat16, "cuda", poison))
    b = register(vllm_views("LBHNC", *ATTN, torch.bfloat16, "cuda", poison))
    assert _triton_copy.supports(a, b) and _triton_copy.supports(b, a)


@pytest.mark.cuda
def test_a_cuda_copy_tells_its_waiter_when_done_in_stream_order() -> None:
    """`Pending.when_done` on a CUDA copy: the engine's event thread calls each callback
    once its copy finished (the announcer then posts without polling), in submission order,
    and the copied bytes are there when it does."""
    src = vllm_views("LBHNC", *ATTN, torch.bfloat16, "cuda", random_bytes(3))
    dst = vllm_views("LBHNC", *ATTN, torch.bfloat16, "cuda", poison)
    want = reference(src, dst)
    engine = CudaCopyEngine(torch.device("cuda"))
    told: list[int] = []
    done = [threading.Event() for _ in range(3)]
    try:
        pendings = [engine.submit(register(src), register(dst), SRC_IDS, DST_IDS) for _ in done]
        for i, (pending, event) in enumerate(zip(pendings, done)):
            assert pending.when_done(lambda i=i, event=event: (told.append(i), event.set()))
        for event in done:
            assert event.wait(30)
        assert told == [0, 1, 2] and all(p.done() for p in pendings)
    finally:
        engine.close()
    assert_bytes_equal(dst.raw, want)
