"""BlockRange (the value every plan speaks in) and TransferLedger (one request's bitmap)."""

from __future__ import annotations

import copy
import pickle

import kvferry
import pytest
from kvferry import (
    BlockRange,
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    TransferLedger,
)

# ---------------------------------------------------------------------------------------------
# BlockRange
# ---------------------------------------------------------------------------------------------


def test_block_range_attributes_and_len() -> None:
    r = BlockRange(3, 8)
    assert (r.start, r.end) == (3, 8)
    assert len(r) == 5
    assert len(BlockRange(4, 4)) == 0  # empty ranges are valid values
    assert isinstance(r.start, int) and isinstance(r.end, int)


def test_block_range_equality() -> None:
    assert BlockRange(0, 6) == BlockRange(0, 6)
    assert not (BlockRange(0, 6) != BlockRange(0, 6))
    assert BlockRange(0, 6) != BlockRange(0, 5)
    assert BlockRange(0, 6) != BlockRange(1, 6)
    # A tuple with the same bounds is a different kind of value, and None is no range: the
    # comparison is left to the other operand (NotImplemented), so == is False and != True.
    assert BlockRange(0, 6) != (0, 6)
    assert BlockRange(0, 6).__eq__((0, 6)) is NotImplemented
    assert BlockRange(0, 6).__eq__(None) is NotImplemented and BlockRange(0, 6).__ne__(None) is NotImplemented
    assert not (BlockRange(0, 6) == None) and BlockRange(0, 6) != None  # noqa: E711


def test_block_range_hash_in_sets_and_dicts() -> None:
    assert hash(BlockRange(2, 9)) == hash(BlockRange(2, 9))
    assert len({BlockRange(0, 6), BlockRange(0, 6), BlockRange(0, 7), BlockRange(1, 6)}) == 3
    table = {BlockRange(0, 6): "a", BlockRange(6, 8): "b"}
    assert table[BlockRange(0, 6)] == "a"
    assert table[BlockRange(6, 8)] == "b"
    assert BlockRange(0, 7) not in table


def test_block_range_repr() -> None:
    assert repr(BlockRange(0, 6)) == "BlockRange(0, 6)"
    assert repr(BlockRange(21, 25)) == "BlockRange(21, 25)"
    # Constructor-style: evaluating the repr rebuilds the value.
    assert eval(repr(BlockRange(3, 5)), {"BlockRange": BlockRange}) == BlockRange(3, 5)


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_block_range_pickle_round_trip(protocol: int) -> None:
    r = BlockRange(7, 19)
    back = pickle.loads(pickle.dumps(r, protocol=protocol))
    assert back == r and type(back) is BlockRange
    assert len(back) == 12


def test_block_range_copy() -> None:
    r = BlockRange(1, 4)
    assert copy.copy(r) == r
    assert copy.deepcopy(r) == r


@pytest.mark.parametrize(
    ("start", "end", "needle"),
    [(-1, 2, "start=-1"), (-5, -1, "start=-5"), (3, 2, "end=2"), (0, -1, "end=-1")],
)
def test_block_range_invalid(start: int, end: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        BlockRange(start, end)
    assert isinstance(info.value, InvalidArgumentError)


def test_block_range_is_frozen() -> None:
    r = BlockRange(0, 6)
    with pytest.raises(AttributeError):
        r.start = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        r.end = 9  # type: ignore[misc]
    with pytest.raises(AttributeError):
        r.extra = 1  # type: ignore[attr-defined]
    assert r == BlockRange(0, 6)


# ---------------------------------------------------------------------------------------------
# TransferLedger
# ---------------------------------------------------------------------------------------------


def test_ledger_attributes() -> None:
    led = TransferLedger(32, 1000, reused_len=700)
    assert led.tokens_per_block == 32
    assert led.prompt_len == 1000
    assert led.reused_len == 700
    assert led.window is None
    assert led.num_blocks == 32
    assert led.prefix_sent is False
    assert led.forward_started is False
    assert led.claimed_blocks == 0
    assert led.is_complete is False
    assert led.missing() == [BlockRange(0, 32)]


def test_ledger_issue_example_early_then_chunks() -> None:
    led = TransferLedger(32, 1000, reused_len=700)
    assert led.send_early() == BlockRange(0, 21)
    assert led.prefix_sent is True
    assert led.claimed_blocks == 21
    assert led.missing() == [BlockRange(21, 32)]
    got = [led.send_chunk(s, e) for s, e in [(700, 828), (828, 956), (956, 1000)]]
    assert got == [BlockRange(21, 25), BlockRange(25, 29), BlockRange(29, 32)]
    assert led.forward_started is True
    assert led.claimed_blocks == 32
    assert led.is_complete is True
    assert led.missing() == []


def test_ledger_chunks_without_reuse() -> None:
    led = TransferLedger(4, 32)
    assert led.send_early() is None  # nothing reused: nothing early
    assert led.prefix_sent is False
    got = [led.send_chunk(s, e) for s, e in [(0, 6), (6, 12), (12, 32)]]
    assert got == [BlockRange(0, 1), BlockRange(1, 3), BlockRange(3, 8)]
    assert led.is_complete


def test_ledger_reuse_12_with_and_without_early() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    assert led.send_chunk(12, 24) == BlockRange(0, 6)
    led = TransferLedger(4, 32, reused_len=12)
    assert led.send_early() == BlockRange(0, 3)
    assert led.send_chunk(12, 24) == BlockRange(3, 6)
    assert led.missing() == [BlockRange(6, 8)]
    assert not led.is_complete


def test_ledger_no_early_after_a_forward() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    assert led.send_chunk(12, 14) == BlockRange(0, 3)
    assert led.forward_started
    assert led.send_early() is None
    assert led.prefix_sent is False
    assert led.claimed_blocks == 3


def test_ledger_sub_block_prefix_has_no_early_slice() -> None:
    led = TransferLedger(32, 100, reused_len=31)
    assert led.send_early() is None
    assert led.prefix_sent is False
    assert led.claimed_blocks == 0


def test_ledger_sliding_window() -> None:
    led = TransferLedger(4, 32, window=16)
    assert led.window == 16
    assert led.num_blocks == 8
    assert led.missing() == [BlockRange(4, 8)]  # only the live window is needed
    assert led.send_early() is None
    assert led.send_chunk(0, 16) is None
    assert led.send_chunk(16, 32) == BlockRange(4, 8)
    assert led.is_complete
    assert led.claimed_blocks == 4


def test_ledger_window_covering_prompt_is_full_attention() -> None:
    led = TransferLedger(4, 32, reused_len=12, window=32)
    assert led.window is None
    assert led.send_early() == BlockRange(0, 3)


def test_ledger_claim_and_missing() -> None:
    led = TransferLedger(4, 32)
    led.claim(BlockRange(2, 4))
    led.claim(BlockRange(6, 7))
    led.claim(BlockRange(5, 5))  # empty claims claim nothing
    assert led.claimed_blocks == 3
    assert led.missing() == [BlockRange(0, 2), BlockRange(4, 6), BlockRange(7, 8)]
    for r in led.missing():
        led.claim(r)
    assert led.is_complete and led.missing() == []
    assert led.claimed_blocks == 8


def test_ledger_claim_past_last_block() -> None:
    led = TransferLedger(4, 30)  # 8 blocks
    with pytest.raises(InvalidArgumentError, match=r"range=\[7, 9\)") as info:
        led.claim(BlockRange(7, 9))
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidArgumentError):
        led.claim(BlockRange(8, 9))
    assert led.claimed_blocks == 0
    led.claim(BlockRange(7, 8))  # the last block itself is fine
    assert led.claimed_blocks == 1


def test_ledger_duplicate_early_send_changes_nothing() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    led.send_early()
    with pytest.raises(DuplicateTransferError) as info:
        led.send_early()
    assert isinstance(info.value, KvFerryError)
    assert not isinstance(info.value, ValueError)
    assert "block 0" in str(info.value)
    assert led.claimed_blocks == 3
    assert led.prefix_sent
    assert led.missing() == [BlockRange(3, 8)]


def test_ledger_duplicate_claim_changes_nothing() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    led.send_early()
    # Overlaps block 2 only; blocks 3 and 4 must not be claimed by the failed call.
    with pytest.raises(DuplicateTransferError, match="block 2"):
        led.claim(BlockRange(2, 5))
    assert led.claimed_blocks == 3
    assert led.missing() == [BlockRange(3, 8)]
    led.claim(BlockRange(3, 5))
    assert led.claimed_blocks == 5


def test_ledger_duplicate_chunk_changes_nothing() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    led.send_early()
    assert led.send_chunk(12, 20) == BlockRange(3, 5)
    with pytest.raises(DuplicateTransferError):
        led.send_chunk(16, 24)  # [4, 6) overlaps block 4
    assert led.claimed_blocks == 5
    assert led.missing() == [BlockRange(5, 8)]
    # A first chunk replayed without the early flag would resend the prefix.
    led2 = TransferLedger(4, 32, reused_len=12)
    led2.send_chunk(12, 16)
    with pytest.raises(DuplicateTransferError):
        led2.send_chunk(12, 16)
    assert led2.claimed_blocks == 4


def test_ledger_non_final_chunk_with_no_block_is_not_an_error_twice() -> None:
    led = TransferLedger(4, 32, reused_len=12)
    led.send_early()
    assert led.send_chunk(13, 15) is None
    assert led.send_chunk(13, 15) is None
    assert led.claimed_blocks == 3
    assert led.forward_started


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((0, 32), {}, "tokens_per_block=0"),
        ((-2, 32), {}, "tokens_per_block=-2"),
        ((4, 0), {}, "prompt_len=0"),
        ((4, -1), {}, "prompt_len=-1"),
        ((4, 32), {"reused_len": -1}, "reused_len=-1"),
        ((4, 32), {"reused_len": 32}, "reused_len=32"),
        ((4, 32), {"reused_len": 40}, "reused_len=40"),
        ((4, 32), {"window": 0}, "window=0"),
        ((4, 32), {"window": -8}, "window=-8"),
    ],
)
def test_ledger_constructor_errors(args: tuple[int, int], kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        TransferLedger(*args, **kwargs)


def test_ledger_refuses_huge_prompt_before_allocating() -> None:
    too_many = (kvferry.MAX_LEDGER_BLOCKS + 1) * 4
    with pytest.raises(InvalidArgumentError, match=f"prompt_len={too_many}"):
        TransferLedger(4, too_many)
    assert TransferLedger(4, kvferry.MAX_LEDGER_BLOCKS * 4).num_blocks == kvferry.MAX_LEDGER_BLOCKS


@pytest.mark.parametrize(
    ("chunk", "needle"),
    [
        ((8, 16), "chunk_start=8"),
        ((12, 12), "chunk_end=12"),
        ((12, 10), "chunk_end=10"),
        ((12, 33), "chunk_end=33"),
        ((32, 33), "chunk_start=32"),
    ],
)
def test_ledger_bad_chunk_changes_nothing(chunk: tuple[int, int], needle: str) -> None:
    led = TransferLedger(4, 32, reused_len=12)
    with pytest.raises(InvalidArgumentError, match=needle):
        led.send_chunk(*chunk)
    assert led.forward_started is False
    assert led.claimed_blocks == 0
    assert led.send_early() == BlockRange(0, 3)  # still eligible: no forward was recorded


def test_ledger_word_boundaries() -> None:
    # 200 blocks span four 64-bit words; claims straddling word edges.
    led = TransferLedger(1, 200)
    led.claim(BlockRange(60, 130))
    assert led.claimed_blocks == 70
    assert led.missing() == [BlockRange(0, 60), BlockRange(130, 200)]
    with pytest.raises(DuplicateTransferError, match="block 129"):
        led.claim(BlockRange(129, 140))
    with pytest.raises(DuplicateTransferError, match="block 60"):
        led.claim(BlockRange(0, 64))
    led.claim(BlockRange(0, 60))
    led.claim(BlockRange(130, 200))
    assert led.is_complete and led.claimed_blocks == 200
