"""kvferry: KV-cache transfer for disaggregated LLM serving that starts before prefill.

The complete KV blocks of a request's reused prefix leave the context worker before its
first forward; each finished prefill chunk then sends the blocks it completed. Every block
crosses exactly once.
"""

from __future__ import annotations

from kvferry.errors import (
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    UnknownRequestError,
)
from kvferry._core import (
    MAX_LEDGER_BLOCKS,
    BlockPairs,
    BlockRange,
    BlockRuns,
    SlicePlan,
    TransferBook,
    TransferLedger,
    block_pairs,
    block_runs,
    chunk_blocks,
    early_prefix_blocks,
    select_early,
)

__all__ = [
    "MAX_LEDGER_BLOCKS",
    "BlockPairs",
    "BlockRange",
    "BlockRuns",
    "DuplicateTransferError",
    "InvalidArgumentError",
    "KvFerryError",
    "SlicePlan",
    "TransferBook",
    "TransferLedger",
    "UnknownRequestError",
    "block_pairs",
    "block_runs",
    "chunk_blocks",
    "early_prefix_blocks",
    "select_early",
]
