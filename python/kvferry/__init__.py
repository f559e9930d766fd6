"""kvferry: KV-cache transfer for disaggregated LLM serving that starts before prefill.

The complete KV blocks of a request's reused prefix leave the context worker before its
first forward; each finished prefill chunk then sends the blocks it completed. Every block
crosses exactly once.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from kvferry._core import (
    MAX_LEDGER_BLOCKS,
    BlockPairs,
    BlockRange,
    BlockRuns,
    RequestSpec,
    SlicePlan,
    TransferBook,
    TransferLedger,
    block_pairs,
    block_runs,
    chunk_blocks,
    early_prefix_blocks,
    select_early,
)
from kvferry.errors import (
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    MissingDependencyError,
    UnknownRequestError,
)


def _version() -> str:
    """The installed distribution's version (maturin takes it from rust/Cargo.toml); a source
    tree that was never installed reports ``0+unknown``, a valid PEP 440 version that sorts
    before every release."""
    try:
        return _metadata.version("kvferry")
    except _metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "__version__",
    "MAX_LEDGER_BLOCKS",
    "BlockPairs",
    "BlockRange",
    "BlockRuns",
    "DuplicateTransferError",
    "InvalidArgumentError",
    "KvFerryError",
    "MissingDependencyError",
    "RequestSpec",
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
