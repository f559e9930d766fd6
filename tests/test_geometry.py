"""kvferry.geometry: the one model-geometry type, what it counts, and the CLI flags built from it."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from kvferry.cli import build_parser
from kvferry.errors import InvalidArgumentError
from kvferry.geometry import AGENTIC_MODEL, VLLM_BENCH_MODEL, Geometry
from kvferry.refengine.model import ModelConfig, TinyLlama, new_kv_pool


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": 0}, "invalid layers=0: must be an int >= 1"),
        ({"hidden": -4}, "invalid hidden=-4: must be an int >= 1"),
        ({"ffn": 2.5}, "invalid ffn=2.5: must be an int >= 1"),
        ({"vocab": True}, "invalid vocab=True: must be an int >= 1"),
        ({"seed": -1}, "invalid seed=-1: must be an int >= 0"),
        ({"heads": 6, "kv_heads": 4}, "invalid heads=6: must be a multiple of kv_heads=4"),
        ({"head_dim": 33}, "invalid head_dim=33: must be even"),
    ],
)
def test_bad_geometry_names_the_field_and_its_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Geometry().replace(**changes)


def test_counts_match_the_reference_model_it_sizes() -> None:
    g = Geometry(layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=128)
    cfg = ModelConfig(g, dtype=torch.float32)
    model = TinyLlama(cfg)
    tensors = [model.embed, model.lm_head] + [
        w for layer in model.layers for name, w in layer.items() if name.startswith("w")
    ]
    assert sum(t.numel() for t in tensors) == g.weight_elements()
    pool = new_kv_pool(cfg, num_blocks=5, tokens_per_block=8, device="cpu")
    per_block_token = sum(layer[0].numel() for layer in pool.layers) // 8
    assert per_block_token == g.kv_elements_per_token()
    assert cfg.kv_bytes_per_token == g.kv_bytes_per_token(4) == 4 * per_block_token


@pytest.mark.parametrize(("bench", "default"), [("agentic", AGENTIC_MODEL), ("vllm", VLLM_BENCH_MODEL)])
def test_bench_flags_are_the_geometry_fields_with_the_bench_default(bench: str, default: Geometry) -> None:
    args = build_parser().parse_args(["bench", bench])
    assert Geometry(**{f.name: getattr(args, f.name) for f in fields(Geometry)}) == default
    changed = build_parser().parse_args(["bench", bench, "--layers", "3", "--kv-heads", "1", "--seed", "7"])
    assert (changed.layers, changed.kv_heads, changed.seed) == (3, 1, 7)
