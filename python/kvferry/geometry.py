"""The shape of a Llama-style decoder: the one type every model of kvferry's is sized by.

The reference engine's model (`kvferry.refengine.model.ModelConfig`), the benches' configs
(`AgenticConfig`, `FanoutConfig`, `VllmBenchConfig`) and the random Hugging Face model the vLLM
tests serve (`kvferry.vllm.testbed.RandomLlama`) each embed one `Geometry`; the CLI builds its
model flags from its fields (`kvferry.cli`), each bench with its own default geometry. It needs
no torch: sizes are counted in elements, and a caller multiplies by its dtype's width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from kvferry.errors import InvalidArgumentError

__all__ = [
    "AGENTIC_MODEL",
    "FANOUT_MODEL",
    "GEOMETRY_HELP",
    "VLLM_BENCH_MODEL",
    "VLLM_REALISTIC_MODEL",
    "VLLM_TEST_MODEL",
    "Geometry",
]

# What each field means, for the CLI's --help (one flag per field).
GEOMETRY_HELP = {
    "layers": "the model's layers",
    "hidden": "the model's hidden size",
    "heads": "attention heads (a multiple of --kv-heads)",
    "kv_heads": "KV heads (grouped-query attention)",
    "head_dim": "dimensions per head (even: rotary embeddings rotate pairs)",
    "ffn": "the model's MLP width",
    "vocab": "the model's vocabulary size",
    "seed": "the seed its random weights are drawn from",
}


@dataclass(frozen=True)
class Geometry:
    """A decoder's sizes. Every count is a positive int (``seed`` may be 0); ``heads`` is a
    multiple of ``kv_heads`` (grouped-query attention) and ``head_dim`` is even (rotary
    embeddings rotate pairs of dimensions). A bad value raises `InvalidArgumentError` naming
    the field and its value."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 512
    vocab: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"invalid {f.name}={value!r}: must be an int >= {low}")
        if self.heads % self.kv_heads:
            raise InvalidArgumentError(f"invalid heads={self.heads}: must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"invalid head_dim={self.head_dim}: must be even (rotary embeddings rotate pairs)"
            )

    def replace(self, **changes: Any) -> Geometry:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    def kv_elements_per_token(self) -> int:
        """K and V of one token over every layer, in elements."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of one token over every layer, in bytes, at ``element_size`` bytes an element."""
        return self.kv_elements_per_token() * element_size

    def weight_elements(self) -> int:
        """The weights' elements: embedding and LM head, and per layer the attention
        projections (Q and O over ``heads``, K and V over ``kv_heads``) and the gated MLP."""
        per_layer = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        per_layer += 3 * self.hidden * self.ffn
        return 2 * self.vocab * self.hidden + self.layers * per_layer


# The default models of the benches and the vLLM tests, here (torch-free) so that the CLI's
# flags default to them without importing a bench.
# `kvferry bench agentic`: big enough that a CPU prefill takes a while next to the link.
AGENTIC_MODEL = Geometry(layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1024)
# `kvferry bench fanout`: many requests at once, so a smaller model.
FANOUT_MODEL = Geometry(layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=512)
# `kvferry bench vllm` (head_dim 32, 64 or 128: what vLLM's CPU attention kernel takes).
VLLM_BENCH_MODEL = Geometry(layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512)
# `kvferry bench vllm --realistic`: a Llama-8B-like KV geometry (32 layers x 8 KV heads x 128,
# 256 KiB of fp32 KV per token) on a narrow model (hidden 256), so that a 2-core CPU computes it.
VLLM_REALISTIC_MODEL = Geometry(layers=32, hidden=256, heads=8, kv_heads=8, head_dim=128, ffn=512)
# The vLLM tests' random model: a server starts in seconds.
VLLM_TEST_MODEL = Geometry(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256)
