"""Bad input, as a table: every public entry point and CLI option, the input it must refuse,
the exception class, and a piece of the message that names the argument and its value.

Each row runs on fresh objects; rows with a ``state`` also check that the refused call changed
nothing observable (a book's claims, a ledger's bitmap, a receiver's expected set, a pool's
bytes). Rows marked ``xfail`` are open bugs in modules this table may not change; their
reason says where. docs/bad-input.md is generated from these rows (``python
tests/test_bad_input.py``) and `test_doc_lists_every_row` keeps the two in step.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import kvferry
import numpy as np
import pytest
import torch
from helpers import Pools, in_process_pair
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvferry import (
    MAX_LEDGER_BLOCKS,
    BlockRange,
    DuplicateTransferError,
    InvalidArgumentError,
    RequestSpec,
    TransferBook,
    TransferLedger,
    UnknownRequestError,
    block_pairs,
    block_runs,
    chunk_blocks,
    early_prefix_blocks,
    select_early,
)
from kvferry._core import block_checksums, pack_pairs, wire_decode, wire_encode
from kvferry.cli import main
from kvferry.copy import copy_blocks
from kvferry.hook import TransferHook
from kvferry.layout import LayoutMismatchError, PagedKV
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver, LeaseError
from kvferry.sender import KVSender
from kvferry.transports.inprocess import InProcessTransport
from kvferry.transports.shm import ShmTransport
from kvferry.transports.staging import StagingEndpoint

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-input.md"
HUGE = 2**64  # past int64: once a raw OverflowError that named nothing
KEY = bytes(range(32))  # a well-formed session key, for rows about other arguments
CUDA = torch.cuda.is_available()


class CliExit(Exception):
    """A CLI run that exited non-zero; the message is what it printed on stderr."""

    def __init__(self, code: object, stderr: str) -> None:
        super().__init__(stderr.strip())
        self.code = code
        self.stderr = stderr


def cli(*argv: str) -> None:
    """Runs ``kvferry ARGV`` in this process; raises `CliExit` unless it exits 0. An uncaught
    exception (what would print a traceback) propagates and fails the row."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code: object = main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code
    if code != 0:
        raise CliExit(code, err.getvalue())


@dataclass(frozen=True)
class Row:
    id: str
    entry: str  # the callable or CLI command
    bad: str  # the input, as a reader would write it
    call: Callable[[Any], object]
    error: type[BaseException]
    needle: str  # must appear in str(exception): the argument and its value
    setup: Callable[[], Any] = lambda: None
    state: Optional[Callable[[Any], object]] = None
    xfail: Optional[str] = None  # an open bug outside this task's files: strict, the fix named
    skip: Optional[str] = None


def run_row(row: Row) -> BaseException:
    """Sets up, checks the call raises ``row.error`` and leaves the state as it was; returns
    the exception."""
    ctx = row.setup()
    try:
        before = row.state(ctx) if row.state else None
        with pytest.raises(BaseException) as info:
            row.call(ctx)
        err = info.value
        assert isinstance(err, row.error), f"{type(err).__name__}: {err}"
        assert row.needle in str(err), str(err)
        if row.state is not None:
            assert row.state(ctx) == before, "the refused call changed state"
        return err
    finally:
        close(ctx)


def close(ctx: Any) -> None:
    for obj in ctx if isinstance(ctx, tuple) else (ctx,):
        if isinstance(obj, KVSender):
            with contextlib.suppress(Exception):  # a row may have left a failing copy queued
                obj.close()


# ---------------------------------------------------------------------------------------------
# Fixtures of the stateful rows: each builds fresh objects; each state function returns
# everything observable that a refused call must not change.
# ---------------------------------------------------------------------------------------------

TPB = 4


def pool(
    blocks: int = 8,
    *,
    tpb: int = TPB,
    dtype: torch.dtype = torch.float32,
    layers: int = 2,
    inner: int = 4,
    block_dim: int = 0,
) -> PagedKV:
    shape: tuple[int, ...] = (blocks, 2, tpb, inner) if block_dim == 0 else (2, blocks, tpb, inner)
    return Pools(shape, layers, tpb, block_dim, dtype).random(blocks, scale=100)


def new_book() -> TransferBook:
    book = TransferBook(TPB)
    book.add(1, 32, reused_len=12)
    book.add(2, 32)
    return book


def book_with_chunk() -> TransferBook:
    book = new_book()
    book.plan_chunks([2], [0], [8])  # claims [0, 2) of request 2
    return book


def book_state(book: TransferBook) -> object:
    ids = [i for i in (1, 2) if i in book]
    return len(book), [
        (book.claimed_blocks(i), book.prefix_sent(i), book.is_complete(i), book.missing(i), book.is_cancelled(i))
        for i in ids
    ]


def new_ledger() -> TransferLedger:
    ledger = TransferLedger(TPB, 32, reused_len=12)
    ledger.send_early()  # claims [0, 3)
    return ledger


def ledger_state(ledger: TransferLedger) -> object:
    return ledger.claimed_blocks, ledger.missing(), ledger.prefix_sent, ledger.forward_started, ledger.is_complete


def new_plan() -> kvferry.SlicePlan:
    book = TransferBook(TPB)
    book.add(1, 32)
    return book.plan_chunks([1], [0], [32])  # blocks [0, 8) of request 1


def new_pools() -> tuple[PagedKV, PagedKV]:
    return pool(8), pool(6)


def copy(pools: tuple[PagedKV, PagedKV], src_ids: Any, dst_ids: Any) -> None:
    copy_blocks(pools[0], pools[1], src_ids, dst_ids)


def dst_bytes(pools: tuple[PagedKV, PagedKV]) -> bytes:
    return b"".join(t.view(torch.uint8).numpy().tobytes() for t in pools[1].layers)


def new_sender() -> tuple[KVSender, KVReceiver]:
    """A sender over 8 blocks to a receiver of 6; request 1 (16 tokens, 8 reused) added at
    both ends."""
    sender, receiver = in_process_pair(pool(8), pool(6))
    receiver.expect(1, 16)
    sender.add(1, 16, reused_len=8)
    return sender, receiver


def sender_state(ctx: tuple[KVSender, KVReceiver]) -> object:
    sender, receiver = ctx
    book = sender.book
    return (
        len(book),
        [(book.claimed_blocks(i), book.prefix_sent(i)) for i in (1,) if i in book],
        sender.in_flight(1),
        receiver.notices(1),
    )


TABLE = np.arange(4, dtype=np.int64)[None, :]  # request 1's blocks 0..3 on both sides


def new_tiered_sender() -> tuple[KVSender, KVReceiver]:
    """As `new_sender`, with a host tier of 12 blocks: source ids 8..19 name host blocks."""
    sender, receiver = in_process_pair(pool(8), pool(6), host_pool=pool(12))
    receiver.expect(1, 16)
    sender.add(1, 16, reused_len=8)
    return sender, receiver


def tiered_state(ctx: tuple[KVSender, KVReceiver]) -> object:
    return sender_state(ctx), len(ctx[0]._ordering)


def meta_pool(blocks: int) -> PagedKV:
    return Pools((blocks, 2, TPB, 4), 2, TPB).full(0.0, "meta")


def sender_with_host(host_pool: Any) -> KVSender:
    return in_process_pair(pool(8), pool(6), host_pool=host_pool)[0]


def cuda_sender_with_unpinned_host() -> KVSender:
    device_pool = PagedKV(tuple(t.cuda() for t in pool(8).layers), TPB)
    return KVSender(
        device_pool,
        InProcessTransport(KVReceiver(PagedKV(tuple(t.cuda() for t in pool(6).layers), TPB))),
        host_pool=pool(12),
    )


CUDA_EVENTS = hasattr(torch._C, "_CudaEventBase")  # torch built with CUDA (a device need not be there)


def new_receiver() -> KVReceiver:
    receiver = KVReceiver(pool(6))
    receiver.expect(1, 16)
    receiver.deliver(Notice(1, 0, 0, 2, False))
    return receiver


def receiver_state(receiver: KVReceiver) -> object:
    return len(receiver), receiver.is_complete(1), receiver.notices(1), receiver.fenced(1)


def new_leased_receiver() -> KVReceiver:
    receiver = KVReceiver(pool(6))
    receiver.expect(2, 8, dst_blocks=[3, 4])
    return receiver


def leased_state(receiver: KVReceiver) -> object:
    return len(receiver), receiver.is_complete(2), receiver.notices(2), receiver.fenced(2)


def new_hook() -> tuple[TransferHook, KVSender, KVReceiver]:
    """As `new_sender`, with request 1 added through the hook instead."""
    sender, receiver = in_process_pair(pool(8), pool(6))
    receiver.expect(1, 16)
    hook = TransferHook(sender)
    hook.add_request(1, 16, reused_len=8, src_blocks=[0, 1, 2, 3], dst_blocks=[3, 2, 1, 0])
    return hook, sender, receiver


def hook_state(ctx: tuple[TransferHook, KVSender, KVReceiver]) -> object:
    hook, sender, receiver = ctx
    return sorted(hook._blocks), sender_state((sender, receiver))


def early(**kw: Any) -> dict[str, Any]:
    """select_early's keyword arguments for one eligible request, with overrides."""
    args: dict[str, Any] = {"context_only": [True], "cancelled": [False], "first_chunk": [True]}
    args.update(kw)
    return args


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

ROWS: list[Row] = [
    # -- BlockRange ----------------------------------------------------------------------------
    Row(
        "range-negative",
        "BlockRange(start, end)",
        "start=-1",
        lambda _: BlockRange(-1, 2),
        InvalidArgumentError,
        "invalid start=-1",
    ),
    Row(
        "range-reversed",
        "BlockRange(start, end)",
        "end < start",
        lambda _: BlockRange(5, 3),
        InvalidArgumentError,
        "invalid end=3: must be >= start (5)",
    ),
    Row(
        "range-huge",
        "BlockRange(start, end)",
        "end=2**64",
        lambda _: BlockRange(0, HUGE),
        InvalidArgumentError,
        f"invalid end={HUGE}",
    ),
    Row(
        "range-float",
        "BlockRange(start, end)",
        "start=1.5",
        lambda _: BlockRange(1.5, 2),
        TypeError,
        "start must be an integer, got float 1.5",
    ),  # type: ignore[arg-type]
    Row(
        "range-str",
        "BlockRange(start, end)",
        "end='4'",
        lambda _: BlockRange(0, "4"),
        TypeError,
        "end must be an integer, got str '4'",
    ),  # type: ignore[arg-type]
    Row(
        "range-none",
        "BlockRange(start, end)",
        "start=None",
        lambda _: BlockRange(None, 1),
        TypeError,
        "start must be an integer, got NoneType None",
    ),  # type: ignore[arg-type]
    # -- early_prefix_blocks / chunk_blocks ----------------------------------------------------
    Row(
        "early-tpb-zero",
        "early_prefix_blocks",
        "tokens_per_block=0",
        lambda _: early_prefix_blocks(0, 8),
        InvalidArgumentError,
        "invalid tokens_per_block=0",
    ),
    Row(
        "early-tpb-negative",
        "early_prefix_blocks",
        "tokens_per_block=-4",
        lambda _: early_prefix_blocks(-4, 8),
        InvalidArgumentError,
        "invalid tokens_per_block=-4",
    ),
    Row(
        "early-reused-negative",
        "early_prefix_blocks",
        "reused_len=-1",
        lambda _: early_prefix_blocks(4, -1),
        InvalidArgumentError,
        "invalid reused_len=-1",
    ),
    Row(
        "early-tpb-huge",
        "early_prefix_blocks",
        "tokens_per_block=2**64",
        lambda _: early_prefix_blocks(HUGE, 8),
        InvalidArgumentError,
        f"invalid tokens_per_block={HUGE}",
    ),
    Row(
        "early-reused-float",
        "early_prefix_blocks",
        "reused_len=8.0",
        lambda _: early_prefix_blocks(4, 8.0),
        TypeError,
        "reused_len must be an integer, got float 8.0",
    ),  # type: ignore[arg-type]
    Row(
        "chunk-prompt-zero",
        "chunk_blocks",
        "prompt_len=0",
        lambda _: chunk_blocks(4, 0, 0, 1),
        InvalidArgumentError,
        "invalid prompt_len=0",
    ),
    Row(
        "chunk-reused-whole-prompt",
        "chunk_blocks",
        "reused_len == prompt_len",
        lambda _: chunk_blocks(4, 32, 0, 8, reused_len=32),
        InvalidArgumentError,
        "invalid reused_len=32: must be < prompt_len (32)",
    ),
    Row(
        "chunk-start-before-reuse",
        "chunk_blocks",
        "chunk_start < reused_len",
        lambda _: chunk_blocks(4, 32, 8, 16, reused_len=12),
        InvalidArgumentError,
        "invalid chunk_start=8",
    ),
    Row(
        "chunk-start-past-prompt",
        "chunk_blocks",
        "chunk_start >= prompt_len",
        lambda _: chunk_blocks(4, 32, 32, 33),
        InvalidArgumentError,
        "invalid chunk_start=32",
    ),
    Row(
        "chunk-empty",
        "chunk_blocks",
        "chunk_end == chunk_start",
        lambda _: chunk_blocks(4, 32, 8, 8),
        InvalidArgumentError,
        "invalid chunk_end=8",
    ),
    Row(
        "chunk-end-past-prompt",
        "chunk_blocks",
        "chunk_end > prompt_len",
        lambda _: chunk_blocks(4, 32, 0, 33),
        InvalidArgumentError,
        "invalid chunk_end=33",
    ),
    Row(
        "chunk-window-zero",
        "chunk_blocks",
        "window=0",
        lambda _: chunk_blocks(4, 32, 0, 8, window=0),
        InvalidArgumentError,
        "invalid window=0",
    ),
    Row(
        "chunk-window-float",
        "chunk_blocks",
        "window=2.5",
        lambda _: chunk_blocks(4, 32, 0, 8, window=2.5),
        TypeError,
        "window must be an integer, got float 2.5",
    ),  # type: ignore[arg-type]
    Row(
        "chunk-prefix-sent-int",
        "chunk_blocks",
        "prefix_sent=1",
        lambda _: chunk_blocks(4, 32, 0, 8, prefix_sent=1),
        TypeError,
        "prefix_sent must be a bool, got int 1",
    ),  # type: ignore[arg-type]
    Row(
        "chunk-prompt-huge",
        "chunk_blocks",
        "prompt_len=2**64",
        lambda _: chunk_blocks(4, HUGE, 0, 8),
        InvalidArgumentError,
        f"invalid prompt_len={HUGE}",
    ),
    # -- select_early --------------------------------------------------------------------------
    Row(
        "select-tpb-zero",
        "select_early",
        "tokens_per_block=0",
        lambda _: select_early(0, [8], **early()),
        InvalidArgumentError,
        "invalid tokens_per_block=0",
    ),
    Row(
        "select-reused-negative",
        "select_early",
        "reused_len=[-4]",
        lambda _: select_early(4, [-4], **early()),
        InvalidArgumentError,
        "invalid reused_len=-4",
    ),
    Row(
        "select-length-context-only",
        "select_early",
        "context_only shorter than reused_len",
        lambda _: select_early(4, [8, 8], **early(cancelled=[False, False], first_chunk=[True, True])),
        InvalidArgumentError,
        "invalid context_only=<array of length 1>",
    ),
    Row(
        "select-length-cancelled",
        "select_early",
        "cancelled longer than reused_len",
        lambda _: select_early(4, [8], **early(cancelled=[False, True])),
        InvalidArgumentError,
        "invalid cancelled=<array of length 2>",
    ),
    Row(
        "select-length-first-chunk",
        "select_early",
        "first_chunk empty",
        lambda _: select_early(4, [8], **early(first_chunk=np.zeros(0, dtype=bool))),
        InvalidArgumentError,
        "invalid first_chunk=<array of length 0>",
    ),
    Row(
        "select-length-pipelined",
        "select_early",
        "pipelined array of the wrong length",
        lambda _: select_early(4, [8], **early(pipelined=[True, False])),
        InvalidArgumentError,
        "invalid pipelined=<array of length 2>",
    ),
    Row(
        "select-pipelined-str",
        "select_early",
        "pipelined='yes'",
        lambda _: select_early(4, [8], **early(pipelined="yes")),
        InvalidArgumentError,
        "invalid pipelined='yes'",
    ),
    Row(
        "select-reused-float",
        "select_early",
        "reused_len float array",
        lambda _: select_early(4, np.array([8.5]), **early()),
        TypeError,
        "reused_len must be an array castable to int64, got dtype float64",
    ),
    Row(
        "select-reused-bool",
        "select_early",
        "reused_len bool array",
        lambda _: select_early(4, np.array([True]), **early()),
        TypeError,
        "reused_len must be an array castable to int64, got dtype bool",
    ),
    Row(
        "select-reused-uint64",
        "select_early",
        "reused_len uint64 array",
        lambda _: select_early(4, np.array([2**63], dtype=np.uint64), **early()),
        TypeError,
        "reused_len must be an array castable to int64, got dtype uint64",
    ),
    Row(
        "select-flags-int",
        "select_early",
        "context_only int array",
        lambda _: select_early(4, [8], **early(context_only=np.array([1]))),
        TypeError,
        "context_only must be an array castable to bool, got dtype int64",
    ),
    Row(
        "select-reused-2d",
        "select_early",
        "reused_len 2-d",
        lambda _: select_early(4, [[8]], **early()),
        InvalidArgumentError,
        "invalid reused_len=<2-d array>: must be a 1-d array",
    ),
    Row(
        "select-reused-none",
        "select_early",
        "reused_len=None",
        lambda _: select_early(4, None, **early()),
        InvalidArgumentError,
        "invalid reused_len=None: must be a 1-d array",
    ),  # type: ignore[arg-type]
    Row(
        "select-reused-ragged",
        "select_early",
        "reused_len ragged list",
        lambda _: select_early(4, [[8], [8, 9]], **early()),
        InvalidArgumentError,
        "invalid reused_len=[[8], [8, 9]]",
    ),
    # -- TransferLedger ------------------------------------------------------------------------
    Row(
        "ledger-tpb-zero",
        "TransferLedger(...)",
        "tokens_per_block=0",
        lambda _: TransferLedger(0, 32),
        InvalidArgumentError,
        "invalid tokens_per_block=0",
    ),
    Row(
        "ledger-prompt-negative",
        "TransferLedger(...)",
        "prompt_len=-5",
        lambda _: TransferLedger(4, -5),
        InvalidArgumentError,
        "invalid prompt_len=-5",
    ),
    Row(
        "ledger-reused-negative",
        "TransferLedger(...)",
        "reused_len=-1",
        lambda _: TransferLedger(4, 32, reused_len=-1),
        InvalidArgumentError,
        "invalid reused_len=-1",
    ),
    Row(
        "ledger-reused-past-prompt",
        "TransferLedger(...)",
        "reused_len > prompt_len",
        lambda _: TransferLedger(4, 32, reused_len=40),
        InvalidArgumentError,
        "invalid reused_len=40",
    ),
    Row(
        "ledger-window-negative",
        "TransferLedger(...)",
        "window=-3",
        lambda _: TransferLedger(4, 32, window=-3),
        InvalidArgumentError,
        "invalid window=-3",
    ),
    Row(
        "ledger-prompt-too-long",
        "TransferLedger(...)",
        "prompt_len over MAX_LEDGER_BLOCKS blocks",
        lambda _: TransferLedger(1, MAX_LEDGER_BLOCKS + 1),
        InvalidArgumentError,
        f"invalid prompt_len={MAX_LEDGER_BLOCKS + 1}",
    ),
    Row(
        "ledger-prompt-huge",
        "TransferLedger(...)",
        "prompt_len=2**64",
        lambda _: TransferLedger(4, HUGE),
        InvalidArgumentError,
        f"invalid prompt_len={HUGE}",
    ),
    Row(
        "ledger-tpb-float",
        "TransferLedger(...)",
        "tokens_per_block=4.0",
        lambda _: TransferLedger(4.0, 32),
        TypeError,
        "tokens_per_block must be an integer, got float 4.0",
    ),  # type: ignore[arg-type]
    Row(
        "ledger-chunk-before-reuse",
        "TransferLedger.send_chunk",
        "chunk_start < reused_len",
        lambda led: led.send_chunk(8, 16),
        InvalidArgumentError,
        "invalid chunk_start=8",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-chunk-past-prompt",
        "TransferLedger.send_chunk",
        "chunk_end > prompt_len",
        lambda led: led.send_chunk(12, 40),
        InvalidArgumentError,
        "invalid chunk_end=40",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-chunk-huge",
        "TransferLedger.send_chunk",
        "chunk_end=2**64",
        lambda led: led.send_chunk(12, HUGE),
        InvalidArgumentError,
        f"invalid chunk_end={HUGE}",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-chunk-float",
        "TransferLedger.send_chunk",
        "chunk_start=12.0",
        lambda led: led.send_chunk(12.0, 16),
        TypeError,
        "chunk_start must be an integer, got float 12.0",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-early-twice",
        "TransferLedger.send_early",
        "second call",
        lambda led: led.send_early(),
        DuplicateTransferError,
        "block 0 is already claimed",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-past-end",
        "TransferLedger.claim",
        "range past the last block",
        lambda led: led.claim(BlockRange(6, 9)),
        InvalidArgumentError,
        "invalid range=[6, 9): must be within the request's 8 blocks",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-overlap",
        "TransferLedger.claim",
        "range overlapping claimed blocks",
        lambda led: led.claim(BlockRange(2, 5)),
        DuplicateTransferError,
        "block 2 is already claimed (claim of blocks [2, 5))",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-tuple",
        "TransferLedger.claim",
        "range=(3, 5), a tuple",
        lambda led: led.claim((3, 5)),
        TypeError,
        "range must be a BlockRange, got tuple (3, 5)",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-layer-group",
        "TransferLedger.claim_layer",
        "layer_group=2 of 2",
        lambda led: led.claim_layer(BlockRange(4, 5), 2, 2),
        InvalidArgumentError,
        "invalid layer_group=2: must be in [0, 2)",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-layer-negative",
        "TransferLedger.claim_layer",
        "layer_group=-1",
        lambda led: led.claim_layer(BlockRange(4, 5), -1, 2),
        InvalidArgumentError,
        "invalid layer_group=-1",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-layer-groups",
        "TransferLedger.claim_layer",
        "layer_groups=0",
        lambda led: led.claim_layer(BlockRange(4, 5), 0, 0),
        InvalidArgumentError,
        "invalid layer_groups=0",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-layer-claimed",
        "TransferLedger.claim_layer",
        "a block claimed whole",
        lambda led: led.claim_layer(BlockRange(2, 5), 0, 2),
        DuplicateTransferError,
        "block 2 is already claimed",
        new_ledger,
        ledger_state,
    ),
    Row(
        "ledger-claim-layer-again",
        "TransferLedger.claim_layer",
        "a group's block twice",
        lambda led: (led.claim_layer(BlockRange(4, 6), 1, 2), led.claim_layer(BlockRange(5, 7), 1, 2)),
        DuplicateTransferError,
        "block 5 is already claimed",
        new_ledger,
    ),
    # -- TransferBook --------------------------------------------------------------------------
    Row(
        "book-tpb-zero",
        "TransferBook(...)",
        "tokens_per_block=0",
        lambda _: TransferBook(0),
        InvalidArgumentError,
        "invalid tokens_per_block=0",
    ),
    Row(
        "book-tpb-huge",
        "TransferBook(...)",
        "tokens_per_block=2**64",
        lambda _: TransferBook(HUGE),
        InvalidArgumentError,
        f"invalid tokens_per_block={HUGE}",
    ),
    Row(
        "book-pipelined-int",
        "TransferBook(...)",
        "pipelined=1",
        lambda _: TransferBook(4, pipelined=1),
        TypeError,
        "pipelined must be a bool, got int 1",
    ),  # type: ignore[arg-type]
    Row(
        "book-add-duplicate",
        "TransferBook.add",
        "request_id already in the book",
        lambda b: b.add(1, 32),
        InvalidArgumentError,
        "invalid request_id=1",
        new_book,
        book_state,
    ),
    Row(
        "book-add-prompt-zero",
        "TransferBook.add",
        "prompt_len=0",
        lambda b: b.add(3, 0),
        InvalidArgumentError,
        "invalid prompt_len=0",
        new_book,
        book_state,
    ),
    Row(
        "book-add-reused",
        "TransferBook.add",
        "reused_len == prompt_len",
        lambda b: b.add(3, 8, reused_len=8),
        InvalidArgumentError,
        "invalid reused_len=8",
        new_book,
        book_state,
    ),
    Row(
        "book-add-window",
        "TransferBook.add",
        "window=-1",
        lambda b: b.add(3, 8, window=-1),
        InvalidArgumentError,
        "invalid window=-1",
        new_book,
        book_state,
    ),
    Row(
        "book-add-too-long",
        "TransferBook.add",
        "prompt_len over MAX_LEDGER_BLOCKS blocks",
        lambda b: b.add(3, TPB * MAX_LEDGER_BLOCKS + 1),
        InvalidArgumentError,
        f"invalid prompt_len={TPB * MAX_LEDGER_BLOCKS + 1}",
        new_book,
        book_state,
    ),
    Row(
        "book-add-id-huge",
        "TransferBook.add",
        "request_id=2**64",
        lambda b: b.add(HUGE, 8),
        InvalidArgumentError,
        f"invalid request_id={HUGE}",
        new_book,
        book_state,
    ),
    Row(
        "book-add-context-only-str",
        "TransferBook.add",
        "context_only='yes'",
        lambda b: b.add(3, 8, context_only="yes"),
        TypeError,
        "context_only must be a bool, got str 'yes'",
        new_book,
        book_state,
    ),
    Row(
        "book-add-spec-held-outside",
        "TransferBook.add_spec",
        "a held range past the prompt: nothing added",
        lambda b: b.add_spec(3, RequestSpec(8, held=[BlockRange(0, 1), BlockRange(7, 9)])),
        InvalidArgumentError,
        "invalid range=[7, 9)",
        new_book,
        book_state,
    ),
    # -- RequestSpec ---------------------------------------------------------------------------
    Row(
        "spec-prompt-huge",
        "RequestSpec(...)",
        "prompt_len=2**64",
        lambda _: RequestSpec(HUGE),
        InvalidArgumentError,
        f"invalid prompt_len={HUGE}",
    ),
    Row(
        "spec-epoch-negative",
        "RequestSpec(...)",
        "epoch=-1",
        lambda _: RequestSpec(8, epoch=-1),
        InvalidArgumentError,
        "invalid epoch=-1: must be in [0, 2**63) (0: none issued)",
    ),
    Row(
        "spec-epoch-bool",
        "RequestSpec(...)",
        "epoch=True",
        lambda _: RequestSpec(8, epoch=True),
        TypeError,
        "epoch must be an integer, got bool True",
    ),
    Row(
        "spec-held-not-ranges",
        "RequestSpec(...)",
        "held=[1]",
        lambda _: RequestSpec(8, held=[1]),
        TypeError,
        "held must be a sequence of BlockRange, got list [1]",
    ),  # type: ignore[list-item]
    Row(
        "book-hold-not-ranges",
        "TransferBook.hold",
        "ranges=[1, 2]",
        lambda b: b.hold(2, [1, 2]),
        TypeError,
        "ranges must be a sequence of BlockRange, got list [1, 2]",
        new_book,
        book_state,
    ),
    Row(
        "book-hold-outside",
        "TransferBook.hold",
        "a range past the prompt (after a valid one)",
        lambda b: b.hold(2, [BlockRange(0, 1), BlockRange(7, 9)]),
        InvalidArgumentError,
        "invalid range=[7, 9)",
        new_book,
        book_state,
    ),
    Row(
        "book-hold-claimed",
        "TransferBook.hold",
        "a block already planned",
        lambda b: (b.plan_early([1]), b.hold(1, [BlockRange(0, 1)])),
        DuplicateTransferError,
        "block 0",
        new_book,
    ),
    Row(
        "book-hold-unknown",
        "TransferBook.hold",
        "unknown request_id",
        lambda b: b.hold(99, []),
        UnknownRequestError,
        "unknown request_id=99",
        new_book,
        book_state,
    ),
    Row(
        "book-remove-unknown",
        "TransferBook.remove",
        "unknown request_id",
        lambda b: b.remove(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_book,
        book_state,
    ),
    Row(
        "book-cancel-unknown",
        "TransferBook.cancel",
        "unknown request_id",
        lambda b: b.cancel(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_book,
        book_state,
    ),
    Row(
        "book-query-unknown",
        "TransferBook.claimed_blocks",
        "unknown request_id",
        lambda b: b.claimed_blocks(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_book,
        book_state,
    ),
    Row(
        "book-query-huge",
        "TransferBook.missing",
        "request_id=2**64",
        lambda b: b.missing(HUGE),
        InvalidArgumentError,
        f"invalid request_id={HUGE}",
        new_book,
        book_state,
    ),
    Row(
        "book-early-unknown",
        "TransferBook.plan_early",
        "an unknown id in the batch",
        lambda b: b.plan_early([1, 99]),
        UnknownRequestError,
        "unknown request_id=99",
        new_book,
        book_state,
    ),
    Row(
        "book-early-repeated",
        "TransferBook.plan_early",
        "an id twice in the batch",
        lambda b: b.plan_early([1, 2, 1]),
        InvalidArgumentError,
        "invalid request_ids=1: must be listed once per batch",
        new_book,
        book_state,
    ),
    Row(
        "book-early-float",
        "TransferBook.plan_early",
        "float request_ids",
        lambda b: b.plan_early(np.array([1.0])),
        TypeError,
        "request_ids must be an array castable to int64, got dtype float64",
        new_book,
        book_state,
    ),
    Row(
        "book-early-bool",
        "TransferBook.plan_early",
        "bool request_ids (a mask)",
        lambda b: b.plan_early(np.array([True, False])),
        TypeError,
        "request_ids must be an array castable to int64, got dtype bool",
        new_book,
        book_state,
    ),
    Row(
        "book-early-list-bool",
        "TransferBook.plan_early",
        "a list with a bool among the request_ids",
        lambda b: b.plan_early([1, True]),
        TypeError,
        "request_ids must be a list of ints, got bool True at index 1",
        new_book,
        book_state,
    ),
    Row(
        "book-early-list-float",
        "TransferBook.plan_early",
        "a list with a float among the request_ids",
        lambda b: b.plan_early([1, 2.5]),
        TypeError,
        "request_ids must be an array castable to int64, got dtype float64",
        new_book,
        book_state,
    ),
    Row(
        "book-early-list-past-int64",
        "TransferBook.plan_early",
        "a list with an int past int64",
        lambda b: b.plan_early([2**63]),
        TypeError,
        "request_ids must be an array castable to int64, got dtype uint64",
        new_book,
        book_state,
    ),
    Row(
        "book-early-2d",
        "TransferBook.plan_early",
        "2-d request_ids",
        lambda b: b.plan_early([[1]]),
        InvalidArgumentError,
        "invalid request_ids=<2-d array>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-ragged",
        "TransferBook.plan_early",
        "ragged request_ids",
        lambda b: b.plan_early([[1], [1, 2]]),
        InvalidArgumentError,
        "invalid request_ids=[[1], [1, 2]]",
        new_book,
        book_state,
    ),
    Row(
        "book-early-one-table",
        "TransferBook.plan_early",
        "src_block_table without dst_block_table",
        lambda b: b.plan_early([1], src_block_table=TABLE),
        InvalidArgumentError,
        "invalid dst_block_table=None",
        new_book,
        book_state,
    ),
    Row(
        "book-early-table-1d",
        "TransferBook.plan_early",
        "1-d block table",
        lambda b: b.plan_early([1], src_block_table=TABLE[0], dst_block_table=TABLE),
        InvalidArgumentError,
        "invalid src_block_table=<1-d array>: must be a 2-d array",
        new_book,
        book_state,
    ),
    Row(
        "book-early-table-rows",
        "TransferBook.plan_early",
        "table with a row per request missing",
        lambda b: b.plan_early([1, 2], src_block_table=TABLE, dst_block_table=TABLE),
        InvalidArgumentError,
        "invalid src_block_table=<table with 1 rows>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-table-narrow",
        "TransferBook.plan_early",
        "table narrower than the slice",
        lambda b: b.plan_early([1], src_block_table=TABLE[:, :2], dst_block_table=TABLE),
        InvalidArgumentError,
        "invalid src_block_table=<table with 2 columns>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-table-negative",
        "TransferBook.plan_early",
        "-1 in a planned table entry",
        lambda b: b.plan_early([1], src_block_table=TABLE, dst_block_table=np.array([[0, -1, 2, 3]])),
        InvalidArgumentError,
        "invalid dst_block_table=<id -1 at block 1 of request 1>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-table-float",
        "TransferBook.plan_early",
        "float block table",
        lambda b: b.plan_early([1], src_block_table=TABLE + 0.5, dst_block_table=TABLE),
        TypeError,
        "src_block_table must be an array castable to int64, got dtype float64",
        new_book,
        book_state,
    ),
    Row(
        "book-early-dst-pool",
        "TransferBook.plan_early",
        "table id >= dst_blocks",
        lambda b: b.plan_early([1], src_block_table=TABLE, dst_block_table=np.array([[0, 9, 2, 3]]), dst_blocks=6),
        InvalidArgumentError,
        "invalid dst_block_table=<id 9 at block 1 of request 1>: must be in [0, dst_blocks=6)",
        new_book,
        book_state,
    ),
    Row(
        "book-early-src-pool",
        "TransferBook.plan_early",
        "table id >= src_blocks",
        lambda b: b.plan_early([1], src_block_table=TABLE + 6, dst_block_table=TABLE, src_blocks=8),
        InvalidArgumentError,
        "invalid src_block_table=<id 8 at block 2 of request 1>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-dst-twice",
        "TransferBook.plan_early",
        "one destination planned twice",
        lambda b: b.plan_early([1], src_block_table=TABLE, dst_block_table=np.array([[5, 5, 2, 3]]), dst_blocks=6),
        InvalidArgumentError,
        "invalid dst_block_table=<id 5 at block 0 of request 1 and block 1 of request 1>",
        new_book,
        book_state,
    ),
    Row(
        "book-early-blocks-negative",
        "TransferBook.plan_early",
        "dst_blocks=-1",
        lambda b: b.plan_early([1], src_block_table=TABLE, dst_block_table=TABLE, dst_blocks=-1),
        InvalidArgumentError,
        "invalid dst_blocks=-1",
        new_book,
        book_state,
    ),
    Row(
        "book-early-blocks-no-table",
        "TransferBook.plan_early",
        "src_blocks without tables",
        lambda b: b.plan_early([1], src_blocks=8),
        InvalidArgumentError,
        "invalid src_blocks=8: must be given with src_block_table and dst_block_table",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-starts-length",
        "TransferBook.plan_chunks",
        "chunk_starts longer than request_ids",
        lambda b: b.plan_chunks([1], [12, 0], [16]),
        InvalidArgumentError,
        "invalid chunk_starts=<array of length 2>",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-ends-length",
        "TransferBook.plan_chunks",
        "chunk_ends shorter than request_ids",
        lambda b: b.plan_chunks([1, 2], [12, 0], [16]),
        InvalidArgumentError,
        "invalid chunk_ends=<array of length 1>",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-bad-chunk",
        "TransferBook.plan_chunks",
        "one chunk past its prompt",
        lambda b: b.plan_chunks([1, 2], [12, 0], [16, 40]),
        InvalidArgumentError,
        "invalid chunk_end=40: must be in (chunk_start (0), prompt_len (32)] (request_id=2)",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-negative",
        "TransferBook.plan_chunks",
        "chunk_start=-1",
        lambda b: b.plan_chunks([2], [-1], [8]),
        InvalidArgumentError,
        "invalid chunk_start=-1",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-float",
        "TransferBook.plan_chunks",
        "float chunk_ends",
        lambda b: b.plan_chunks([1], [12], [16.5]),
        TypeError,
        "chunk_ends must be an array castable to int64, got dtype float64",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-unknown",
        "TransferBook.plan_chunks",
        "an unknown id in the batch",
        lambda b: b.plan_chunks([1, 7], [12, 0], [16, 8]),
        UnknownRequestError,
        "unknown request_id=7",
        new_book,
        book_state,
    ),
    Row(
        "book-chunks-resend",
        "TransferBook.plan_chunks",
        "a chunk planned twice",
        lambda b: b.plan_chunks([2], [0], [8]),
        DuplicateTransferError,
        "block 0 of request 2 is already claimed",
        book_with_chunk,
        book_state,
    ),
    # -- block_pairs / block_runs --------------------------------------------------------------
    Row(
        "pairs-plan-none",
        "block_pairs",
        "plan=None",
        lambda _: block_pairs(None, TABLE, TABLE),
        TypeError,
        "plan must be a SlicePlan, got NoneType None",
    ),  # type: ignore[arg-type]
    Row(
        "pairs-rows",
        "block_pairs",
        "table with two rows for a one-request plan",
        lambda plan: block_pairs(plan, np.zeros((2, 8), np.int64), np.zeros((1, 8), np.int64)),
        InvalidArgumentError,
        "invalid src_block_table=<table with 2 rows>",
        new_plan,
    ),
    Row(
        "pairs-narrow",
        "block_pairs",
        "table narrower than the plan",
        lambda plan: block_pairs(plan, np.zeros((1, 8), np.int64), np.zeros((1, 4), np.int64)),
        InvalidArgumentError,
        "invalid dst_block_table=<table with 4 columns>: must be wide enough for block 7 of request 1",
        new_plan,
    ),
    Row(
        "pairs-3d",
        "block_pairs",
        "3-d table",
        lambda plan: block_pairs(plan, np.zeros((1, 8, 1), np.int64), np.zeros((1, 8), np.int64)),
        InvalidArgumentError,
        "invalid src_block_table=<3-d array>",
        new_plan,
    ),
    Row(
        "runs-negative",
        "block_runs",
        "-1 in the table",
        lambda plan: block_runs(plan, np.zeros((1, 8), np.int64), -np.ones((1, 8), np.int64)),
        InvalidArgumentError,
        "invalid dst_block_table=<id -1 at block 0 of request 1>",
        new_plan,
    ),
    Row(
        "runs-float",
        "block_runs",
        "float table",
        lambda plan: block_runs(plan, np.zeros((1, 8)), np.zeros((1, 8), np.int64)),
        TypeError,
        "src_block_table must be an array castable to int64, got dtype float64",
        new_plan,
    ),
    Row(
        "runs-plan-list",
        "block_runs",
        "plan=[...], not a SlicePlan",
        lambda _: block_runs([0, 8], TABLE, TABLE),
        TypeError,
        "plan must be a SlicePlan, got list [0, 8]",
    ),  # type: ignore[arg-type]
    Row(
        "slice-plan-new",
        "SlicePlan()",
        "direct construction",
        lambda _: kvferry.SlicePlan(),
        TypeError,
        "cannot create 'kvferry.SlicePlan' instances",
    ),
    # -- pack_pairs ----------------------------------------------------------------------------
    Row(
        "pack-length",
        "_core.pack_pairs",
        "fewer dst_ids than src_ids",
        lambda _: pack_pairs([0, 1], [0], 4, 4),
        InvalidArgumentError,
        "invalid dst_ids=<1 ids>: must be as many as src_ids (2)",
    ),
    Row(
        "pack-src-range",
        "_core.pack_pairs",
        "src id == src_blocks",
        lambda _: pack_pairs([4], [0], 4, 4),
        InvalidArgumentError,
        "invalid src_ids=<block id 4>: must be in [0, 4)",
    ),
    Row(
        "pack-dst-negative",
        "_core.pack_pairs",
        "dst id -1",
        lambda _: pack_pairs([0], [-1], 4, 4),
        InvalidArgumentError,
        "invalid dst_ids=<block id -1>",
    ),
    Row(
        "pack-dst-twice",
        "_core.pack_pairs",
        "a destination twice",
        lambda _: pack_pairs([0, 1], [2, 2], 4, 4),
        InvalidArgumentError,
        "invalid dst_ids=<block 2 twice>",
    ),
    Row(
        "pack-blocks-negative",
        "_core.pack_pairs",
        "src_blocks=-1",
        lambda _: pack_pairs([], [], -1, 4),
        InvalidArgumentError,
        "invalid src_blocks=-1: must be >= 0",
    ),
    Row(
        "pack-blocks-huge",
        "_core.pack_pairs",
        "dst_blocks=2**64",
        lambda _: pack_pairs([0], [0], 4, HUGE),
        InvalidArgumentError,
        f"invalid dst_blocks={HUGE}",
    ),
    Row(
        "pack-ids-none",
        "_core.pack_pairs",
        "src_ids=None",
        lambda _: pack_pairs(None, [0], 4, 4),
        InvalidArgumentError,
        "invalid src_ids=None: must be a 1-d array",
    ),  # type: ignore[arg-type]
    # -- PagedKV -------------------------------------------------------------------------------
    Row(
        "pool-no-layers",
        "PagedKV(...)",
        "layers=()",
        lambda _: PagedKV((), 4),
        InvalidArgumentError,
        "invalid layers=()",
    ),
    Row(
        "pool-one-tensor",
        "PagedKV(...)",
        "layers=<one tensor>",
        lambda _: PagedKV(torch.zeros(4, 2), 4),
        InvalidArgumentError,
        "invalid layers=Tensor",
    ),  # type: ignore[arg-type]
    Row(
        "pool-numpy-layer",
        "PagedKV(...)",
        "a numpy array as a layer",
        lambda _: PagedKV((np.zeros((4, 2)),), 4),
        TypeError,
        "layers[0] must be a torch.Tensor, got ndarray",
    ),  # type: ignore[arg-type]
    Row(
        "pool-tpb-zero",
        "PagedKV(...)",
        "tokens_per_block=0",
        lambda _: PagedKV((torch.zeros(4, 2),), 0),
        InvalidArgumentError,
        "invalid tokens_per_block=0",
    ),
    Row(
        "pool-tpb-float",
        "PagedKV(...)",
        "tokens_per_block=2.5",
        lambda _: PagedKV((torch.zeros(4, 2),), 2.5),
        TypeError,
        "tokens_per_block must be an int, got float 2.5",
    ),  # type: ignore[arg-type]
    Row(
        "pool-tpb-bool",
        "PagedKV(...)",
        "tokens_per_block=True",
        lambda _: PagedKV((torch.zeros(4, 2),), True),
        TypeError,
        "tokens_per_block must be an int, got bool True",
    ),
    Row(
        "pool-tpb-huge",
        "PagedKV(...)",
        "tokens_per_block=2**64",
        lambda _: PagedKV((torch.zeros(4, 2),), HUGE),
        InvalidArgumentError,
        f"invalid tokens_per_block={HUGE}",
    ),
    Row(
        "pool-block-dim-range",
        "PagedKV(...)",
        "block_dim=2 on 2-d layers",
        lambda _: PagedKV((torch.zeros(4, 2),), 4, block_dim=2),
        InvalidArgumentError,
        "invalid block_dim=2: must be in [0, 2)",
    ),
    Row(
        "pool-block-dim-float",
        "PagedKV(...)",
        "block_dim=0.0",
        lambda _: PagedKV((torch.zeros(4, 2),), 4, block_dim=0.0),
        TypeError,
        "block_dim must be an int, got float 0.0",
    ),  # type: ignore[arg-type]
    Row(
        "pool-shape-mismatch",
        "PagedKV(...)",
        "layers of different shapes",
        lambda _: PagedKV((torch.zeros(4, 2), torch.zeros(5, 2)), 4),
        InvalidArgumentError,
        "invalid layers[1].shape=(5, 2)",
    ),
    Row(
        "pool-dtype-mismatch",
        "PagedKV(...)",
        "layers of different dtypes",
        lambda _: PagedKV((torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.float16)), 4),
        InvalidArgumentError,
        "invalid layers[1].dtype=torch.float16",
    ),
    Row(
        "pool-device-mismatch",
        "PagedKV(...)",
        "layers on different devices",
        lambda _: PagedKV((torch.zeros(4, 2), torch.zeros(4, 2, device="meta")), 4),
        InvalidArgumentError,
        "invalid layers[1].device=meta",
    ),
    Row(
        "pool-non-contiguous",
        "PagedKV(...)",
        "a non-contiguous layer",
        lambda _: PagedKV((torch.zeros(2, 4).t(),), 4),
        InvalidArgumentError,
        "invalid layers[0]: must be contiguous",
    ),
    Row(
        "pool-stacked-dim",
        "PagedKV.stacked",
        "block_dim=0 (the layer dimension)",
        lambda _: PagedKV.stacked(torch.zeros(2, 4, 3), tokens_per_block=4, block_dim=0),
        InvalidArgumentError,
        "invalid block_dim=0: must be >= 1",
    ),
    Row(
        "pool-stacked-numpy",
        "PagedKV.stacked",
        "a numpy array",
        lambda _: PagedKV.stacked(np.zeros((2, 4, 3)), tokens_per_block=4, block_dim=1),
        TypeError,
        "tensor must be a torch.Tensor, got ndarray",
    ),  # type: ignore[arg-type]
    Row(
        "pool-group-layers",
        "PagedKV.group_layers",
        "groups=3 of 2 layers",
        lambda _: pool(8).group_layers(0, 3),
        InvalidArgumentError,
        "invalid groups=3: must be in [1, 2]",
    ),
    Row(
        "pool-group-index",
        "PagedKV.group_layers",
        "group=2 of 2",
        lambda _: pool(8).group_layers(2, 2),
        InvalidArgumentError,
        "invalid group=2: must be in [0, 2)",
    ),
    Row(
        "pool-layer-slice",
        "PagedKV.layer_slice",
        "layers [1, 1)",
        lambda _: pool(8).layer_slice(1, 1),
        InvalidArgumentError,
        "invalid layers=[1, 1)",
    ),
    Row(
        "compat-layers",
        "PagedKV.check_compatible",
        "different layer counts",
        lambda _: pool(layers=2).check_compatible(pool(layers=3)),
        LayoutMismatchError,
        "layout mismatch: num_layers is 2 on the source and 3 on the destination",
    ),
    Row(
        "compat-tpb",
        "PagedKV.check_compatible",
        "different tokens-per-block",
        lambda _: pool().check_compatible(pool(tpb=8, inner=2)),
        LayoutMismatchError,
        "layout mismatch: tokens_per_block is 4 on the source and 8",
    ),
    Row(
        "compat-dtype",
        "PagedKV.check_compatible",
        "float32 vs float16",
        lambda _: pool().check_compatible(pool(dtype=torch.float16)),
        LayoutMismatchError,
        "layout mismatch: dtype is torch.float32 on the source and torch.float16",
    ),
    Row(
        "compat-dtype-same-size",
        "PagedKV.check_compatible",
        "float32 vs int32 (same bytes)",
        lambda _: pool().check_compatible(pool(dtype=torch.int32)),
        LayoutMismatchError,
        "layout mismatch: dtype is torch.float32 on the source and torch.int32",
    ),
    Row(
        "compat-segment-bytes",
        "PagedKV.check_compatible",
        "different block geometry",
        lambda _: pool().check_compatible(pool(inner=8)),
        LayoutMismatchError,
        "layout mismatch: segment_bytes is 128 on the source and 256",
    ),
    Row(
        "compat-segments",
        "PagedKV.check_compatible",
        "block dimension in another place",
        lambda _: pool().check_compatible(pool(block_dim=1)),
        LayoutMismatchError,
        "layout mismatch: segments is 1 on the source and 2",
    ),
    Row(
        "compat-geometry-dict",
        "PagedKV.check_compatible",
        "a remote geometry() without fields",
        lambda _: pool().check_compatible({}),
        LayoutMismatchError,
        "layout mismatch: num_layers is 2 on the source and None",
    ),
    Row(
        "compat-none",
        "PagedKV.check_compatible",
        "other=None",
        lambda _: pool().check_compatible(None),
        TypeError,
        "other must be a PagedKV or a geometry() dict, got NoneType",
    ),  # type: ignore[arg-type]
    # -- copy_blocks (the destination pool's bytes must not change) ----------------------------
    Row(
        "copy-dst-range",
        "copy_blocks",
        "dst id == dst pool size",
        lambda p: copy(p, [0], [6]),
        InvalidArgumentError,
        "invalid dst_ids=<block id 6>: must be in [0, 6)",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-src-range",
        "copy_blocks",
        "src id == src pool size",
        lambda p: copy(p, [8], [0]),
        InvalidArgumentError,
        "invalid src_ids=<block id 8>: must be in [0, 8)",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-src-negative",
        "copy_blocks",
        "src id -1",
        lambda p: copy(p, [1, -1], [0, 1]),
        InvalidArgumentError,
        "invalid src_ids=<block id -1>",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-dst-twice",
        "copy_blocks",
        "a destination twice",
        lambda p: copy(p, [0, 1], [3, 3]),
        InvalidArgumentError,
        "invalid dst_ids=<block 3 twice>",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-length",
        "copy_blocks",
        "more src_ids than dst_ids",
        lambda p: copy(p, [0, 1, 2], [0, 1]),
        InvalidArgumentError,
        "invalid dst_ids=<2 ids>: must be as many as src_ids (3)",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-float",
        "copy_blocks",
        "float64 numpy ids",
        lambda p: copy(p, np.array([0.0]), [1]),
        TypeError,
        "src_ids must be an array castable to int64, got dtype float64",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-float-tensor",
        "copy_blocks",
        "float32 torch ids",
        lambda p: copy(p, [0], torch.tensor([1.0])),
        TypeError,
        "dst_ids must be an array castable to int64, got dtype float32",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-bool",
        "copy_blocks",
        "a bool mask as ids",
        lambda p: copy(p, torch.tensor([True, False]), [0, 1]),
        TypeError,
        "src_ids must be an array castable to int64, got dtype bool",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-uint64",
        "copy_blocks",
        "uint64 ids",
        lambda p: copy(p, np.array([1], dtype=np.uint64), [0]),
        TypeError,
        "src_ids must be an array castable to int64, got dtype uint64",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-2d",
        "copy_blocks",
        "2-d ids",
        lambda p: copy(p, np.array([[0]]), np.array([[1]])),
        InvalidArgumentError,
        "invalid src_ids=<2-d array>: must be a 1-d array",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-scalar",
        "copy_blocks",
        "a scalar id",
        lambda p: copy(p, 0, 1),
        InvalidArgumentError,
        "invalid src_ids=0: must be a 1-d array",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-ragged",
        "copy_blocks",
        "ragged ids",
        lambda p: copy(p, [[0], [1, 2]], [0]),
        InvalidArgumentError,
        "invalid src_ids=[[0], [1, 2]]",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-huge-id",
        "copy_blocks",
        "id 2**64",
        lambda p: copy(p, [HUGE], [0]),
        TypeError,
        "src_ids must be an array castable to int64, got dtype object",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-dtype",
        "copy_blocks",
        "pools of different dtypes",
        lambda p: copy_blocks(p[0], pool(6, dtype=torch.float16), [0], [0]),
        LayoutMismatchError,
        "layout mismatch: dtype",
        new_pools,
        dst_bytes,
    ),
    Row(
        "copy-tpb",
        "copy_blocks",
        "pools of different tokens-per-block",
        lambda p: copy_blocks(pool(8, tpb=8, inner=2), p[1], [0], [0]),
        LayoutMismatchError,
        "layout mismatch: tokens_per_block is 8 on the source and 4",
        new_pools,
        dst_bytes,
    ),
    # -- KVSender ------------------------------------------------------------------------------
    Row(
        "sender-layout",
        "KVSender(...)",
        "receiver pool with other tokens-per-block",
        lambda _: KVSender(pool(8, tpb=8, inner=2), InProcessTransport(KVReceiver(pool(6)))),
        LayoutMismatchError,
        "layout mismatch: tokens_per_block is 8 on the source and 4",
    ),
    Row(
        "sender-timeout",
        "KVSender(...)",
        "timeout=-1",
        lambda _: KVSender(pool(8), InProcessTransport(KVReceiver(pool(6))), timeout=-1),
        InvalidArgumentError,
        "invalid timeout=-1",
    ),
    Row(
        "sender-layer-groups",
        "KVSender(...)",
        "layer_groups=3 for a pool of 2 layers",
        lambda _: KVSender(pool(8), InProcessTransport(KVReceiver(pool(6))), layer_groups=3),
        InvalidArgumentError,
        "invalid layer_groups=3: must be in [1, 2]",
    ),
    Row(
        "sender-layer-groups-float",
        "KVSender(...)",
        "layer_groups=2.0",
        lambda _: KVSender(pool(8), InProcessTransport(KVReceiver(pool(6))), layer_groups=2.0),
        TypeError,
        "layer_groups must be an int, got float 2.0",
    ),  # type: ignore[arg-type]
    Row(
        "sender-add-duplicate",
        "KVSender.add",
        "request_id already added",
        lambda c: c[0].add(1, 16),
        InvalidArgumentError,
        "invalid request_id=1",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-add-huge",
        "KVSender.add",
        "prompt_len=2**64",
        lambda c: c[0].add(2, HUGE),
        InvalidArgumentError,
        f"invalid prompt_len={HUGE}",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-add-epoch",
        "KVSender.add",
        "epoch=-1",
        lambda c: c[0].add(2, 16, epoch=-1),
        InvalidArgumentError,
        "invalid epoch=-1",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-add-spec-and-fields",
        "KVSender.add",
        "a RequestSpec and a field again",
        lambda c: c[0].add(2, RequestSpec(16), epoch=1),
        TypeError,
        "spec is a RequestSpec already: epoch cannot be given again",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-add-epoch-float",
        "KVSender.add",
        "epoch=1.5",
        lambda c: c[0].add(2, 16, epoch=1.5),
        TypeError,
        "epoch must be an integer, got float 1.5",
        new_sender,
        sender_state,
    ),  # type: ignore[arg-type]
    Row(
        "sender-early-unknown",
        "KVSender.send_early",
        "unknown request id",
        lambda c: c[0].send_early([9], TABLE, TABLE),
        UnknownRequestError,
        "unknown request_id=9",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-early-float",
        "KVSender.send_early",
        "float request_ids",
        lambda c: c[0].send_early(np.array([1.0]), TABLE, TABLE),
        TypeError,
        "request_ids must be an array castable to int64",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-early-narrow",
        "KVSender.send_early",
        "table narrower than the prefix",
        lambda c: c[0].send_early([1], TABLE[:, :1], TABLE),
        InvalidArgumentError,
        "invalid src_block_table=<table with 1 columns>",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-early-dst-pool",
        "KVSender.send_early",
        "dst table id outside the receiver pool",
        lambda c: c[0].send_early([1], TABLE, np.array([[0, 7, 2, 3]])),
        InvalidArgumentError,
        "dst_block_table=<id 7 at block 1 of request 1>",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-early-src-pool",
        "KVSender.send_early",
        "src table id outside the sender pool",
        lambda c: c[0].send_early([1], np.array([[0, 8, 2, 3]]), TABLE),
        InvalidArgumentError,
        "src_block_table=<id 8 at block 1 of request 1>",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-early-dst-twice",
        "KVSender.send_early",
        "one destination twice in the table",
        lambda c: c[0].send_early([1], TABLE, np.array([[2, 2, 2, 3]])),
        InvalidArgumentError,
        "dst_block_table=<id 2 at block 0 of request 1 and block 1 of request 1>",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-chunks-length",
        "KVSender.send_chunks",
        "chunk_starts longer than request_ids",
        lambda c: c[0].send_chunks([1], [8, 9], [16], TABLE, TABLE),
        InvalidArgumentError,
        "invalid chunk_starts=<array of length 2>",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-chunks-range",
        "KVSender.send_chunks",
        "chunk_start < reused_len",
        lambda c: c[0].send_chunks([1], [4], [16], TABLE, TABLE),
        InvalidArgumentError,
        "invalid chunk_start=4",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-layers-group",
        "KVSender.send_layers",
        "group=1 of layer_groups=1",
        lambda c: c[0].send_layers([1], [8], [16], 1, TABLE, TABLE),
        InvalidArgumentError,
        "invalid layer_group=1: must be in [0, 1)",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-layers-early",
        "KVSender.send_layers",
        "chunk_start < reused_len",
        lambda c: c[0].send_layers([1], [4], [16], 0, TABLE, TABLE),
        InvalidArgumentError,
        "invalid chunk_start=4",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-cancel-unknown",
        "KVSender.cancel",
        "unknown request id",
        lambda c: c[0].cancel(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-remove-unknown",
        "KVSender.remove",
        "unknown request id",
        lambda c: c[0].remove(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-cancelled-send",
        "KVSender.send_early",
        "a cancelled request id",
        lambda c: (c[0].cancel(1), c[0].send_early([1], TABLE, TABLE)),
        UnknownRequestError,
        "unknown request_id=1",
        new_sender,
    ),
    Row(
        "sender-cancel-twice",
        "KVSender.cancel",
        "a cancelled request id",
        lambda c: (c[0].cancel(1), c[0].cancel(1)),
        UnknownRequestError,
        "unknown request_id=1",
        new_sender,
    ),
    # -- KVSender: the host tier ---------------------------------------------------------------
    Row(
        "sender-host-pool-type",
        "KVSender(...)",
        "host_pool=<a tensor>",
        lambda _: sender_with_host(torch.zeros(4)),
        TypeError,
        "host_pool must be a PagedKV, got Tensor",
    ),
    Row(
        "sender-host-pool-layout",
        "KVSender(...)",
        "host_pool of another block geometry",
        lambda _: sender_with_host(pool(12, inner=8)),
        LayoutMismatchError,
        "invalid host_pool: its segment_bytes is 256, the device pool's is 128",
    ),
    Row(
        "sender-host-pool-tpb",
        "KVSender(...)",
        "host_pool of other tokens-per-block",
        lambda _: sender_with_host(pool(12, tpb=8, inner=2)),
        LayoutMismatchError,
        "invalid host_pool: its tokens_per_block is 8, the device pool's is 4",
    ),
    Row(
        "sender-host-pool-device",
        "KVSender(...)",
        "host_pool not in host memory",
        lambda _: sender_with_host(meta_pool(12)),
        InvalidArgumentError,
        "invalid host_pool=<pool on meta>: must be a CPU pool",
    ),
    Row(
        "sender-host-pool-unpinned",
        "KVSender(...)",
        "CUDA pool with an unpinned host_pool",
        lambda _: cuda_sender_with_unpinned_host(),
        InvalidArgumentError,
        "invalid host_pool: layers [0, 1] are not pinned",
        skip=None if CUDA else "needs a CUDA device",
    ),
    Row(
        "sender-early-host-range",
        "KVSender.send_early",
        "src id past the host tier",
        lambda c: c[0].send_early([1], np.array([[0, 20, 2, 3]]), TABLE),
        InvalidArgumentError,
        "src_block_table=<id 20 at block 1 of request 1>: must be in [0, src_blocks=20)",
        new_tiered_sender,
        tiered_state,
    ),
    Row(
        "sender-order-after-signal",
        "KVSender.order_after",
        "signal='done', a string",
        lambda c: c[0].order_after([8], "done"),
        TypeError,
        "signal must be a torch.cuda.Event, a threading.Event or a concurrent.futures.Future, got str 'done'",
        new_tiered_sender,
        tiered_state,
    ),  # type: ignore[arg-type]
    Row(
        "sender-order-after-unrecorded",
        "KVSender.order_after",
        "a torch.cuda.Event never recorded",
        lambda c: c[0].order_after([8], torch.cuda.Event()),
        InvalidArgumentError,
        "invalid signal=<torch.cuda.Event never recorded>",
        new_tiered_sender,
        tiered_state,
        skip=None if CUDA_EVENTS else "torch built without CUDA",
    ),
    Row(
        "sender-order-after-range",
        "KVSender.order_after",
        "src id past the host tier",
        lambda c: c[0].order_after([3, 20], threading.Event()),
        InvalidArgumentError,
        "invalid src_ids=<block id 20>: must be in [0, 20) (device blocks [0, 8), host blocks [8, 20))",
        new_tiered_sender,
        tiered_state,
    ),
    Row(
        "sender-order-after-no-host",
        "KVSender.order_after",
        "a host id, no host_pool",
        lambda c: c[0].order_after([8], threading.Event()),
        InvalidArgumentError,
        "invalid src_ids=<block id 8>: must be in [0, 8) (device blocks [0, 8), no host pool)",
        new_sender,
        sender_state,
    ),
    Row(
        "sender-order-after-negative",
        "KVSender.order_after",
        "src id -1",
        lambda c: c[0].order_after([-1], threading.Event()),
        InvalidArgumentError,
        "invalid src_ids=<block id -1>",
        new_tiered_sender,
        tiered_state,
    ),
    Row(
        "sender-order-after-float",
        "KVSender.order_after",
        "float src_ids",
        lambda c: c[0].order_after([1.5], threading.Event()),
        TypeError,
        "src_ids must hold integer block ids, got dtype float64",
        new_tiered_sender,
        tiered_state,
    ),
    Row(
        "sender-order-after-2d",
        "KVSender.order_after",
        "2-d src_ids",
        lambda c: c[0].order_after([[1, 2]], threading.Event()),
        InvalidArgumentError,
        "invalid src_ids=<2-d array>",
        new_tiered_sender,
        tiered_state,
    ),
    # -- KVReceiver ----------------------------------------------------------------------------
    Row(
        "receiver-pool-none",
        "KVReceiver(...)",
        "pool=None",
        lambda _: KVReceiver(None),
        TypeError,
        "pool must be a PagedKV, got NoneType",
    ),  # type: ignore[arg-type]
    Row(
        "receiver-expect-prompt",
        "KVReceiver.expect",
        "prompt_len=0",
        lambda r: r.expect(2, 0),
        InvalidArgumentError,
        "invalid prompt_len=0",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-awaits-unknown",
        "KVReceiver.expect",
        "awaits an owner never expected",
        lambda r: r.expect(2, 16, awaits=[(9, BlockRange(0, 2))]),
        InvalidArgumentError,
        "invalid awaits: owner request_id=9",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-awaits-self",
        "KVReceiver.expect",
        "awaits itself",
        lambda r: r.expect(2, 16, awaits=[(2, BlockRange(0, 2))]),
        InvalidArgumentError,
        "invalid awaits: owner request_id=2",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-duplicate",
        "KVReceiver.expect",
        "request_id already expected",
        lambda r: r.expect(1, 16),
        InvalidArgumentError,
        "invalid request_id=1: already expected",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-held-range",
        "KVReceiver.expect",
        "held range past the prompt",
        lambda r: r.expect(2, 16, held=[BlockRange(0, 9)]),
        InvalidArgumentError,
        "invalid range=[0, 9)",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-held-overlap",
        "KVReceiver.expect",
        "overlapping held ranges",
        lambda r: r.expect(2, 16, held=[BlockRange(0, 2), BlockRange(1, 3)]),
        DuplicateTransferError,
        "block 1 is already claimed",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-held-tuple",
        "KVReceiver.expect",
        "held=[(0, 2)], tuples",
        lambda r: r.expect(2, 16, held=[(0, 2)]),
        TypeError,
        "range must be a BlockRange, got tuple (0, 2)",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-huge",
        "KVReceiver.expect",
        "prompt_len=2**64",
        lambda r: r.expect(2, HUGE),
        InvalidArgumentError,
        f"invalid prompt_len={HUGE}",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-unknown",
        "KVReceiver.deliver",
        "notice of an unknown request",
        lambda r: r.deliver(Notice(9, 0, 0, 1, False)),
        UnknownRequestError,
        "unknown request_id=9",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-range",
        "KVReceiver.deliver",
        "notice past the prompt",
        lambda r: r.deliver(Notice(1, 1, 2, 9, True)),
        InvalidArgumentError,
        "invalid range=[2, 9)",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-again",
        "KVReceiver.deliver",
        "notice of blocks already arrived",
        lambda r: r.deliver(Notice(1, 1, 1, 4, True)),
        DuplicateTransferError,
        "block 1 is already claimed",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-negative",
        "KVReceiver.deliver",
        "notice start=-1",
        lambda r: r.deliver(Notice(1, 1, -1, 3, False)),
        InvalidArgumentError,
        "invalid start=-1",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-epoch",
        "KVReceiver.deliver",
        "notice of an epoch never issued",
        lambda r: r.deliver(Notice(1, 1, 2, 4, True, 99)),
        InvalidArgumentError,
        "invalid epoch=99 for request 1: never issued",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-groups",
        "KVReceiver.deliver",
        "a notice of group 0 of 3 (the pool has 2 layers)",
        lambda r: r.deliver(Notice(1, 1, 2, 4, True, 0, 0, 3)),
        InvalidArgumentError,
        "invalid groups=3: must be in [1, 2]",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-revoked-epoch",
        "KVReceiver.revoked",
        "fence of an epoch never issued",
        lambda r: r.revoked(1, 99),
        InvalidArgumentError,
        "invalid epoch=99 for request 1: never issued",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-wait-unknown",
        "KVReceiver.wait",
        "unknown request id",
        lambda r: r.wait(99, timeout=0),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-release-unknown",
        "KVReceiver.release",
        "unknown request id",
        lambda r: r.release(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-release-unfenced-unknown",
        "KVReceiver.release_unfenced",
        "unknown request id",
        lambda r: r.release_unfenced(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-cancel-unknown",
        "KVReceiver.cancel",
        "unknown request id",
        lambda r: r.cancel(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-fenced-unknown",
        "KVReceiver.fenced",
        "unknown request id",
        lambda r: r.fenced(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-notices-unknown",
        "KVReceiver.notices",
        "unknown request id",
        lambda r: r.notices(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-dst-short",
        "KVReceiver.expect",
        "dst_blocks=[3] for a 2-block request",
        lambda r: r.expect(2, 8, dst_blocks=[3]),
        InvalidArgumentError,
        "invalid dst_blocks: 1 ids, the request has 2 blocks",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-dst-twice",
        "KVReceiver.expect",
        "dst_blocks=[3, 3]",
        lambda r: r.expect(2, 8, dst_blocks=[3, 3]),
        InvalidArgumentError,
        "invalid dst_blocks: a destination block appears twice",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-dst-outside",
        "KVReceiver.expect",
        "dst_blocks=[3, 99] (a 6-block pool)",
        lambda r: r.expect(2, 8, dst_blocks=[3, 99]),
        InvalidArgumentError,
        "invalid dst_blocks: block 99 is outside the pool's [0, 6)",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-expect-dst-float",
        "KVReceiver.expect",
        "dst_blocks=[3.0, 4.0]",
        lambda r: r.expect(2, 8, dst_blocks=[3.0, 4.0]),
        InvalidArgumentError,
        "invalid dst_blocks: a 1-d array of integer block ids",
        new_receiver,
        receiver_state,
    ),
    Row(
        "receiver-deliver-lease",
        "KVReceiver.deliver",
        "a sender's notice whose write used blocks [3, 5], lease [3, 4]",
        lambda r: r.deliver(Notice(2, 0, 0, 2, True), "sender", dst_ids=np.array([3, 5])),
        LeaseError,
        "invalid dst_ids for request 2",
        new_leased_receiver,
        leased_state,
    ),
    Row(
        "receiver-deliver-lease-unnamed",
        "KVReceiver.deliver",
        "a sender's notice naming no blocks, lease [3, 4]",
        lambda r: r.deliver(Notice(2, 0, 0, 2, True), "sender"),
        LeaseError,
        "names no destination blocks, and the lease holds [3, 4]",
        new_leased_receiver,
        leased_state,
    ),
    # -- endpoints, transports and the wire --------------------------------------------------
    Row(
        "transport-authkey-short",
        "ShmTransport(address, authkey=...)",
        "a 31-byte key",
        lambda _: ShmTransport("unix:///nonexistent.sock", authkey=b"k" * 31),
        InvalidArgumentError,
        "invalid authkey: 31 bytes, need at least 32",
    ),
    Row(
        "transport-authkey-str",
        "ShmTransport(address, authkey=...)",
        "authkey='secret'",
        lambda _: ShmTransport("unix:///nonexistent.sock", authkey="s" * 32),
        TypeError,
        "authkey must be bytes, got str",
    ),  # type: ignore[arg-type]
    Row(
        "transport-address-path",
        "ShmTransport(address, ...)",
        "a bare path, no scheme",
        lambda _: ShmTransport("/tmp/x.sock", authkey=KEY),
        InvalidArgumentError,
        "invalid address='/tmp/x.sock': expected unix:///path or tcp://host:port",
    ),
    Row(
        "transport-address-port",
        "ShmTransport(address, ...)",
        "tcp://h:70000",
        lambda _: ShmTransport("tcp://h:70000", authkey=KEY),
        InvalidArgumentError,
        "invalid address='tcp://h:70000': the port must be a number in [0, 65535]",
    ),
    Row(
        "transport-address-v6",
        "ShmTransport(address, ...)",
        "tcp://::1:5 (IPv6 without brackets)",
        lambda _: ShmTransport("tcp://::1:5", authkey=KEY),
        InvalidArgumentError,
        "IPv6 in brackets: tcp://[::1]:port",
    ),
    Row(
        "transport-handshake-timeout",
        "ShmTransport(..., handshake_timeout=...)",
        "handshake_timeout=0",
        lambda _: ShmTransport("unix:///nonexistent.sock", authkey=KEY, handshake_timeout=0),
        InvalidArgumentError,
        "invalid handshake_timeout=0: must be a finite number of seconds > 0",
    ),
    Row(
        "endpoint-authkey-short",
        "StagingEndpoint(receiver, authkey=...) (any endpoint)",
        "a 16-byte key",
        lambda r: StagingEndpoint(r, authkey=b"k" * 16, capacity_blocks=4),
        InvalidArgumentError,
        "invalid authkey: 16 bytes, need at least 32",
        new_receiver,
        receiver_state,
    ),
    Row(
        "endpoint-wildcard",
        "StagingEndpoint(..., address=...)",
        "tcp://0.0.0.0:0 without advertise",
        lambda r: StagingEndpoint(r, authkey=KEY, capacity_blocks=4, address="tcp://0.0.0.0:0"),
        InvalidArgumentError,
        "a wildcard bind needs advertise=",
        new_receiver,
        receiver_state,
    ),
    Row(
        "endpoint-advertise-unix",
        "StagingEndpoint(..., advertise=...)",
        "advertise= with a unix:// address",
        lambda r: StagingEndpoint(r, authkey=KEY, capacity_blocks=4, advertise="10.0.0.5"),
        InvalidArgumentError,
        "invalid advertise='10.0.0.5': only for a tcp:// address",
        new_receiver,
        receiver_state,
    ),
    Row(
        "endpoint-advertise-bad",
        "StagingEndpoint(..., advertise=...)",
        "advertise='a b'",
        lambda r: StagingEndpoint(r, authkey=KEY, capacity_blocks=4, address="tcp://127.0.0.1:0", advertise="a b"),
        InvalidArgumentError,
        "invalid advertise='a b'",
        new_receiver,
        receiver_state,
    ),
    Row(
        "wire-encode-kind",
        "_core.wire_encode",
        "kind='pickle'",
        lambda _: wire_encode("pickle", b""),
        InvalidArgumentError,
        'invalid kind="pickle": not a frame type',
    ),
    Row(
        "wire-encode-huge",
        "_core.wire_encode",
        "a notice with end=2**70",
        lambda _: wire_encode("notices", {"notices": [(1, 0, 0, 2**70, True, 0, 0, 1)], "dst_ids": None}),
        InvalidArgumentError,
        "invalid end=1180591620717411303424",
    ),
    Row(
        "wire-encode-dst-count",
        "_core.wire_encode",
        "one destination id for a 2-block notice",
        lambda _: wire_encode(
            "notices", {"notices": [(1, 0, 0, 2, True, 0, 0, 1)], "dst_ids": np.array([5]), "checksums": None}
        ),
        InvalidArgumentError,
        "invalid dst_ids=<1 ids>: must be one id per block the notices cover",
    ),
    Row(
        "wire-encode-checksum-count",
        "_core.wire_encode",
        "three checksums for a 2-block notice",
        lambda _: wire_encode(
            "notices",
            {"notices": [(1, 0, 0, 2, True, 0, 0, 1)], "dst_ids": None, "checksums": np.arange(3, dtype=np.uint64)},
        ),
        InvalidArgumentError,
        "invalid checksums=<3 checksums>: must be one checksum per block the notices cover",
    ),
    Row(
        "checksums-block-id",
        "_core.block_checksums",
        "block 24 of a 24-block pool",
        lambda _: block_checksums([np.zeros((2, 24, 64), dtype=np.uint8)], np.array([3, 24]), 0),
        InvalidArgumentError,
        "invalid block_ids=<an array holding 24>: must be block ids in [0, 24)",
    ),
    Row(
        "receiver-checksum-unsummable",
        "KVReceiver",
        "checksum=True over 3-byte segments",
        lambda _: KVReceiver(Pools(shape=(4, 3), layers=1, tpb=1, dtype=torch.uint8).zeros(), checksum=True),
        InvalidArgumentError,
        "invalid checksum=True: the pool's blocks cannot be summed in 8-byte words (segments of 3 bytes",
    ),
    Row(
        "sender-checksum-type",
        "KVSender",
        'checksum="on"',
        lambda _: in_process_pair(checksum="on"),
        TypeError,
        "checksum must be a bool or None, got str 'on'",
    ),
    Row(
        "wire-encode-name",
        "_core.wire_encode",
        "agent name with a slash",
        lambda _: wire_encode("agent", {"agent_name": "a/b"}),
        InvalidArgumentError,
        'invalid agent_name="a/b"',
    ),
    Row(
        "wire-decode-magic",
        "_core.wire_decode",
        "a pickle",
        lambda _: wire_decode(b"\x80\x04\x95" + bytes(20), 1 << 20),
        InvalidArgumentError,
        "invalid frame: bad magic",
    ),
    Row(
        "wire-decode-version",
        "_core.wire_decode",
        "version 5",
        lambda _: wire_decode(b"KVFW\x05\x00\x04\x00" + bytes(4), 1 << 20),
        InvalidArgumentError,
        "invalid frame: unsupported wire version 5 (this side speaks 4)",
    ),
    Row(
        "wire-decode-type",
        "_core.wire_decode",
        "frame type 99",
        lambda _: wire_decode(b"KVFW\x04\x00\x63\x00" + bytes(4), 1 << 20),
        InvalidArgumentError,
        "invalid frame: unknown frame type 99",
    ),
    Row(
        "wire-decode-limit",
        "_core.wire_decode",
        "a body past the connection's limit",
        lambda _: wire_decode(b"KVFW\x04\x00\x04\x00\x00\x01\x00\x00" + bytes(256), 33),
        InvalidArgumentError,
        "invalid frame: frame of 256 bytes exceeds the limit of 33",
    ),
    Row(
        "wire-decode-count",
        "_core.wire_decode",
        "a count of 2**32-1 notices in 4 bytes",
        lambda _: wire_decode(b"KVFW\x04\x00\x04\x00\x04\x00\x00\x00\xff\xff\xff\xff", 1 << 20),
        InvalidArgumentError,
        "invalid frame: invalid notices=<4294967295 items>",
    ),
    # -- TransferHook --------------------------------------------------------------------------
    Row(
        "hook-add-epoch",
        "TransferHook.add_request",
        "epoch=-1",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[4, 5, 6, 7], dst_blocks=[0, 1, 2, 3], epoch=-1),
        InvalidArgumentError,
        "invalid epoch=-1",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-prompt",
        "TransferHook.add_request",
        "prompt_len=0",
        lambda c: c[0].add_request(2, 0, reused_len=0, src_blocks=[0], dst_blocks=[0]),
        InvalidArgumentError,
        "invalid prompt_len=0",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-duplicate",
        "TransferHook.add_request",
        "request_id already added",
        lambda c: c[0].add_request(1, 16, reused_len=8, src_blocks=[4, 5, 6, 7], dst_blocks=[4, 5, 0, 1]),
        InvalidArgumentError,
        "invalid request_id=1",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-float",
        "TransferHook.add_request",
        "float src_blocks",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[4.5, 5, 6, 7], dst_blocks=[0, 1, 2, 3]),
        TypeError,
        "src_blocks must hold integer block ids, got dtype float64",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-bool",
        "TransferHook.add_request",
        "bool dst_blocks (a mask)",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[4, 5, 6, 7], dst_blocks=[True] * 4),
        TypeError,
        "dst_blocks must hold integer block ids, got dtype bool",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-2d",
        "TransferHook.add_request",
        "2-d src_blocks",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[[4, 5, 6, 7]], dst_blocks=[0, 1, 2, 3]),
        InvalidArgumentError,
        "invalid src_blocks=<2-d array>",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-ragged",
        "TransferHook.add_request",
        "ragged src_blocks",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[[4], [5, 6]], dst_blocks=[0, 1, 2, 3]),
        InvalidArgumentError,
        "invalid src_blocks: must be a 1-d sequence of block ids",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-add-short",
        "TransferHook.add_request",
        "fewer dst_blocks than prompt blocks",
        lambda c: c[0].add_request(2, 16, reused_len=8, src_blocks=[4, 5, 6, 7], dst_blocks=[0]),
        InvalidArgumentError,
        "invalid dst_blocks=<1 ids>: must name all 4 blocks of the prompt",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-before-unknown",
        "TransferHook.before_forward",
        "unknown request id",
        lambda c: c[0].before_forward([1, 99]),
        UnknownRequestError,
        "unknown request_id=99",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-before-float",
        "TransferHook.before_forward",
        "a float request id",
        lambda c: c[0].before_forward([1.0]),
        TypeError,
        "request_ids must hold ints, got float 1.0",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-after-unknown",
        "TransferHook.after_forward",
        "unknown request id",
        lambda c: c[0].after_forward([99], [0], [4]),
        UnknownRequestError,
        "unknown request_id=99",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-after-length",
        "TransferHook.after_forward",
        "chunk_starts longer than request_ids",
        lambda c: c[0].after_forward([1], [8, 9], [16]),
        InvalidArgumentError,
        "invalid chunk_starts=<array of length 2>",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-after-float",
        "TransferHook.after_forward",
        "float chunk_ends",
        lambda c: c[0].after_forward([1], [8], [15.5]),
        TypeError,
        "chunk_ends must be an array castable to int64, got dtype float64",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-after-ragged",
        "TransferHook.after_forward",
        "ragged chunk_starts",
        lambda c: c[0].after_forward([1], [[8], [8, 9]], [16]),
        InvalidArgumentError,
        "invalid chunk_starts=[[8], [8, 9]]",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-finish-unknown",
        "TransferHook.finish",
        "unknown request id",
        lambda c: c[0].finish(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-cancel-unknown",
        "TransferHook.cancel",
        "unknown request id",
        lambda c: c[0].cancel(99),
        UnknownRequestError,
        "unknown request_id=99",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-cancelled-send",
        "TransferHook.before_forward",
        "a cancelled request id",
        lambda c: (c[0].cancel(1), c[0].before_forward([1])),
        UnknownRequestError,
        "unknown request_id=1",
        new_hook,
    ),
    Row(
        "hook-layer-range",
        "TransferHook.after_layer",
        "layer=2 of 2 layers",
        lambda c: c[0].after_layer([1], [8], [16], 2),
        InvalidArgumentError,
        "invalid layer=2: must be in [0, 2)",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-layer-float",
        "TransferHook.after_layer",
        "layer=1.0",
        lambda c: c[0].after_layer([1], [8], [16], 1.0),
        TypeError,
        "layer must be an int, got float 1.0",
        new_hook,
        hook_state,
    ),  # type: ignore[arg-type]
    Row(
        "hook-layer-lengths",
        "TransferHook.after_layer",
        "two chunk_starts for one request",
        lambda c: c[0].after_layer([1], [8, 9], [16], 1),
        InvalidArgumentError,
        "invalid chunk_starts=<2 values>",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-layer-unknown",
        "TransferHook.after_layer",
        "unknown request id",
        lambda c: c[0].after_layer([7], [8], [16], 1),
        UnknownRequestError,
        "unknown request_id=7",
        new_hook,
        hook_state,
    ),
    Row(
        "hook-order-after-signal",
        "TransferHook.order_after",
        "signal=None",
        lambda c: c[0].order_after([0], None),
        TypeError,
        "signal must be a torch.cuda.Event, a threading.Event or a concurrent.futures.Future, got NoneType None",
        new_hook,
        hook_state,
    ),  # type: ignore[arg-type]
    Row(
        "hook-order-after-range",
        "TransferHook.order_after",
        "src id outside the pool",
        lambda c: c[0].order_after([8], threading.Event()),
        InvalidArgumentError,
        "invalid src_ids=<block id 8>: must be in [0, 8)",
        new_hook,
        hook_state,
    ),
    # -- kvferry plan --------------------------------------------------------------------------
    Row(
        "cli-fanout-requests-zero",
        "kvferry bench fanout",
        "--requests 0",
        lambda _: cli("bench", "fanout", "--requests", "0"),
        CliExit,
        "argument --requests: must be > 0, got 0",
    ),
    Row(
        "cli-fanout-ipc-on-cpu",
        "kvferry bench fanout",
        "--transport cuda-ipc on cpu",
        lambda _: cli("bench", "fanout", "--transport", "cuda-ipc"),
        CliExit,
        "invalid --transport='cuda-ipc' for --device='cpu'",
    ),
    Row(
        "cli-fanout-link-nan",
        "kvferry bench fanout",
        "--link-gbps nan",
        lambda _: cli("bench", "fanout", "--link-gbps", "nan"),
        CliExit,
        "argument --link-gbps",
    ),
    Row(
        "cli-tiers-fraction",
        "kvferry bench tiers",
        "--host-fraction 1.5",
        lambda _: cli("bench", "tiers", "--host-fraction", "1.5"),
        CliExit,
        "argument --host-fraction: must be in [0, 1], got 1.5",
    ),
    Row(
        "cli-tiers-fraction-nan",
        "kvferry bench tiers",
        "--host-fraction nan",
        lambda _: cli("bench", "tiers", "--host-fraction", "nan"),
        CliExit,
        "argument --host-fraction: must be a finite number >= 0, got nan",
    ),
    Row(
        "cli-tiers-blocks-zero",
        "kvferry bench tiers",
        "--blocks 0",
        lambda _: cli("bench", "tiers", "--blocks", "0"),
        CliExit,
        "argument --blocks: must be > 0, got 0",
    ),
    Row(
        "cli-tiers-ipc-on-cpu",
        "kvferry bench tiers",
        "--transport cuda-ipc on cpu",
        lambda _: cli("bench", "tiers", "--transport", "cuda-ipc"),
        CliExit,
        "invalid --transport='cuda-ipc' for --device='cpu'",
    ),
    Row(
        "cli-tiers-blocks-huge",
        "kvferry bench tiers",
        "--blocks 10**9 (more than memory)",
        lambda _: cli("bench", "tiers", "--blocks", str(10**9)),
        CliExit,
        "the device pool and the receiver's pool need at least",
    ),
    Row(
        "cli-tiers-no-cuda",
        "kvferry bench tiers",
        "--device cuda without a GPU",
        lambda _: cli("bench", "tiers", "--device", "cuda"),
        CliExit,
        "--device cuda: no CUDA device is visible",
        skip="a CUDA device is visible" if CUDA else None,
    ),
    Row(
        "cli-plan-tpb-zero",
        "kvferry plan",
        "--tokens-per-block 0",
        lambda _: cli("plan", "--tokens-per-block", "0", "--prompt", "8"),
        CliExit,
        "argument --tokens-per-block: must be > 0, got 0",
    ),
    Row(
        "cli-plan-tpb-text",
        "kvferry plan",
        "--tokens-per-block x",
        lambda _: cli("plan", "--tokens-per-block", "x", "--prompt", "8"),
        CliExit,
        "argument --tokens-per-block: expected an integer, got 'x'",
    ),
    Row(
        "cli-plan-tpb-huge",
        "kvferry plan",
        "--tokens-per-block 2**64",
        lambda _: cli("plan", "--tokens-per-block", str(HUGE), "--prompt", "8"),
        CliExit,
        f"invalid --tokens-per-block={HUGE}",
    ),
    Row(
        "cli-plan-prompt-zero",
        "kvferry plan",
        "--prompt 0",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "0"),
        CliExit,
        "argument --prompt: must be > 0, got 0",
    ),
    Row(
        "cli-plan-prompt-huge",
        "kvferry plan",
        "--prompt 10**20",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", str(10**20)),
        CliExit,
        f"invalid --prompt={10**20}",
    ),
    Row(
        "cli-plan-prompt-too-long",
        "kvferry plan",
        "--prompt over MAX_LEDGER_BLOCKS blocks",
        lambda _: cli("plan", "--tokens-per-block", "1", "--prompt", str(MAX_LEDGER_BLOCKS + 1)),
        CliExit,
        f"invalid --prompt={MAX_LEDGER_BLOCKS + 1}",
    ),
    Row(
        "cli-plan-prompt-missing",
        "kvferry plan",
        "no --prompt",
        lambda _: cli("plan", "--tokens-per-block", "4"),
        CliExit,
        "the following arguments are required: --prompt",
    ),
    Row(
        "cli-plan-reused-negative",
        "kvferry plan",
        "--reused -1",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "8", "--reused", "-1"),
        CliExit,
        "argument --reused: must be >= 0, got -1",
    ),
    Row(
        "cli-plan-reused-prompt",
        "kvferry plan",
        "--reused == --prompt",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "8", "--reused", "8"),
        CliExit,
        "invalid --reused=8: must be < --prompt (8)",
    ),
    Row(
        "cli-plan-chunk-zero",
        "kvferry plan",
        "--chunk 0",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "8", "--chunk", "0"),
        CliExit,
        "argument --chunk: must be > 0, got 0",
    ),
    Row(
        "cli-plan-window-negative",
        "kvferry plan",
        "--window -1",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "8", "--window", "-1"),
        CliExit,
        "argument --window: must be > 0, got -1",
    ),
    Row(
        "cli-plan-block-bytes-zero",
        "kvferry plan",
        "--block-bytes 0",
        lambda _: cli("plan", "--tokens-per-block", "4", "--prompt", "8", "--block-bytes", "0"),
        CliExit,
        "argument --block-bytes: must be > 0, got 0",
    ),
    Row(
        "cli-unknown-command",
        "kvferry",
        "an unknown command",
        lambda _: cli("frob"),
        CliExit,
        "argument command: invalid choice: 'frob'",
    ),
    # -- kvferry bench copy --------------------------------------------------------------------
    Row(
        "cli-copy-reps-zero",
        "kvferry bench copy",
        "--reps 0",
        lambda _: cli("bench", "copy", "--reps", "0"),
        CliExit,
        "argument --reps: must be > 0, got 0",
    ),
    Row(
        "cli-copy-layers-negative",
        "kvferry bench copy",
        "--layers -1",
        lambda _: cli("bench", "copy", "--layers", "-1"),
        CliExit,
        "argument --layers: must be > 0, got -1",
    ),
    Row(
        "cli-copy-block-kib-zero",
        "kvferry bench copy",
        "--block-kib 0",
        lambda _: cli("bench", "copy", "--block-kib", "0"),
        CliExit,
        "argument --block-kib: must be > 0, got 0",
    ),
    Row(
        "cli-copy-blocks-zero",
        "kvferry bench copy",
        "--blocks 8,0",
        lambda _: cli("bench", "copy", "--blocks", "8,0"),
        CliExit,
        "argument --blocks: must be > 0, got 0",
    ),
    Row(
        "cli-copy-blocks-empty",
        "kvferry bench copy",
        "--blocks 8,,9",
        lambda _: cli("bench", "copy", "--blocks", "8,,9"),
        CliExit,
        "argument --blocks: expected an integer, got ''",
    ),
    Row(
        "cli-copy-blocks-huge",
        "kvferry bench copy",
        "--blocks 10**9 (more than memory)",
        lambda _: cli("bench", "copy", "--blocks", str(10**9)),
        CliExit,
        "a source and a destination pool need at least",
    ),
    Row(
        "cli-copy-block-kib-huge",
        "kvferry bench copy",
        "--block-kib 10**11 (more than memory)",
        lambda _: cli("bench", "copy", "--block-kib", str(10**11)),
        CliExit,
        "lower --blocks/--layers/--block-kib",
    ),
    Row(
        "cli-copy-ring-mib-zero",
        "kvferry bench copy",
        "--ring-mib 0",
        lambda _: cli("bench", "copy", "--ring-mib", "0"),
        CliExit,
        "argument --ring-mib: must be > 0, got 0",
    ),
    Row(
        "cli-copy-ring-below-a-block",
        "kvferry bench copy",
        "--ring-mib 1 with 8 layers of 1024 KiB blocks",
        lambda _: cli("bench", "copy", "--ring-mib", "1", "--layers", "8", "--block-kib", "1024"),
        CliExit,
        "invalid --ring-mib=1: less than one block of every layer (8 x 1024 KiB)",
    ),
    Row(
        "cli-copy-receiver-device-cpu",
        "kvferry bench copy",
        "--receiver-device cuda:1 with --device cpu",
        lambda _: cli("bench", "copy", "--receiver-device", "cuda:1"),
        CliExit,
        "invalid --receiver-device='cuda:1': a second GPU is for --device cuda, not 'cpu'",
    ),
    Row(
        "cli-copy-transport",
        "kvferry bench copy",
        "--transport carrier-pigeon",
        lambda _: cli("bench", "copy", "--transport", "carrier-pigeon"),
        CliExit,
        "argument --transport: unknown transport ['carrier-pigeon']",
    ),
    Row(
        "cli-copy-transport-device",
        "kvferry bench copy",
        "--transport cuda-ipc --device cpu",
        lambda _: cli("bench", "copy", "--transport", "cuda-ipc", "--device", "cpu"),
        CliExit,
        "invalid --transport='cuda-ipc' for --device='cpu'",
    ),
    Row(
        "cli-copy-device",
        "kvferry bench copy",
        "--device tpu",
        lambda _: cli("bench", "copy", "--device", "tpu"),
        CliExit,
        "argument --device: invalid choice: 'tpu'",
    ),
    Row(
        "cli-copy-no-cuda",
        "kvferry bench copy",
        "--device cuda without a GPU",
        lambda _: cli("bench", "copy", "--device", "cuda"),
        CliExit,
        "--device cuda: no CUDA device is visible",
        skip="a CUDA device is visible" if CUDA else None,
    ),
    Row(
        "cli-bench-unknown",
        "kvferry bench",
        "an unknown benchmark",
        lambda _: cli("bench", "frob"),
        CliExit,
        "argument bench: invalid choice: 'frob'",
    ),
    # -- kvferry bench agentic -----------------------------------------------------------------
    Row(
        "cli-agentic-sessions-zero",
        "kvferry bench agentic",
        "--sessions 0",
        lambda _: cli("bench", "agentic", "--sessions", "0"),
        CliExit,
        "argument --sessions: must be > 0, got 0",
    ),
    Row(
        "cli-agentic-turns-negative",
        "kvferry bench agentic",
        "--turns -1",
        lambda _: cli("bench", "agentic", "--turns", "-1"),
        CliExit,
        "argument --turns: must be > 0, got -1",
    ),
    Row(
        "cli-agentic-tpb-zero",
        "kvferry bench agentic",
        "--tokens-per-block 0",
        lambda _: cli("bench", "agentic", "--tokens-per-block", "0"),
        CliExit,
        "argument --tokens-per-block: must be > 0, got 0",
    ),
    Row(
        "cli-agentic-chunk-zero",
        "kvferry bench agentic",
        "--chunk 0",
        lambda _: cli("bench", "agentic", "--chunk", "0"),
        CliExit,
        "argument --chunk: must be > 0, got 0",
    ),
    Row(
        "cli-agentic-new-past-cached",
        "kvferry bench agentic",
        "--new larger than --cached",
        lambda _: cli("bench", "agentic", "--cached", "100", "--new", "200"),
        CliExit,
        "--new 200 must be <= --cached 100",
    ),
    Row(
        "cli-agentic-link-negative",
        "kvferry bench agentic",
        "--link-gbps -1",
        lambda _: cli("bench", "agentic", "--link-gbps", "-1"),
        CliExit,
        "argument --link-gbps: must be a finite number >= 0, got -1",
    ),
    Row(
        "cli-agentic-link-nan",
        "kvferry bench agentic",
        "--link-gbps nan",
        lambda _: cli("bench", "agentic", "--link-gbps", "nan"),
        CliExit,
        "argument --link-gbps: must be a finite number >= 0, got nan",
    ),
    Row(
        "cli-agentic-link-inf",
        "kvferry bench agentic",
        "--link-gbps inf",
        lambda _: cli("bench", "agentic", "--link-gbps", "inf"),
        CliExit,
        "argument --link-gbps: must be a finite number >= 0, got inf",
    ),
    Row(
        "cli-agentic-link-text",
        "kvferry bench agentic",
        "--link-gbps fast",
        lambda _: cli("bench", "agentic", "--link-gbps", "fast"),
        CliExit,
        "argument --link-gbps: expected a number, got 'fast'",
    ),
    Row(
        "cli-agentic-heads",
        "kvferry bench agentic",
        "--heads not a multiple of --kv-heads",
        lambda _: cli("bench", "agentic", "--heads", "6", "--kv-heads", "4"),
        CliExit,
        "--heads 6 must be a multiple of --kv-heads 4",
    ),
    Row(
        "cli-agentic-head-dim-odd",
        "kvferry bench agentic",
        "--head-dim 3",
        lambda _: cli("bench", "agentic", "--head-dim", "3"),
        CliExit,
        "--head-dim 3 must be even",
    ),
    Row(
        "cli-agentic-hidden-huge",
        "kvferry bench agentic",
        "--hidden 10**9 (more than memory)",
        lambda _: cli("bench", "agentic", "--hidden", str(10**9)),
        CliExit,
        "the model and its KV pools need at least",
    ),
    Row(
        "cli-agentic-transport",
        "kvferry bench agentic",
        "--transport carrier-pigeon",
        lambda _: cli("bench", "agentic", "--transport", "carrier-pigeon"),
        CliExit,
        "argument --transport: invalid choice: 'carrier-pigeon'",
    ),
    Row(
        "cli-agentic-transport-device",
        "kvferry bench agentic",
        "--transport cuda-ipc --device cpu",
        lambda _: cli("bench", "agentic", "--transport", "cuda-ipc"),
        CliExit,
        "invalid --transport='cuda-ipc' for --device='cpu'",
    ),
    Row(
        "cli-agentic-device",
        "kvferry bench agentic",
        "--device tpu",
        lambda _: cli("bench", "agentic", "--device", "tpu"),
        CliExit,
        "argument --device: invalid choice: 'tpu'",
    ),
    Row(
        "cli-agentic-no-cuda",
        "kvferry bench agentic",
        "--device cuda without a GPU",
        lambda _: cli("bench", "agentic", "--device", "cuda"),
        CliExit,
        "--device cuda: no CUDA device is visible",
        skip="a CUDA device is visible" if CUDA else None,
    ),
    Row(
        "cli-agentic-layerwise-zero",
        "kvferry bench agentic",
        "--layerwise 0",
        lambda _: cli("bench", "agentic", "--layerwise", "0"),
        CliExit,
        "argument --layerwise: must be > 0, got 0",
    ),
    Row(
        "cli-agentic-layerwise-text",
        "kvferry bench agentic",
        "--layerwise all",
        lambda _: cli("bench", "agentic", "--layerwise", "all"),
        CliExit,
        "argument --layerwise: expected an integer, got 'all'",
    ),
    Row(
        "cli-agentic-layerwise-past-layers",
        "kvferry bench agentic",
        "--layerwise 9 --layers 8",
        lambda _: cli("bench", "agentic", "--layerwise", "9", "--layers", "8"),
        CliExit,
        "--layerwise 9 must be <= --layers 8",
    ),
]


def params() -> list[Any]:
    out = []
    for row in ROWS:
        marks = []
        if row.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
        if row.skip:
            marks.append(pytest.mark.skip(reason=row.skip))
        out.append(pytest.param(row, id=row.id, marks=marks))
    return out


@pytest.mark.parametrize("row", params())
def test_bad_input_is_refused(row: Row) -> None:
    err = run_row(row)
    if isinstance(err, CliExit):
        assert err.code == 2, err.code
        assert len(err.stderr.strip().splitlines()) == 1, err.stderr
        assert "Traceback" not in err.stderr


def test_rows_are_unique_and_cover_the_public_names() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))
    entries = " ".join(row.entry for row in ROWS)
    # Every public callable has rows (the exception classes, MAX_LEDGER_BLOCKS and __version__
    # take no input; BlockPairs and BlockRuns only come out of calls, like SlicePlan).
    no_input = {
        "MAX_LEDGER_BLOCKS",
        "__version__",
        "BlockPairs",
        "BlockRuns",
        "KvFerryError",
        "InvalidArgumentError",
        "DuplicateTransferError",
        "UnknownRequestError",
        "MissingDependencyError",
    }
    for name in set(kvferry.__all__) - no_input:
        assert name in entries, name
    for name in (
        "copy_blocks",
        "PagedKV(",
        "check_compatible",
        "KVSender",
        "KVReceiver",
        "TransferHook",
        "kvferry plan",
        "kvferry bench copy",
        "kvferry bench agentic",
        "kvferry bench tiers",
        "KVSender.order_after",
    ):
        assert name in entries, name


def test_cli_error_is_one_line_in_a_real_process() -> None:
    """The console path of one row that used to end in a traceback (an int past int64)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "plan", "--tokens-per-block", "4", "--prompt", str(10**20)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"kvferry plan: error: invalid --prompt={10**20}: must be in [-2**63, 2**63) (an int64)"
    )


def test_huge_pool_sizes_never_decide_an_allocation() -> None:
    # pack_pairs once sized its duplicate check by dst_blocks: this aborted the process.
    assert pack_pairs([], [], 1, 2**63 - 1).shape == (2, 0)
    assert pack_pairs([0], [2**62], 1, 2**63 - 1).tolist() == [[0], [2**62]]
    book = new_book()
    far = np.array([[0, 2**62, 5, 3]])  # sparse: the duplicate check hashes instead of a bitmap
    plan = book.plan_early([1], src_block_table=TABLE, dst_block_table=far, src_blocks=4, dst_blocks=2**63 - 1)
    assert plan.pairs is not None and plan.pairs.dst.tolist() == far[0, :3].tolist()


def test_pool_checked_plan_commits_when_valid() -> None:
    """The bounds only refuse: a plan inside both pools is planned and claimed as before."""
    book = new_book()
    plan = book.plan_early([1], src_block_table=TABLE, dst_block_table=TABLE[:, ::-1], src_blocks=4, dst_blocks=4)
    assert plan.pairs is not None and plan.pairs.dst.tolist() == [3, 2, 1]
    assert book.prefix_sent(1) and book.claimed_blocks(1) == 3


def test_hook_accepts_what_an_engine_passes() -> None:
    """The hook's new checks refuse nothing valid: int lists, int32 arrays, torch tensors."""
    hook, sender, receiver = new_hook()
    try:
        receiver.expect(2, 8)
        hook.add_request(
            2, 8, reused_len=4, src_blocks=np.array([4, 5], dtype=np.int32), dst_blocks=torch.tensor([4, 5])
        )
        notices = hook.before_forward(list(np.array([1, 2])))  # numpy ints, as engines hold them
        assert [(n.request_id, n.start, n.end) for n in notices] == [(1, 0, 2), (2, 0, 1)]
        hook.after_forward([1, 2], [8, 4], np.array([16, 8]).tolist())
        for rid in (1, 2):
            hook.finish(rid, timeout=10)
            receiver.wait(rid, timeout=10)
    finally:
        sender.close()


# ---------------------------------------------------------------------------------------------
# Random invalid arrays: whatever the dtype or shape, a copy is refused by name, before any write
# ---------------------------------------------------------------------------------------------

BAD_DTYPES = st.sampled_from(
    [np.dtype(t) for t in ("float32", "float64", "bool", "complex64", "uint64", "U3", "datetime64[s]")]
)


@given(
    which=st.sampled_from(["src_ids", "dst_ids"]),
    ids=st.one_of(
        hnp.arrays(BAD_DTYPES, st.integers(1, 6)),
        hnp.arrays(np.int64, hnp.array_shapes(min_dims=2, max_dims=3, max_side=3)),
        hnp.arrays(np.int64, st.just(())),
    ),
)
def test_random_invalid_id_arrays_are_refused_by_name(which: str, ids: np.ndarray) -> None:
    pools = new_pools()
    before = dst_bytes(pools)
    good = np.arange(ids.size if ids.ndim == 1 else 1, dtype=np.int64) % 6
    src, dst = (ids, good) if which == "src_ids" else (good, ids)
    with pytest.raises((TypeError, InvalidArgumentError)) as info:
        copy_blocks(*pools, src, dst)
    assert which in str(info.value)
    assert dst_bytes(pools) == before


@given(
    n=st.integers(1, 12),
    data=st.data(),
)
def test_random_out_of_range_or_repeated_ids_change_nothing(n: int, data: st.DataObject) -> None:
    """Any copy with one bad id (out of either pool, or a repeated destination) is refused and
    the destination pool keeps every byte; a copy without one goes through."""
    pools = new_pools()
    src = data.draw(st.lists(st.integers(-3, 10), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(-3, 8), min_size=n, max_size=n))
    valid = all(0 <= s < 8 for s in src) and all(0 <= d < 6 for d in dst) and len(set(dst)) == n
    before = dst_bytes(pools)
    if valid:
        copy_blocks(*pools, src, dst)
        return
    with pytest.raises(InvalidArgumentError, match="src_ids|dst_ids"):
        copy_blocks(*pools, src, dst)
    assert dst_bytes(pools) == before


# ---------------------------------------------------------------------------------------------
# docs/bad-input.md: generated from ROWS, checked against them
# ---------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`" if "`" not in text else cell(text)


def row_prefix(row: Row) -> str:
    """The columns of a row's doc line that are fixed by the row itself."""
    status = f"{row.error.__name__} (open bug)" if row.xfail else row.error.__name__
    error = "exit 2, one line on stderr" if row.error is CliExit else code(status)
    return f"| {row.id} | {code(row.entry)} | {cell(row.bad)} | {error} | {code(row.needle)} |"


def outcome(row: Row) -> str:
    """What the call does today, for the example column."""
    if row.skip:  # e.g. a CUDA row on a machine without one: it would show only that
        return cell(f"(not run where the table was generated: {row.skip})")
    ctx = row.setup()
    try:
        row.call(ctx)
    except CliExit as err:
        return cell(err.stderr.strip())
    except BaseException as err:  # noqa: BLE001 (the doc shows whatever happens)
        text = f"{type(err).__name__}: {err}"
        return cell(text if len(text) <= 160 else text[:157] + "...")
    finally:
        close(ctx)
    return "(accepted: no error)"


HEADER = """# Bad input: what each entry point refuses

Every public function, method and CLI option refuses invalid input with a precise error: the
exception class below, and a message that names the argument and its value. A refused call
on a stateful object (a ledger, a book, a sender, a receiver, a hook, a destination pool)
changes nothing: the test of such a row compares everything observable before and after.

This table is generated from the rows of `tests/test_bad_input.py`
(`.venv/bin/python tests/test_bad_input.py` rewrites it); `test_doc_lists_every_row` fails
when the two drift. "Today" is what the call did when the table was generated; rows marked
*open bug* are strict xfails in the test, each with the fix in its reason.

Classes: `InvalidArgumentError` (a `ValueError`) for a value outside its domain,
`TypeError` for a value of the wrong kind, `UnknownRequestError` (a `KeyError`) for a request
id that was never added or is gone, `DuplicateTransferError` for a block claimed twice,
`LayoutMismatchError` (a `ValueError`) for pools that cannot exchange blocks.
"""

FOOTER = """
## Accepted on purpose

- Non-contiguous, int32/int16 or torch (CPU) id arrays and block tables: converted once to
  contiguous int64 (`test_book.py::test_non_contiguous_batch_inputs`). Non-contiguity is only
  an error for the pool's layer tensors, whose bytes kernels address directly.
- `True`/`False` where an integer is expected by the Rust core (`BlockRange(True, 2)`): Python
  treats `bool` as an `int`. `PagedKV` refuses it for `tokens_per_block`, where it is a bug.
- A window at least as long as the prompt: full attention, not an error.
- `kvferry plan --chunk` larger than the prompt: one chunk.
- `KVSender.in_flight` and `KVSender.leased` of an unknown id: `False` (a question, not an
  action).
- `epoch=0` in `KVSender.add` / `TransferHook.add_request` and on a notice: no epoch was
  issued (the sender was not told one); such notices are not checked against the request's
  epoch.
- `KVSender.order_after` / `TransferHook.order_after` with no ids, or with a signal that has
  already completed: accepted, and nothing is declared (a completed tier copy orders
  nothing).
- A notice, announce or fence of an epoch that was issued but is not the request's current
  one (the request was released, its id reused): discarded and counted
  (`KVReceiver.discarded`), not an error: it is late, not wrong.

## What a refused call may still change

- `KVReceiver.deliver` refuses a bad notice without marking any block arrived, and marks the
  request failed (its `wait` raises at once instead of at its timeout): a sender that
  announced a bad slice cannot be trusted for that request any more. The rows check that the
  arrivals (`notices`, `is_complete`, `fenced`) are unchanged. A fence (`KVReceiver.revoked`)
  of an epoch never issued is refused the same way.
"""


def render() -> str:
    lines = [
        HEADER,
        f"{len(ROWS)} rows.",
        "",
        "| id | entry point | bad input | raises | message contains | today |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"{row_prefix(row)} {outcome(row)} |" for row in ROWS]
    lines += [
        "",
        "## Open bugs",
        "",
        "Rows the test marks `xfail(strict=True)`: the fix belongs to a module this table may not change.",
        "",
    ]
    lines += [f"- **{row.id}**: {row.xfail}" for row in ROWS if row.xfail]
    return "\n".join(lines) + "\n" + FOOTER


def test_doc_lists_every_row() -> None:
    text = DOC.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| id ", "|---"))]
    assert len(table) == len(ROWS), "docs/bad-input.md is stale: run .venv/bin/python tests/test_bad_input.py"
    for line, row in zip(table, ROWS):
        assert line.startswith(row_prefix(row)), (
            f"docs/bad-input.md is stale at row {row.id}: run .venv/bin/python tests/test_bad_input.py"
        )


if __name__ == "__main__":
    DOC.write_text(render())
    print(f"wrote {DOC} ({len(ROWS)} rows)")
