"""vLLM's KV cache groups (HMA) in kvferry's terms (kvferry.groups), without a vLLM
server: which groups kvferry moves or refuses, which blocks of which group move when (exactly
once per (group, block), never a null block), and the data path of two groups whose layers
overlay one allocation as vLLM 0.32 lays them out, bit exact per group.

Run in the vLLM venv:
    PYTHONPATH=python .venv-vllm/bin/python -m pytest tests/test_vllm_groups.py -q
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch
from helpers import POOLS, assert_nothing_leased, in_process_pair
from kvferry._core import BlockRange, TransferLedger
from kvferry.errors import KvFerryError
from kvferry.hook import TransferHook
from kvferry.layout import paged_kv_from_views
from kvferry.notice import Notice

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not importable: run in the vLLM venv, see docs/vllm.md")

TPB = 4


# Stand-ins named as vLLM's specs (groups_of reads the class name, not vLLM's classes).
class FullAttentionSpec(SimpleNamespace):
    sliding_window: Optional[int] = None


class SlidingWindowSpec(SimpleNamespace):
    extra_retained_tokens = 0


class MambaSpec(SimpleNamespace):
    pass


def config(*groups: tuple[Any, list[str]], enable: Optional[list[bool]] = None) -> Any:
    enable = enable or [True] * len(groups)
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, layer_names=names, enable_kv_transfer=on)
            for (spec, names), on in zip(groups, enable)
        ]
    )


SW = (SlidingWindowSpec(sliding_window=9), ["l0", "l2"])
FA = (FullAttentionSpec(), ["l1", "l3"])


def index(name: str) -> int:
    return int(name[1:])


# -- which groups ----------------------------------------------------------------------------


def test_groups_keep_vllm_order_and_windows() -> None:
    from kvferry.groups import groups_of

    sw, fa = groups_of(config(SW, FA))
    assert (sw.index, sw.layers, sw.window, sw.spec) == (0, ("l0", "l2"), 9, "SlidingWindowSpec")
    assert (fa.index, fa.layers, fa.window, fa.spec) == (1, ("l1", "l3"), None, "FullAttentionSpec")
    # Blocks kept for extra trailing tokens are part of what the decode side keeps.
    (wide,) = groups_of(config((SlidingWindowSpec(sliding_window=9, extra_retained_tokens=3), ["l0"])))
    assert wide.window == 12
    # HMA off: windowed layers in the full-attention group, every block allocated and moved.
    (merged,) = groups_of(config((FullAttentionSpec(sliding_window=9), ["l0", "l1"])))
    assert merged.window is None
    # A replica vLLM rebuilds after a load (enable_kv_transfer False) is not moved.
    (only,) = groups_of(config(SW, FA, enable=[False, True]))
    assert only.index == 1


def test_a_state_group_is_refused_at_startup_naming_the_group_and_its_spec() -> None:
    from kvferry.groups import groups_of

    mamba = (MambaSpec(shapes=((2, 8),), block_size=4), ["m1", "m3", "m5", "m7"])
    with pytest.raises(KvFerryError) as err:
        groups_of(config(FA, mamba))
    msg = str(err.value)
    assert "KV cache group 1 (MambaSpec, layers m1, m3, m5, ...)" in msg and "shapes=((2, 8),)" in msg
    assert "Mamba/SSM" in msg and "docs/vllm.md" in msg


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 8, 9, 13, 29, 30, 31, 64])
@pytest.mark.parametrize("prompt", [1, 3, 4, 5, 17, 30, 32])
def test_live_blocks_are_the_planners(window: int, prompt: int) -> None:
    """The blocks the connector checks for null blocks are those the Rust planner needs."""
    from kvferry.groups import live_blocks

    lo, hi = live_blocks(prompt, TPB, window)
    assert TransferLedger(TPB, prompt, window=window).missing() == ([BlockRange(lo, hi)] if hi > lo else [])
    assert live_blocks(prompt, TPB, None) == (0, -(-prompt // TPB))


def test_null_blocks_in_a_live_window_are_refused() -> None:
    from kvferry.groups import GroupSet, groups_of

    groups = GroupSet(groups_of(config(SW, FA)), TPB)
    # P = 30: the window of 9 lives in blocks [5, 8); vLLM nulled blocks 0..4 of group 0.
    groups.check_live([[0, 0, 0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]], 30, "x")
    with pytest.raises(KvFerryError, match=r"x: group 0 \(SlidingWindowSpec\) holds vLLM's null block inside"):
        groups.check_live([[0, 0, 0, 0, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]], 30, "x")
    with pytest.raises(KvFerryError, match=r"group 1 \(FullAttentionSpec\) has 7 blocks, the prompt needs 8"):
        groups.check_live([[0, 0, 0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10]], 30, "x")
    with pytest.raises(KvFerryError, match="1 block tables, this engine moves 2 groups"):
        groups.check_live([[1, 2]], 30, "x")
    assert groups.kv_ids(100) == [100, 101]
    assert groups.tables(([7, 8], [9], [5])) == [[7, 8], [9]]  # vLLM's tuple: every group's table
    assert groups.live_count(30, 1) == 3 + 7  # window blocks [5, 8) + full blocks [1, 8)


def test_pool_layers_take_one_layer_per_region_and_refuse_other_overlays() -> None:
    from kvferry.groups import groups_of, pool_layers

    alloc = torch.zeros(2, 6, 2, TPB, 8)
    caches = {"l0": alloc[0], "l1": alloc[0], "l2": alloc[1], "l3": alloc[1]}
    regions, layer_of = pool_layers(caches, groups_of(config(SW, FA)), index)
    assert regions == ["l0", "l2"]
    # A region is complete once its last overlaying layer was saved: l1 for region 0, l3 for 1.
    assert layer_of == {"l1": 0, "l3": 1}
    swapped = dict(caches, l1=alloc[1], l3=alloc[0])
    with pytest.raises(KvFerryError, match="layer l1 .KV cache group 1. does not overlay layer l0 .group 0."):
        pool_layers(swapped, groups_of(config(SW, FA)), index)
    with pytest.raises(KvFerryError, match=r"registered no KV cache for layers \['l3'\]"):
        pool_layers({k: v for k, v in caches.items() if k != "l3"}, groups_of(config(SW, FA)), index)


def test_a_lease_admits_repeated_null_blocks_outside_the_window_but_no_write_there() -> None:
    from kvferry.receiver import KVReceiver, LeaseError

    receiver = KVReceiver(POOLS.zeros())
    receiver.expect(1, 30, window=9, dst_blocks=[0, 0, 0, 0, 0, 7, 8, 9])
    assert receiver.lease_admits(Notice(1, 0, 5, 8, True, 1), np.array([7, 8, 9]))
    assert not receiver.lease_admits(Notice(1, 0, 4, 6, False, 1), np.array([0, 7]))
    with pytest.raises(LeaseError):
        receiver.deliver(Notice(1, 0, 0, 2, False, 1), dst_ids=np.array([0, 0]))
    with pytest.raises(KvFerryError, match="a destination block appears twice"):
        receiver.expect(2, 30, window=9, dst_blocks=[0, 0, 0, 0, 0, 7, 8, 7])
    receiver.release_unfenced(1)


# -- the data path: two groups overlaying one allocation -------------------------------------

BLOCKS = 40  # one block pool for both groups (block 0: vLLM's null block)
P, REUSED, HELD = 30, 12, 1  # prompt (8 blocks), prefill prefix hit (3 blocks), decode prefix hit (1 block)
CHUNKS = [(12, 20), (20, 30)]


def allocation(fill: str, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One engine's KV allocation as vLLM 0.32 lays out two groups of two layers (LBHNC,
    groups overlaid from byte 0) and its per-layer views."""
    shape = (2, BLOCKS, 2, TPB, 8)
    if fill == "random":
        gen = torch.Generator().manual_seed(seed)
        nbytes = int(np.prod(shape)) * 4
        alloc = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(torch.float32).view(shape)
    else:
        alloc = torch.full((int(np.prod(shape)) * 4,), 0xFF, dtype=torch.uint8).view(torch.float32).view(shape)
    return alloc, {"l0": alloc[0], "l2": alloc[1], "l1": alloc[0], "l3": alloc[1]}


def test_two_groups_over_shared_tensors_move_bit_exact_each_block_once_never_a_null_block() -> None:
    """The sliding-window group (W=9) moves only its live window [5, 8) with the last chunk;
    the full-attention group its prefix [1, 3) early (block 0 the decode side holds) and each
    chunk's blocks after its forward; one block pool for both, each table addressing its own
    group's layers of the same regions. The destination is poisoned: every byte the decode
    side reads is the prefill side's, and nothing else was written (its null block, the
    window's dropped blocks, the held block)."""
    from kvferry.groups import GroupSet, add_groups, expect_groups, groups_of, pool_layers

    groups = GroupSet(groups_of(config(SW, FA)), TPB)
    src_alloc, src_views = allocation("random")
    dst_alloc, dst_views = allocation("poison")
    before = dst_alloc.clone()
    pools = []
    for views in (src_views, dst_views):
        regions, _ = pool_layers(views, groups.groups, index)
        pools.append(paged_kv_from_views([views[n] for n in regions], num_blocks=BLOCKS, tokens_per_block=TPB))
    # vLLM's tables: disjoint ids from one pool; the window group's dropped blocks are null.
    src = [[0, 0, 0, 0, 0, 21, 22, 23], [11, 12, 13, 14, 15, 16, 17, 18]]
    dst = [[0, 0, 0, 0, 0, 36, 37, 38], [3, 25, 26, 27, 28, 29, 30, 31]]
    sender, receiver = in_process_pair(pools[0], pools[1], record=True)
    hook = TransferHook(sender)
    base = 1000
    epoch = expect_groups(receiver, groups, base, P, HELD, dst)
    destination = {"dst_blocks": [b for t in dst for b in t], "held_blocks": HELD, "epoch": epoch}
    add_groups(hook, groups, base, P, REUSED, destination)
    kvs = groups.kv_ids(base)
    # Chunk by chunk, as the prefill worker does: the tables so far, the early send before
    # the first forward, each chunk's blocks after its forward.
    for kv, table in zip(kvs, src):
        hook.update_src_blocks(kv, table[:5])
    early = hook.before_forward(kvs)
    assert [(n.request_id, n.start, n.end) for n in early] == [(base + 1, 1, 3)]
    for start, end in CHUNKS:
        for kv, table in zip(kvs, src):
            hook.update_src_blocks(kv, table)
        if end == P:
            groups.check_live(src, P, "the prefill request")
        hook.after_forward(kvs, [start] * 2, [end] * 2)
    for kv in kvs:
        receiver.wait(kv, 10.0)
    # Exactly once per (group, block): the notices tile each group's blocks to move.
    sent: dict[int, list[int]] = {kv: [] for kv in kvs}
    sender.flush(10.0)
    assert sender.records is not None
    for rec in sender.records:
        for n in rec.notices:
            sent[n.request_id] += list(range(n.start, n.end))
    assert sorted(sent[kvs[0]]) == [5, 6, 7]  # the window only
    assert sorted(sent[kvs[1]]) == [1, 2, 3, 4, 5, 6, 7]  # all but the held block 0
    assert receiver.refused_count == 0
    # Bit exact per group: region j of block dst[g][i] holds region j of block src[g][i].
    written = set()
    for g, blocks in enumerate([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]):
        for i in blocks:
            written.add(dst[g][i])
            got, want = dst_alloc[:, dst[g][i]], src_alloc[:, src[g][i]]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (g, i)
    # Nothing else written: the null block, the held block 3, every block no group moved.
    for b in range(BLOCKS):
        if b not in written:
            assert torch.equal(dst_alloc[:, b].view(torch.uint8), before[:, b].view(torch.uint8)), b
    for kv in kvs:
        hook.finish(kv)
        receiver.release(kv, 0)
    assert_nothing_leased(receiver, sender=sender)
    sender.close()


def test_a_failed_group_expect_leaves_no_group_expected() -> None:
    """All or nothing: a group the receiver refuses (here a table naming a block twice)
    releases the groups expected before it."""
    from kvferry.groups import GroupSet, expect_groups, groups_of

    groups = GroupSet(groups_of(config(FA, SW)), TPB)
    _, receiver = in_process_pair()
    with pytest.raises(KvFerryError, match="appears twice"):
        expect_groups(receiver, groups, 7, P, 0, [list(range(1, 9)), [0, 0, 0, 0, 0, 9, 9, 10]])
    assert_nothing_leased(receiver)


# -- the scheduler half: one table per group in, one per group out --------------------------


class _Manager:
    def __init__(self, tables: dict[str, tuple[list[int], ...]]) -> None:
        self.tables = tables

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self.tables[rid]


def test_the_scheduler_half_hands_every_groups_table_and_checks_the_destination() -> None:
    from kvferry.groups import GroupSet, groups_of
    from kvferry.vllm.config import ConnectorConfig, prompt_digest
    from kvferry.vllm.scheduler import SchedulerSide, _check_destination

    groups = GroupSet(groups_of(config(SW, FA)), TPB)
    manager = _Manager({"d": ([0, 0, 0, 0, 0, 7, 8, 9, 41], [1, 2, 3, 4, 5, 6, 10, 11, 42])})
    side = SchedulerSide(ConnectorConfig(), block_size=TPB, role="kv_consumer", engine_id="E",
                         kv_cache_manager_getter=lambda: manager, authkey=b"k" * 32, groups=groups)  # fmt: skip
    prompt = list(range(3, 3 + P))
    request = SimpleNamespace(request_id="d", num_tokens=P, num_prompt_tokens=P, prompt_token_ids=prompt,
                              kv_transfer_params={"kvferry": {"op": "recv", "transfer": "T1"}})  # fmt: skip
    assert side.get_num_new_matched_tokens(request, 4) == (P - 4, True)
    side.update_state_after_alloc(request, None, P - 4)
    (spec,) = side.build_connector_meta(SimpleNamespace(preempted_req_ids=())).recvs
    assert spec.dst_blocks == [[0, 0, 0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]]  # the prompt's blocks
    assert spec.held_blocks == 1 and next(side._kv_ids) == spec.kv_id + 2  # one kvferry id per group
    good = {"prompt_len": P, "digest": prompt_digest(prompt), "block_size": TPB, "dst_blocks": list(range(1, 17)),
            "held_blocks": 1, "request_id": 5, "epoch": 1, "endpoint": "staging+unix:///x"}  # fmt: skip
    assert _check_destination(dict(good), request, TPB, "staging", 2)["dst_blocks"] == list(range(1, 17))
    with pytest.raises(KvFerryError, match=r"dst_blocks=<8 ids>: must list the 8 blocks .* 2 KV cache groups"):
        _check_destination(dict(good, dst_blocks=list(range(1, 9))), request, TPB, "staging", 2)
    with pytest.raises(KvFerryError, match="request_id"):
        _check_destination(dict(good, request_id=2**62 - 1), request, TPB, "staging", 2)


def test_hma_with_tensor_parallelism_starts_and_plans_one_link_per_rank_pair(tmp_path: Any) -> None:
    """HMA with tensor parallelism on either side is accepted (the data path of every link,
    each group over each rank's head slices, is tests/test_tp.py's
    test_tp_with_hma_moves_each_groups_head_slices_once): a server of either tensor-parallel
    size starts, and a prefill server plans one link per (prefill rank, decode rank)."""
    from kvferry.groups import GroupSet, groups_of
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.scheduler import SchedulerSide

    hybrid = GroupSet(groups_of(config(SW, FA)), TPB)
    side = SchedulerSide(ConnectorConfig(), block_size=TPB, role="kv_producer", engine_id="E",
                         kv_cache_manager_getter=None, authkey=b"k" * 32, groups=hybrid, num_kv_heads=2)  # fmt: skip
    assert side._plan("unix:///r/a.sock") is None  # one rank each side: as without TP
    plan = side._plan("unix:///r/a.sock unix:///r/b.sock")
    assert plan is not None and [(k.prefill_rank, k.decode_rank, a) for k, a in plan] == [
        (0, 0, "unix:///r/a.sock"),
        (0, 1, "unix:///r/b.sock"),
    ]

    # The connector starts with either side's tensor parallelism and both groups.
    from kvferry.vllm.connector import KvferryConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))  # a key file of one repeated byte is refused
    key.chmod(0o600)

    def vllm_config(tp: int, prefill_tp: int) -> Any:
        extra = {"authkey_file": str(key), "prefill_tp_size": prefill_tp}
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_consumer", engine_id="e"),
            parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp),
            model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2),
            cache_config=SimpleNamespace(block_size=TPB),
        )

    for tp, prefill_tp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        assert len(KvferryConnector(vllm_config(tp, prefill_tp), KVConnectorRole.SCHEDULER, config(SW, FA)).groups) == 2
