"""The reference engine: the model, the prefix cache, and disaggregated serving through the
executor hook checked against aggregated serving (outputs token for token, KV bit for bit)."""

from __future__ import annotations

import random
from typing import Any, Iterator, Optional, Sequence

import pytest
import torch
from kvferry.geometry import Geometry
from kvferry.notice import Notice
from kvferry.refengine.cache import BlockAllocator, PrefixCache
from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool
from kvferry.refengine.serving import Aggregated, Disaggregated, Turn

CFG = ModelConfig(Geometry(vocab=256, hidden=128, layers=3, heads=4, kv_heads=2, head_dim=32, ffn=256))
TPB = 16


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(CFG)


def test_chunked_prefill_matches_unchunked_and_rereading_is_stable(model: TinyLlama) -> None:
    tokens = torch.randint(0, CFG.geometry.vocab, (100,), generator=torch.Generator().manual_seed(0))
    table = torch.arange(7)
    whole = new_kv_pool(CFG, 8, TPB, "cpu")
    chunked = new_kv_pool(CFG, 8, TPB, "cpu")
    last = model.forward(tokens, 0, whole, table)
    model.forward(tokens[:37], 0, chunked, table)
    last_chunked = model.forward(tokens[37:], 37, chunked, table)
    assert torch.allclose(last, last_chunked, atol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole.layers, chunked.layers))
    # Positions beyond the prompt are untouched (zero) in every layer.
    assert all(bool((layer[6, :, 100 - 6 * TPB :] == 0).all()) for layer in whole.layers)


def test_prefix_cache_full_and_partial_hits() -> None:
    alloc = BlockAllocator(16)
    cache = PrefixCache(4, alloc)
    prompt = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    blocks = alloc.allocate(3)
    cache.insert(prompt, blocks)
    alloc.release(blocks, [cache.is_cached(b) for b in blocks])
    hit = cache.lookup(prompt + [99, 98], max_reuse=11)
    assert hit.blocks == blocks[:2] and (hit.partial_block, hit.partial_tokens) == (blocks[2], 2)
    assert hit.reused_len(4) == 10
    other = cache.lookup([0, 1, 2, 3, 4, 5, 70, 71, 72], max_reuse=8)
    assert other.blocks == blocks[:1] and (other.partial_block, other.partial_tokens) == (blocks[1], 2)
    # Capped reuse: the last token is always computed.
    capped = cache.lookup(list(range(8)), max_reuse=7)
    assert capped.blocks == blocks[:1] and capped.partial_tokens == 3
    # Eviction forgets the blocks: a later lookup misses them.
    alloc.allocate(16)
    assert cache.lookup(prompt, max_reuse=9).reused_len(4) == 0


def _sessions(seed: int, n: int, turns: int, *, system: int, new: tuple[int, int], out: int):  # type: ignore[no-untyped-def]
    """Agentic multi-turn prompts: each turn is the whole conversation so far plus new tokens
    (the previous turns' outputs included)."""
    rng = random.Random(seed)
    convs = {s: [rng.randrange(CFG.geometry.vocab) for _ in range(system + 3 * s)] for s in range(n)}
    rid = 0
    for _ in range(turns):
        batch = []
        for s in range(n):
            convs[s] += [rng.randrange(CFG.geometry.vocab) for _ in range(rng.randrange(*new))]
            rid += 1
            batch.append((s, Turn(rid, tuple(convs[s]), out)))
        outputs = yield [t for _, t in batch]
        for s, turn in batch:
            convs[s] += outputs[turn.request_id]


def _both(agg: Aggregated, dis: Disaggregated, sessions: Any) -> Iterator[tuple[list[Turn], dict, dict]]:  # type: ignore[type-arg]
    """Each turn of ``sessions`` (`_sessions`) served aggregated and disaggregated (the KV
    checked): yields the turns and both results, then feeds the aggregated outputs back."""
    turns = next(sessions)
    while True:
        got_a = agg.run(turns)
        got_d = dis.run(turns, check_kv=True)
        yield turns, got_a, got_d
        try:
            turns = sessions.send({r: got_a[r].outputs for r in got_a})
        except StopIteration:
            return


@pytest.mark.parametrize("chunk", [None, 24], ids=["unchunked", "chunk24"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "baseline"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_disaggregated_matches_aggregated_over_multi_turn_sessions(
    model: TinyLlama, chunk, early: bool, overlap: bool
) -> None:  # type: ignore[no-untyped-def]
    agg = Aggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk)
    dis = Disaggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk, early=early, overlap=overlap)
    gen = _sessions(seed=7, n=3, turns=3, system=90, new=(5, 30), out=5)
    reused, early_slices = [], 0
    for turns, got_a, got_d in _both(agg, dis, gen):
        for turn in turns:
            a, d = got_a[turn.request_id], got_d[turn.request_id]
            assert d.outputs == a.outputs, f"request {turn.request_id}"
            assert d.kv_mismatch_blocks == 0
            assert d.reused_len == a.reused_len
            covered = sorted(b for n in d.notices for b in range(n.start, n.end))
            assert covered == list(range(-(-d.prompt_len // TPB)))  # every block exactly once
            reused.append(d.reused_len)
            if d.reused_len >= TPB:  # the first slice to arrive is the early prefix, or not
                first = (d.notices[0].start, d.notices[0].end)
                early_slices += first == (0, d.reused_len // TPB)
    assert any(r % TPB for r in reused), "no unaligned reuse boundary was exercised"
    assert any(r >= TPB for r in reused)
    assert (early_slices > 0) == early


def _assert_layers_cross_once(notices: Sequence[Notice], num_blocks: int) -> None:
    """Every layer of every block of the prompt crossed exactly once, as a whole block or as
    layer-group slices."""
    crossed = sorted(
        (b, layer)
        for n in notices
        for b in range(n.start, n.end)
        for layer in range(n.group * CFG.geometry.layers // n.groups, (n.group + 1) * CFG.geometry.layers // n.groups)
    )
    assert crossed == [(b, layer) for b in range(num_blocks) for layer in range(CFG.geometry.layers)]


def _assert_serving_matches(model: TinyLlama, transport: str, *, seed: int, layer_groups: Optional[int] = None) -> None:
    """Two sessions x two turns, chunked prefill: disaggregated over ``transport`` (with
    layer-wise streaming in ``layer_groups`` groups, if given) gives aggregated serving's
    outputs and bit-exact KV, each layer of each block crossing once."""
    agg = Aggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=24)
    dis = Disaggregated(
        model, num_blocks=256, tokens_per_block=TPB, chunk_size=24, transport=transport, layer_groups=layer_groups
    )
    try:
        gen = _sessions(seed=seed, n=2, turns=2, system=70, new=(5, 25), out=4)
        for turns, got_a, got_d in _both(agg, dis, gen):
            for turn in turns:
                d = got_d[turn.request_id]
                assert d.outputs == got_a[turn.request_id].outputs
                assert d.kv_mismatch_blocks == 0
                _assert_layers_cross_once(d.notices, -(-d.prompt_len // TPB))
                assert any(not n.whole for n in d.notices) == ((layer_groups or 1) > 1)
    finally:
        dis.close()


@pytest.mark.parametrize("transport", ["shm", "staging", "nixl"])
def test_two_process_disaggregation_matches_aggregated(
    model: TinyLlama, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generation worker in its own process, reached over a real transport."""
    if transport == "nixl":
        pytest.importorskip("nixl")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    _assert_serving_matches(model, transport, seed=3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transport", ["in-process", "cuda-ipc", "staging"])
def test_cuda_disaggregation_matches_aggregated(transport: str, dtype: torch.dtype) -> None:
    from dataclasses import replace

    _assert_serving_matches(TinyLlama(replace(CFG, dtype=dtype), "cuda"), transport, seed=5)


@pytest.mark.cuda
@pytest.mark.parametrize("groups", [2, CFG.geometry.layers], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("transport", ["in-process", "cuda-ipc", "staging"])
def test_cuda_layerwise_streaming_matches_aggregated(transport: str, groups: int) -> None:
    """On CUDA each group's copy is ordered after the forward's write of its layers by an
    event on the current stream: the KV still arrives bit exact."""
    from dataclasses import replace

    _assert_serving_matches(
        TinyLlama(replace(CFG, dtype=torch.bfloat16), "cuda"), transport, seed=5, layer_groups=groups
    )


def test_prefix_cache_index_is_empty_once_every_block_is_evicted() -> None:
    """Regression (found by the soak): eviction left an empty children dict behind for every
    prefix ever cached, so the index grew with every distinct conversation."""
    alloc = BlockAllocator(8)
    cache = PrefixCache(4, alloc)
    rng = random.Random(0)
    for _ in range(50):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 20))]
        blocks = alloc.allocate(-(-len(prompt) // 4))
        cache.insert(prompt, blocks)
        alloc.release(blocks, [cache.is_cached(b) for b in blocks])
    assert cache.index_entries > 0
    alloc.allocate(alloc.available)
    assert cache.index_entries == 0


@pytest.mark.parametrize("transport", ["in-process", "shm"])
@pytest.mark.parametrize("chunk", [None, 24], ids=["unchunked", "chunk24"])
def test_prefix_awareness_keeps_held_blocks_at_the_receiver(model: TinyLlama, transport: str, chunk) -> None:  # type: ignore[no-untyped-def]
    """The generation worker advertises the prompt blocks it still holds from earlier turns;
    they never cross, every other block crosses once, and outputs and KV still match
    aggregated serving."""
    agg = Aggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk)
    dis = Disaggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk, transport=transport, aware=True)
    try:
        gen = _sessions(seed=11, n=2, turns=3, system=90, new=(5, 30), out=5)
        held_per_turn = []
        for turns, got_a, got_d in _both(agg, dis, gen):
            held = 0
            for turn in turns:
                a, d = got_a[turn.request_id], got_d[turn.request_id]
                assert d.outputs == a.outputs, f"request {turn.request_id}"
                assert d.kv_mismatch_blocks == 0
                sent = [b for n in d.notices for b in range(n.start, n.end)]
                assert len(sent) == len(set(sent))  # nothing crossed twice
                kept = sorted(set(range(-(-d.prompt_len // TPB))) - set(sent))
                assert kept == list(range(len(kept)))  # a prefix of full blocks stayed home
                assert len(kept) * TPB <= d.prompt_len
                held += len(kept)
            held_per_turn.append(held)
        assert held_per_turn[0] == 0 and all(h > 0 for h in held_per_turn[1:]), held_per_turn
    finally:
        dis.close()


@pytest.fixture(scope="module")
def fan_out(model: TinyLlama):  # type: ignore[no-untyped-def]
    """Eight concurrent requests with one shared 8k-token prefix (n samples of one prompt) and
    aggregated serving's results for them."""
    rng = random.Random(5)
    prefix = [rng.randrange(CFG.geometry.vocab) for _ in range(8192)]
    turns = [
        Turn(i + 1, tuple(prefix + [rng.randrange(CFG.geometry.vocab) for _ in range(rng.randrange(5, 40))]), 3)
        for i in range(8)
    ]
    agg = Aggregated(model, num_blocks=4400, tokens_per_block=TPB, chunk_size=1024)
    return turns, agg.run(turns)


@pytest.mark.parametrize("transport, dedup", [("in-process", False), ("in-process", True), ("shm", True)])
def test_in_flight_dedup_moves_a_shared_prefix_once(model: TinyLlama, fan_out, transport: str, dedup: bool) -> None:  # type: ignore[no-untyped-def]
    """With dedup the shared prefix's blocks cross once (without it, once per request): the
    other requests map and await them, and every request's KV is bit exact and its output
    equals aggregated serving's."""
    turns, want = fan_out
    dis = Disaggregated(model, num_blocks=4400, tokens_per_block=TPB, chunk_size=1024, transport=transport, dedup=dedup)
    try:
        got = dis.run(turns, check_kv=True)
    finally:
        dis.close()
    prefix_blocks = 8192 // TPB
    crossed = [b for t in turns for n in got[t.request_id].notices for b in range(n.start, n.end)]
    for t in turns:
        d = got[t.request_id]
        assert d.outputs == want[t.request_id].outputs, t.request_id
        assert d.kv_mismatch_blocks == 0
    prefix_crossings = sum(b < prefix_blocks for b in crossed)
    assert prefix_crossings == (prefix_blocks if dedup else 8 * prefix_blocks)
    # Every request's own tail (the suffix and its partial block) crosses either way.
    assert len(crossed) - prefix_crossings == sum(-(-len(t.prompt) // TPB) - prefix_blocks for t in turns)


def test_on_layer_is_called_once_per_layer_in_order_with_that_layers_kv_written(model: TinyLlama) -> None:
    """``on_layer(i)`` runs right after layer i wrote the chunk's K and V: that layer holds
    its final KV (what a forward without the callback writes), later layers nothing yet."""
    tokens = torch.randint(0, CFG.geometry.vocab, (40,), generator=torch.Generator().manual_seed(1))
    table = torch.arange(3)
    want = new_kv_pool(CFG, 3, TPB, "cpu")
    model.forward(tokens, 0, want, table)
    pool = new_kv_pool(CFG, 3, TPB, "cpu")
    seen: list[int] = []

    def on_layer(i: int) -> None:
        assert torch.equal(pool.layers[i], want.layers[i]), f"layer {i} not final at its callback"
        assert all(not bool(pool.layers[j].any()) for j in range(i + 1, CFG.geometry.layers)), (
            f"a layer after {i} was written before its callback"
        )
        seen.append(i)

    model.forward(tokens, 0, pool, table, on_layer=on_layer)
    assert seen == list(range(CFG.geometry.layers))
    assert all(torch.equal(a, b) for a, b in zip(pool.layers, want.layers))


@pytest.mark.parametrize("groups", [1, 2, CFG.geometry.layers], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("chunk", [None, 24], ids=["unchunked", "chunk24"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "baseline"])
def test_layerwise_streaming_matches_aggregated(model: TinyLlama, groups: int, chunk, early: bool) -> None:  # type: ignore[no-untyped-def]
    """Layer-wise streaming of the last chunk: outputs equal aggregated serving's, the KV at
    the generation worker is bit exact, each layer of each block crosses once, and the last
    chunk's blocks leave from the per-layer callback (records of kind "layer"), so that the
    forward afterwards sends no block of the last chunk again."""
    agg = Aggregated(model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk)
    dis = Disaggregated(
        model, num_blocks=256, tokens_per_block=TPB, chunk_size=chunk, early=early, layer_groups=groups, record=True
    )
    records = dis.hook.sender.records
    assert records is not None and records == []
    gen = _sessions(seed=13, n=2, turns=2, system=60, new=(5, 30), out=3)
    try:
        for turns, got_a, got_d in _both(agg, dis, gen):
            for turn in turns:
                a, d = got_a[turn.request_id], got_d[turn.request_id]
                assert d.outputs == a.outputs, f"request {turn.request_id}"
                assert d.kv_mismatch_blocks == 0 and d.digests
                _assert_layers_cross_once(d.notices, -(-d.prompt_len // TPB))
                assert all(n.groups == groups for n in d.notices if not n.whole)
                mine = lambda kind: [  # noqa: E731
                    n for rec in records if rec.kind == kind for n in rec.notices if n.request_id == turn.request_id
                ]
                assert mine("layer"), "nothing left from the per-layer callback"
                # Nothing of the last chunk's blocks went after the forward.
                last_start = (
                    d.reused_len + (d.prompt_len - 1 - d.reused_len) // chunk * chunk if chunk else d.reused_len
                )
                assert all(n.whole and n.end <= last_start // TPB for n in mine("chunk")), (last_start, mine("chunk"))
            records.clear()  # what the next turn sends
    finally:
        dis.close()


@pytest.mark.parametrize("transport", ["shm", "staging"])
def test_two_process_layerwise_streaming_matches_aggregated(model: TinyLlama, transport: str) -> None:
    """The generation worker in its own process: its receiver takes the layer-group notices
    as they come; outputs and KV match aggregated serving."""
    _assert_serving_matches(model, transport, seed=17, layer_groups=2)


def test_layer_groups_out_of_range_is_refused(model: TinyLlama) -> None:
    for bad in (0, CFG.geometry.layers + 1):
        with pytest.raises(ValueError, match=rf"invalid layer_groups={bad}"):
            Disaggregated(model, num_blocks=16, tokens_per_block=TPB, chunk_size=None, layer_groups=bad)
