"""Is one greedy decode step of the reference model bitwise repeatable on this GPU: within a
process, across processes, and next to a copy on another stream? Diagnoses output mismatches
between aggregated and disaggregated runs whose KV was checked bit exact.

    python benches/probes/gpu_determinism.py [--layers 32] [--context 34820]

Prints, per variant, whether the logits equal the first in-process run bit for bit, their
largest difference, and the greedy token with its margin over the runner-up.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
from typing import Any

import torch
from kvferry.geometry import Geometry
from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool

TPB = 32


def _setup(layers: int, context: int) -> tuple[TinyLlama, Any, torch.Tensor]:
    cfg = ModelConfig(
        Geometry(vocab=1024, hidden=4096, layers=layers, heads=32, kv_heads=8, head_dim=128, ffn=14336),
        dtype=torch.bfloat16,
    )
    model = TinyLlama(cfg, "cuda")
    blocks = -(-(context + 1) // TPB)
    pool = new_kv_pool(cfg, blocks, TPB, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for layer in pool.layers:  # KV of the magnitude a forward writes
        layer.copy_(torch.randn(layer.shape, generator=gen, device="cuda", dtype=torch.float32).to(layer.dtype))
    return model, pool, torch.arange(blocks, device="cuda")


def decode_logits(layers: int, context: int, repeats: int, side_copy: bool = False) -> list[torch.Tensor]:
    model, pool, table = _setup(layers, context)
    token = torch.tensor([7], device="cuda")
    side = torch.cuda.Stream()
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda") if side_copy else None
    out = []
    for _ in range(repeats):
        if big is not None:
            with torch.cuda.stream(side):
                big[: 2 << 30].copy_(big[2 << 30 :])
        out.append(model.forward(token, context, pool, table).cpu())
        torch.cuda.synchronize()
    return out


def prefill_repeats(layers: int, context: int, new: int, backend: str, repeats: int = 3) -> list[bool]:
    """Prefill of ``new`` tokens after ``context`` cached ones, repeated: whether the KV it
    writes and its logits equal the first run's bit for bit, per repeat. ``backend`` pins
    SDPA's kernel ("default": torch's choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, pool, table = _setup(layers, context + new)
    tokens = torch.randint(0, model.cfg.geometry.vocab, (new,), generator=torch.Generator().manual_seed(2)).cuda()
    chosen = {
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "math": [SDPBackend.MATH],
    }
    runs = []
    for _ in range(repeats):
        if backend == "default":
            logits = model.forward(tokens, context, pool, table)
        else:
            with sdpa_kernel(chosen[backend]):
                logits = model.forward(tokens, context, pool, table)
        kv = torch.cat([layer[context // TPB :].reshape(-1).view(torch.int16) for layer in pool.layers])
        runs.append((logits.cpu(), kv.clone()))
    return [torch.equal(runs[0][0], lg) and torch.equal(runs[0][1], kv) for lg, kv in runs[1:]]


def sdpa_repeats(context: int, repeats: int = 20) -> None:
    """One decode step's attention alone (1 query over ``context`` keys, 32 heads, GQA as the
    model lays it out, a boolean mask), per SDPA backend: is it bit-equal to its first run
    when other work runs on other streams at the same time (a device-to-device copy kernel,
    a host-to-device copy on the copy engine as a staging receiver issues, a matmul)? Also
    which backend torch's default matches."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    q = (
        torch.randn(1, 32, 128, generator=gen, device="cuda", dtype=torch.float32)
        .to(torch.bfloat16)
        .transpose(0, 1)[None]
    )
    keys = torch.randn(context, 8, 128, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    values = torch.randn(context, 8, 128, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    k = keys.repeat_interleave(4, dim=1).transpose(0, 1)[None]
    v = values.repeat_interleave(4, dim=1).transpose(0, 1)[None]
    mask = torch.ones(1, 1, 1, context, dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    loads = {
        "quiet": lambda: None,
        "d2d copy kernel": lambda: big[: 1 << 30].copy_(big[1 << 30 :]),
        "h2d copy engine": lambda: big[: 1 << 30].copy_(host, non_blocking=True),
        "matmul": lambda: a @ a,
    }
    backends = {
        "default": None,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    outputs = {}
    for name, backend in backends.items():

        def attend() -> torch.Tensor:
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        try:
            ref = attend()
        except RuntimeError as err:
            print(f"sdpa {name:<9}: not available ({str(err).splitlines()[0][:90]})")
            continue
        torch.cuda.synchronize()
        outputs[name] = ref
        for load_name, load in loads.items():
            equal = 0
            for _ in range(repeats):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    load()
                got = attend()
                torch.cuda.synchronize()
                equal += bool(torch.equal(got, ref))
            print(
                (
                    f"sdpa {name:<9} decode over {context} keys, {load_name:<16}: {equal}/{repeats} runs bit-equal "
                    "to the first"
                )
            )
    for name, out in outputs.items():
        if name != "default":
            print(f"sdpa default output bit-equal to {name}: {torch.equal(outputs['default'], out)}")


def sdpa_surroundings(context: int, repeats: int = 5) -> None:
    """Does one decode step's attention depend on bytes outside its inputs or on where they
    start? Same values each time, placed in larger buffers whose bytes past the views'
    ends hold fresh random values, NaN or zeros, and at several start offsets; per backend,
    how many runs equal the first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(4)
    keys = torch.randn(context, 32, 128, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    values = torch.randn(context, 32, 128, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    query = torch.randn(1, 32, 128, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    slack = 1 << 20

    def placed(t: torch.Tensor, offset: int, fill: str) -> torch.Tensor:
        buf = torch.empty(offset + t.numel() + slack, dtype=t.dtype, device="cuda")
        tail = buf[offset + t.numel() :]
        if fill == "random":
            tail.copy_(torch.randn(tail.shape, device="cuda", dtype=torch.float32).mul_(100))
        else:
            tail.fill_(float("nan") if fill == "nan" else 0.0)
        view = buf[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    backends = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for name, backend in backends.items():
        ref = None
        results = []
        for offset in (0, 8, 64):
            for fill in ("zeros", "random", "nan"):
                for _ in range(repeats):
                    k = placed(keys, offset, fill).transpose(0, 1)[None]
                    v = placed(values, offset, fill).transpose(0, 1)[None]
                    q = placed(query, offset, fill).transpose(0, 1)[None]
                    mask = torch.ones(1, 1, 1, context, dtype=torch.bool, device="cuda")
                    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    ref = out.clone() if ref is None else ref
                    results.append((offset, fill, bool(torch.equal(out, ref)), bool(torch.isnan(out).any())))
        bad = [(o, f) for o, f, same, _ in results if not same]
        nans = sorted({(o, f) for o, f, _, n in results if n})
        print(
            (
                f"sdpa {name:<9} over {context} keys: {len(results) - len(bad)}/{len(results)} runs equal the "
                f"first; differing (offset, tail): {sorted(set(bad))}; NaN outputs: {nans}"
            )
        )


def _child(conn: Any, layers: int, context: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    # As numpy arrays: a tensor would cross as a shared file descriptor that dies with us.
    conn.send([t.numpy() for t in decode_logits(layers, context, 2)])


def _in_child(layers: int, context: int, env: dict[str, str]) -> list[torch.Tensor]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, layers, context, env))
    proc.start()
    got = parent.recv()
    proc.join()
    return [torch.from_numpy(a) for a in got]


def _describe(name: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    top = got.topk(2)
    print(
        f"{name:<44} bit-equal {torch.equal(ref, got)!s:<5} max |diff| {float((ref - got).abs().max()):.3e} "
        f"greedy {int(top.indices[0])} (margin {float(top.values[0] - top.values[1]):.3e}, reference "
        f"{int(ref.argmax())})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=34820)
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill repeatability checks")
    parser.add_argument(
        "--sdpa", action="store_true", help="only one decode step's attention, per backend, next to other streams' work"
    )
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.layers} layers, context {args.context}")
    if args.sdpa:
        sdpa_repeats(args.context)
        sdpa_surroundings(args.context)
        return
    for backend in ("default", "efficient", "cudnn"):
        try:
            same = prefill_repeats(args.layers, args.context - 2048, 2048, backend)
            print(
                (
                    f"prefill of 2048 tokens after {args.context - 2048}, SDPA {backend:<9}: repeats bit-equal to "
                    f"the first: {same}"
                )
            )
        except RuntimeError as err:  # a backend that cannot run this shape
            print(f"prefill, SDPA {backend}: not available here ({str(err).splitlines()[0][:100]})")
        torch.cuda.empty_cache()
    if args.prefill_only:
        return
    local = decode_logits(args.layers, args.context, 3)
    ref = local[0]
    for i, got in enumerate(local[1:], 1):
        _describe(f"same process, repeat {i}", ref, got)
    _describe(
        "same process, copy running on another stream",
        ref,
        decode_logits(args.layers, args.context, 1, side_copy=True)[0],
    )
    for name, env in (
        ("another process", {}),
        ("another process, CUBLAS_WORKSPACE_CONFIG", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    ):
        for i, got in enumerate(_in_child(args.layers, args.context, env)):
            _describe(f"{name}, run {i}", ref, got)


if __name__ == "__main__":
    main()
