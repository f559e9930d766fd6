"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention over a paged KV cache,
SwiGLU) with random weights from a fixed seed: nothing is downloaded.

KV layout, per layer: ``(num_blocks, 2, tokens_per_block, kv_heads, head_dim)`` (K then V of
a block side by side), so one block of one layer is contiguous.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvferry.geometry import Geometry
from kvferry.layout import PagedKV

__all__ = ["ModelConfig", "TinyLlama", "forward_peak_bytes", "new_kv_pool", "weights_bytes"]


@dataclass(frozen=True)
class ModelConfig:
    """The reference model: its `Geometry`, its numerics and the dtype of weights and KV."""

    geometry: Geometry = Geometry()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.geometry.kv_bytes_per_token(self.element_size)

    def kv_layer_shape(self, num_blocks: int, tokens_per_block: int) -> tuple[int, ...]:
        """One layer of a paged KV pool: K then V of each block side by side."""
        return (num_blocks, 2, tokens_per_block, self.geometry.kv_heads, self.geometry.head_dim)


def new_kv_pool(cfg: ModelConfig, num_blocks: int, tokens_per_block: int, device: str | torch.device) -> PagedKV:
    """A zeroed paged KV pool for ``cfg``."""
    shape = cfg.kv_layer_shape(num_blocks, tokens_per_block)
    layers = cfg.geometry.layers
    return PagedKV(tuple(torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(layers)), tokens_per_block)


def weights_bytes(cfg: ModelConfig) -> int:
    """Device bytes of one `TinyLlama` of ``cfg``: `Geometry.weight_elements` at the model's
    dtype, its RMSNorm weights and the rotary frequencies (float64)."""
    g = cfg.geometry
    norms = (2 * g.layers + 1) * g.hidden
    return (g.weight_elements() + norms) * cfg.element_size + (g.head_dim // 2) * 8


def forward_peak_bytes(cfg: ModelConfig, tokens: int, end: int, tokens_per_block: int) -> int:
    """A bound of the device bytes `TinyLlama.forward` allocates at its peak, beyond the
    weights and the KV pool, for ``tokens`` tokens ending at position ``end``: what lives
    through every layer, plus the largest of a layer's steps (each step's tensors die when
    it returns):

    ```
    live:       x, the bool causal mask (n x end), positions, their blocks and slots
    project:    RMSNorm's output, the projections and RoPE's halves, q, k, v
    attention:  q, keys/values gathered over end and repeated to every head (2 x end x
                heads x head_dim), SDPA's additive mask made from the bool one (n x end:
                logical_not, then the dtype), the memory-efficient kernel's copy padded to
                a multiple of 8 columns, the output and its logsumexp
    residual:   the attention output, its projection, the new x
    MLP:        RMSNorm's output, silu(gate), up and their product (3 x n x ffn)
    RMSNorm:    two float32 copies of x
    ```
    The attention kernels on CUDA (cuDNN or memory-efficient: the bool mask rules out flash)
    never materialize heads x n x end scores; the math backend would (in float32: it upcasts
    bf16), and is not counted."""
    g, es = cfg.geometry, cfg.element_size
    n, h, heads, kv, d = tokens, g.hidden, g.heads, g.kv_heads, g.head_dim
    gathered = -(-end // tokens_per_block) * tokens_per_block  # whole blocks, then sliced to end
    live = n * h * es + n * end + 3 * n * 8
    project = n * h * es + 3 * n * heads * d * es + 2 * n * kv * d * es + n * (d // 2) * (8 + 2 * es) + n * 8
    padded = -(-end // 8) * 8
    attention = (
        n * heads * d * es  # q
        + 2 * gathered * kv * d * es  # keys, values
        + 2 * end * heads * d * es  # repeated to every head
        + n * end  # logical_not of the mask
        + n * end * es  # the additive mask
        + (n * padded * es if padded != end else 0)  # the memory-efficient kernel's aligned copy
        + n * heads * d * es  # the output
        + n * heads * 4  # logsumexp (float32)
    )
    residual = n * heads * d * es + 2 * n * h * es
    mlp = n * h * es + 3 * n * g.ffn * es
    rms = 2 * n * h * 4
    return live + max(project, attention, residual, mlp, rms)


class TinyLlama:
    """Greedy next-token model over one request's paged KV at a time."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        # Weights are drawn on the model's device (an 8B geometry is too slow to draw on the
        # host); the same seed gives the same weights on every worker of that device type.
        gen = torch.Generator(device=self.device).manual_seed(cfg.geometry.seed)

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32) * scale).to(cfg.dtype)

        g = cfg.geometry
        h, d = g.hidden, g.head_dim
        self.embed = w(g.vocab, h, scale=1.0)
        self.layers = []
        for _ in range(g.layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(h, device=self.device, dtype=cfg.dtype),
                    "wq": w(h, g.heads * d, scale=1 / math.sqrt(h)),
                    "wk": w(h, g.kv_heads * d, scale=1 / math.sqrt(h)),
                    "wv": w(h, g.kv_heads * d, scale=1 / math.sqrt(h)),
                    "wo": w(g.heads * d, h, scale=1 / math.sqrt(g.heads * d)),
                    "mlp_norm": torch.ones(h, device=self.device, dtype=cfg.dtype),
                    "w_gate": w(h, g.ffn, scale=1 / math.sqrt(h)),
                    "w_up": w(h, g.ffn, scale=1 / math.sqrt(h)),
                    "w_down": w(g.ffn, h, scale=1 / math.sqrt(g.ffn)),
                }
            )
        self.final_norm = torch.ones(h, device=self.device, dtype=cfg.dtype)
        self.lm_head = w(h, g.vocab, scale=1 / math.sqrt(h))
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq = inv_freq.to(self.device)

    def _attention_kernel(self, queries: int) -> contextlib.AbstractContextManager[None]:
        """A decode step's attention on CUDA is pinned to the memory-efficient kernel.
        Torch's default there is cuDNN, which plans per shape, and every decode step has a
        new key length: at 8B geometry identical queries, keys, values and mask gave
        attention outputs that differed in the last bits between the aggregated worker and
        the generation workers in 7 of 12 decode steps, enough to flip a near-tied greedy
        token; pinned, 0 of 12 (docs/benchmarks.md, "Output mismatch"). Prefill keeps
        torch's choice (2x faster than the pinned kernel at 2k x 34k, and bit-equal across
        workers in every run: the KV digests): the bool mask rules out flash attention, so
        cuDNN where torch ranks it first, else the memory-efficient kernel; neither
        materializes the heads x n x end scores (`forward_peak_bytes`)."""
        if self.device.type != "cuda" or queries != 1:
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.cfg.norm_eps)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.double()[:, None] * self._inv_freq[None, :]
        cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def _project(
        self,
        x: torch.Tensor,
        layer: dict[str, torch.Tensor],
        cache: torch.Tensor,
        positions: torch.Tensor,
        blocks: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Writes the chunk's K and V of one layer into its blocks; returns its queries."""
        g = self.cfg.geometry
        n = x.shape[0]
        a = self._rms(x, layer["attn_norm"])
        q = self._rope((a @ layer["wq"]).view(n, g.heads, g.head_dim), positions)
        k = self._rope((a @ layer["wk"]).view(n, g.kv_heads, g.head_dim), positions)
        v = (a @ layer["wv"]).view(n, g.kv_heads, g.head_dim)
        cache[blocks, 0, slots] = k
        cache[blocks, 1, slots] = v
        return q

    def _attend(
        self, q: torch.Tensor, cache: torch.Tensor, used: torch.Tensor, end: int, causal: torch.Tensor
    ) -> torch.Tensor:
        """One layer's attention of the queries over positions ``[0, end)``: (n, heads, head_dim)."""
        g = self.cfg.geometry
        keys = cache[used, 0].reshape(-1, g.kv_heads, g.head_dim)[:end]
        values = cache[used, 1].reshape(-1, g.kv_heads, g.head_dim)[:end]
        group = g.heads // g.kv_heads
        with self._attention_kernel(q.shape[0]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.repeat_interleave(group, dim=1).transpose(0, 1)[None],
                values.repeat_interleave(group, dim=1).transpose(0, 1)[None],
                attn_mask=causal[None, None],
            )[0].transpose(0, 1)

    @staticmethod
    def _mlp(m: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        return (torch.nn.functional.silu(m @ layer["w_gate"]) * (m @ layer["w_up"])) @ layer["w_down"]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: PagedKV,
        block_table: torch.Tensor,
        on_layer: Optional[Callable[[int], None]] = None,
    ) -> torch.Tensor:
        """Runs tokens at positions ``[start, start + len(tokens))`` of one request, writing
        their K and V into ``kv`` at the blocks of ``block_table`` and attending over
        positions ``[0, start + len(tokens))``. Returns the logits of the last position.

        ``on_layer(i)`` is called once per layer, in order, right after layer ``i`` wrote
        the chunk's K and V into ``kv`` (on CUDA: once those writes are enqueued on the
        current stream). Nothing later in the forward changes them, so layer-wise streaming
        (`TransferHook.after_layer`) may send that layer's part of the blocks from there."""
        tpb = kv.tokens_per_block
        n = tokens.numel()
        end = start + n
        positions = torch.arange(start, end, device=self.device)
        blocks = block_table[positions // tpb]
        slots = positions % tpb
        used = block_table[: -(-end // tpb)]
        x = self.embed[tokens]
        causal = positions[:, None] >= torch.arange(end, device=self.device)[None, :]
        # Each step is a method so that its tensors die when it returns: at a 32k-token chunk
        # each is 0.07-0.3 GB, and the memory check counts the forward's peak
        # (`forward_peak_bytes`). The operations are the dense loop's, in its order.
        for index, (layer, cache) in enumerate(zip(self.layers, kv.layers)):
            q = self._project(x, layer, cache, positions, blocks, slots)
            if on_layer is not None:
                on_layer(index)
            x = x + self._attend(q, cache, used, end, causal).reshape(n, -1) @ layer["wo"]
            del q  # not alive through the MLP
            x = x + self._mlp(self._rms(x, layer["mlp_norm"]), layer)
        return (self._rms(x[-1:], self.final_norm) @ self.lm_head)[0].float()
