"""The memory check of `kvferry bench agentic`: each process's estimate against what the
model, the pools, staging's scratch and the forward actually allocate, and the refusal."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from kvferry.bench.agentic import AgenticConfig, _pool_blocks
from kvferry.bench.agentic_memory import (
    ALLOCATOR_SLACK,
    MIN_SLACK_BYTES,
    RUNTIME_BYTES,
    check_device_memory,
    memory_estimate,
)
from kvferry.errors import InvalidArgumentError
from kvferry.geometry import Geometry
from kvferry.refengine.model import ModelConfig, TinyLlama, forward_peak_bytes, new_kv_pool
from kvferry.transports.staging import _Scratch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LLAMA8B = Geometry(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=1024)
SMALL = Geometry(layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=768, vocab=128)


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops create and that are still referenced, after every
    op (inputs and output alive together), and their peak; storages in ``ignore`` (weights,
    the pool) are not counted."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Freed first: a new storage may take a freed one's address.
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.ignore and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _tensors(model: TinyLlama) -> list[torch.Tensor]:
    return [model.embed, model.final_norm, model.lm_head, model._inv_freq] + [
        t for layer in model.layers for t in layer.values()
    ]


def _measured_forward_peak(model: TinyLlama, start: int, end: int, tpb: int) -> int:
    blocks = -(-end // tpb)
    pool = new_kv_pool(model.cfg, blocks, tpb, "cpu")
    table = torch.randperm(blocks)
    tokens = torch.randint(0, model.cfg.geometry.vocab, (end - start,), generator=torch.Generator().manual_seed(end))
    kept = [*_tensors(model), *pool.layers, table, tokens]
    with LiveBytes({t.untyped_storage().data_ptr() for t in kept}) as live:
        model.forward(tokens, start, pool, table)
    return live.peak


@pytest.mark.parametrize(("start", "end"), [(0, 512), (480, 700), (699, 700)])
def test_forward_peak_bytes_bound_what_the_forward_allocates(start: int, end: int) -> None:
    """Every storage the forward creates (its ops' outputs, tracked until freed) at its
    peak: a first prefill whose mask is the largest term, a chunk over a longer context
    (end not a multiple of 8: the memory-efficient kernel's padded mask is counted, which
    the CPU kernel does not make) and a decode step. The bound holds and stays within a
    quarter of the measured peak."""
    model = TinyLlama(ModelConfig(SMALL))
    measured = _measured_forward_peak(model, start, end, 16)
    bound = forward_peak_bytes(model.cfg, end - start, end, 16)
    assert measured <= bound <= 1.25 * measured, (measured, bound)


@pytest.mark.cuda
def test_forward_peak_bytes_bound_the_cuda_allocators_peak() -> None:
    """On CUDA in bf16 (the bench's dtype there) the caching allocator's peak over a first
    prefill and a later chunk stays within `forward_peak_bytes` (its SDPA kernels included).
    cuBLAS's workspace is not the forward's: the first matmul on a stream allocates it (32 MiB
    on an H100, live at the prefill's peak in benches/probes/forward_peak.py) and it stays for
    the process's life, counted once per process in the memory check's `RUNTIME_BYTES`. So it
    is made before the peaks are measured."""
    cfg = ModelConfig(SMALL.replace(hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2048), dtype=torch.bfloat16)
    model = TinyLlama(cfg, "cuda")
    tpb = 32
    square = torch.ones(64, 64, device="cuda", dtype=cfg.dtype)
    _ = square @ square  # cuBLAS's workspace on this stream, before any peak is taken
    for start, end in [(0, 4096), (4000, 4600)]:
        pool = new_kv_pool(cfg, -(-end // tpb), tpb, "cuda")
        table = torch.arange(pool.num_blocks, device="cuda")
        tokens = torch.randint(0, cfg.geometry.vocab, (end - start,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.forward(tokens, start, pool, table)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= forward_peak_bytes(cfg, end - start, end, tpb), (start, end, peak)


def _cfg(**over: Any) -> AgenticConfig:
    fields: dict[str, Any] = dict(
        device="cuda",
        transport="staging",
        sessions=2,
        turns=2,
        cached_tokens=512,
        new_tokens=64,
        output_tokens=4,
        tokens_per_block=16,
        aware=True,
        layer_groups=3,
        model=SMALL,
    )
    fields.update(over)
    return AgenticConfig(**fields)


def test_each_process_counts_weights_pools_scratch_and_the_largest_forward() -> None:
    """Each term computed from what the run's parts allocate: the weights of a model of the
    run's dtype, the pools `new_kv_pool` makes, staging's scratch pools for whole blocks and
    for the layer-wise mode's slices (4 layers in 3 groups: slices of 1 and 2 layers) on
    both sides, and the forwards: the warm-up turn's whole conversation in the context
    process, the longest decode step in the generation process; then slack and runtime."""
    cfg = _cfg()
    model_cfg = cfg.model_config()
    assert model_cfg.dtype == torch.bfloat16
    weights = sum(t.nbytes for t in _tensors(TinyLlama(model_cfg)))
    pool = new_kv_pool(model_cfg, _pool_blocks(cfg), cfg.tokens_per_block, "cpu")
    pools = len(cfg.modes) * sum(t.nbytes for t in pool.layers)
    scratch = _Scratch()

    def pair(p: Any) -> int:  # two pieces in flight on CUDA
        return sum(sum(t.nbytes for t in scratch.like(p, turn).layers) for turn in (0, 1))

    whole = pair(pool)
    slices = pair(pool.layer_slice(0, 1)) + pair(pool.layer_slice(2, 4))  # group sizes 1, 1, 2
    staging = len(cfg.modes) * whole + slices
    last_prompt = 512 + 2 * (64 + 4)
    prefill = forward_peak_bytes(model_cfg, 512, 512, 16)
    decode = forward_peak_bytes(model_cfg, 1, last_prompt + 4, 16)

    context, generation = memory_estimate(cfg)
    for process, transients in ((context, prefill), (generation, decode)):
        slack = max(int(ALLOCATOR_SLACK * transients), MIN_SLACK_BYTES)
        assert process.terms() == {
            "weights": weights,
            "pools": pools,
            "scratch": staging,
            "transients": transients,
            "slack": slack,
            "runtime": RUNTIME_BYTES,
            "total": weights + pools + staging + transients + slack + RUNTIME_BYTES,
        }, process
    assert context.forward == (512, 512) and generation.forward == (1, last_prompt + 4)


def test_chunks_bound_the_prefills_transients_and_in_process_is_one_process() -> None:
    """With ``chunk_size`` the largest forward is a chunk (the largest over every turn's
    chunks); an in-process transport keeps every pool in one process, with one copy of the
    weights and no scratch."""
    cfg = _cfg(chunk_size=200)
    (context, _) = memory_estimate(cfg)
    m = cfg.model_config()
    # The warm-up turn: [0, 200), [200, 400), [400, 512); later turns: 68 tokens each.
    want = max(forward_peak_bytes(m, n, end, 16) for n, end in [(200, 200), (200, 400), (112, 512), (68, 580)])
    assert context.transients == want == forward_peak_bytes(m, 200, 400, 16)
    (one,) = memory_estimate(_cfg(transport="in-process"))
    assert (one.name, one.pool_count, one.scratch) == ("context+generation", 2 * len(cfg.modes), 0)
    assert one.transients == forward_peak_bytes(m, 512, 512, 16)


def test_the_8b_run_that_ran_out_of_memory_on_an_h100_is_refused_by_name() -> None:
    """`--sessions 1 --cached 32768 --new 2048 --aware --layerwise 8 --transport staging` at
    Llama-8B geometry passed the old check (pools and two copies of the weights: 73 GB)
    and died on an 80 GB H100 with the generation process at 36.5 GiB and the context
    process at 42 GiB. Each estimate covers what its process held; the refusal names every
    figure and the flags that lower them. With one mode fewer it fits."""
    cfg = AgenticConfig(
        device="cuda",
        transport="staging",
        sessions=1,
        cached_tokens=32768,
        new_tokens=2048,
        aware=True,
        layer_groups=8,
        model=LLAMA8B,
    )
    context, generation = memory_estimate(cfg)
    assert context.total > 42 * 2**30 and generation.total > 36.5 * 2**30, (context, generation)
    free = 81559 * 2**20 - 2**29  # an H100's memory less this process's CUDA context
    with pytest.raises(InvalidArgumentError) as err:
        check_device_memory(cfg, free)
    text = str(err.value)
    for figure in (
        f"need {(context.total + generation.total) / 1e9:.1f} GB",
        f"free {free / 1e9:.1f} GB",
        f"context process {context.total / 1e9:.1f} GB",
        f"generation process {generation.total / 1e9:.1f} GB",
        "4 pools of 1348 blocks 22.6",
        "staging scratch 2.7",
        f"forward transients {context.transients / 1e9:.1f} (a 32768-token forward ending at 32768)",
        "--sessions, --cached, --turns or --new",
        "--chunk",
        "--aware or --layerwise",
    ):
        assert figure in text, (figure, text)
    fewer = dataclasses.replace(cfg, aware=False)
    assert check_device_memory(fewer, free) == memory_estimate(fewer)


def test_a_run_reports_each_processs_estimate() -> None:
    """The result carries each process's estimate by term (peaks on CUDA only)."""
    from kvferry.bench.agentic import format_agentic, run_agentic

    cfg = _cfg(device="cpu", sessions=1, turns=1, cached_tokens=64, new_tokens=16, output_tokens=2, link_gbps=None)
    result = run_agentic(cfg)
    estimates = {p.name: p.terms() for p in memory_estimate(cfg)}
    assert {name: m["estimate"] for name, m in result["memory"].items()} == estimates
    assert all(m["peak"] is None for m in result["memory"].values())
    assert result["outputs_match"], result
    assert "device memory" not in format_agentic(result)
    # On CUDA each process's peaks print beside its estimate.
    result["memory"]["generation"]["peak"] = {"max_allocated": 3_250_000_000, "max_reserved": 3_500_000_000}
    total = estimates["generation"]["total"] / 1e9
    assert (
        "device memory, generation process: peak 3.25 GB allocated, 3.50 GB reserved; the memory check's "
        f"estimate {total:.2f} GB"
    ) in format_agentic(result)


def _dense_forward(model: TinyLlama, tokens: torch.Tensor, start: int, kv: Any, block_table: torch.Tensor) -> Any:
    """`TinyLlama.forward` as it was before it dropped each layer's tensors early: every
    layer's locals alive until the next layer rebinds them."""
    g, tpb = model.cfg.geometry, kv.tokens_per_block
    n = tokens.numel()
    end = start + n
    positions = torch.arange(start, end, device=model.device)
    blocks = block_table[positions // tpb]
    slots = positions % tpb
    used = block_table[: -(-end // tpb)]
    x = model.embed[tokens]
    causal = positions[:, None] >= torch.arange(end, device=model.device)[None, :]
    for layer, cache in zip(model.layers, kv.layers):
        a = model._rms(x, layer["attn_norm"])
        q = model._rope((a @ layer["wq"]).view(n, g.heads, g.head_dim), positions)
        k = model._rope((a @ layer["wk"]).view(n, g.kv_heads, g.head_dim), positions)
        v = (a @ layer["wv"]).view(n, g.kv_heads, g.head_dim)
        cache[blocks, 0, slots] = k
        cache[blocks, 1, slots] = v
        keys = cache[used, 0].reshape(-1, g.kv_heads, g.head_dim)[:end]
        values = cache[used, 1].reshape(-1, g.kv_heads, g.head_dim)[:end]
        group = g.heads // g.kv_heads
        with model._attention_kernel(n):
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.repeat_interleave(group, dim=1).transpose(0, 1)[None],
                values.repeat_interleave(group, dim=1).transpose(0, 1)[None],
                attn_mask=causal[None, None],
            )[0].transpose(0, 1)
        x = x + attn.reshape(n, -1) @ layer["wo"]
        m = model._rms(x, layer["mlp_norm"])
        x = x + (torch.nn.functional.silu(m @ layer["w_gate"]) * (m @ layer["w_up"])) @ layer["w_down"]
    return (model._rms(x[-1:], model.final_norm) @ model.lm_head)[0].float()


def _same_as_dense(device: str, dtype: torch.dtype) -> None:
    model = TinyLlama(ModelConfig(SMALL, dtype=dtype), device)
    tpb, gen = 16, torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SMALL.vocab, (300,), generator=gen).to(device)
    table = torch.randperm(24, generator=gen).to(device)
    pools = [new_kv_pool(model.cfg, 24, tpb, device) for _ in range(2)]
    for pool in pools:  # poisoned: a slot the forward should write and did not shows
        for layer in pool.layers:
            layer.fill_(float("nan"))
    # A first prefill, a chunk ending mid-block, a decode step.
    for start, end in [(0, 200), (200, 299), (299, 300)]:
        got = model.forward(prompt[start:end], start, pools[0], table)
        want = _dense_forward(model, prompt[start:end], start, pools[1], table)
        assert torch.equal(got, want), (start, end)
        for a, b in zip(pools[0].layers, pools[1].layers):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (start, end)


def test_the_forward_gives_the_dense_forwards_logits_and_kv_bit_for_bit() -> None:
    """Dropping each layer's tensors as soon as they were used changes no operation: the
    logits and every KV byte equal the dense forward's, on CPU."""
    _same_as_dense("cpu", torch.float32)


@pytest.mark.cuda
def test_the_forward_gives_the_dense_forwards_logits_and_kv_bit_for_bit_on_cuda() -> None:
    """The same on CUDA in bf16, through the SDPA kernels the bench uses there."""
    _same_as_dense("cuda", torch.bfloat16)


@pytest.mark.cuda
def test_each_process_stays_within_its_estimate_on_cuda() -> None:
    """A run over staging with every mode, its warm-up forward 4096 tokens: each process's
    allocator peaks stay within the estimate the run was admitted on (allocated within the
    estimate less its runtime allowance, reserved within the whole), outputs matching."""
    from kvferry.bench.agentic import run_agentic

    geometry = Geometry(layers=4, hidden=1024, heads=8, kv_heads=2, head_dim=128, ffn=2048, vocab=256)
    cfg = _cfg(cached_tokens=4096, new_tokens=256, output_tokens=4, tokens_per_block=32, model=geometry)
    result = run_agentic(cfg)
    assert result["outputs_match"], result["output_divergences"]
    assert set(result["memory"]) == {"context", "generation"}
    for name, m in result["memory"].items():
        peak, estimate = m["peak"], m["estimate"]
        assert peak["max_allocated"] <= estimate["total"] - estimate["runtime"], (name, peak, estimate)
        assert peak["max_reserved"] <= estimate["total"], (name, peak, estimate)
