"""Is one greedy decode step of the reference model bitwise repeatable on this GPU: within a
process, across processes, and next to a copy on another stream? Diagnoses output mismatches
between aggregated and disaggregated runs whose KV was checked bit exact.

    python benches/python/gpu_determinism.py [--layers 32] [--context 34820]

Prints, per variant, whether the logits equal the first in-process run bit for bit, their
largest difference, and the greedy token with its margin over the runner-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
from typing import Any

import torch

from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool

TPB = 32


def _setup(layers: int, context: int) -> tuple[TinyLlama, Any, torch.Tensor]:
    cfg = ModelConfig(vocab=1024, hidden=4096, layers=layers, heads=32, kv_heads=8, head_dim=128, ffn=14336, dtype=torch.bfloat16)
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
    tokens = torch.randint(0, model.cfg.vocab, (new,), generator=torch.Generator().manual_seed(2)).cuda()
    chosen = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}
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
        f"greedy {int(top.indices[0])} (margin {float(top.values[0] - top.values[1]):.3e}, reference {int(ref.argmax())})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=34820)
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill repeatability checks")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.layers} layers, context {args.context}")
    for backend in ("default", "efficient", "cudnn"):
        try:
            same = prefill_repeats(args.layers, args.context - 2048, 2048, backend)
            print(f"prefill of 2048 tokens after {args.context - 2048}, SDPA {backend:<9}: repeats bit-equal to the first: {same}")
        except RuntimeError as err:  # a backend that cannot run this shape
            print(f"prefill, SDPA {backend}: not available here ({str(err).splitlines()[0][:100]})")
        torch.cuda.empty_cache()
    if args.prefill_only:
        return
    local = decode_logits(args.layers, args.context, 3)
    ref = local[0]
    for i, got in enumerate(local[1:], 1):
        _describe(f"same process, repeat {i}", ref, got)
    _describe("same process, copy running on another stream", ref, decode_logits(args.layers, args.context, 1, side_copy=True)[0])
    for name, env in (("another process", {}), ("another process, CUBLAS_WORKSPACE_CONFIG", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})):
        for i, got in enumerate(_in_child(args.layers, args.context, env)):
            _describe(f"{name}, run {i}", ref, got)


if __name__ == "__main__":
    main()
