"""The exception hierarchy (kvferry/errors.py) and the package's public names."""

from __future__ import annotations
import __future__

import types

import kvferry
import pytest
from kvferry import (
    DuplicateTransferError,
    InvalidArgumentError,
    KvFerryError,
    TransferBook,
    TransferLedger,
    UnknownRequestError,
)


def test_hierarchy() -> None:
    assert issubclass(InvalidArgumentError, KvFerryError)
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(DuplicateTransferError, KvFerryError)
    assert not issubclass(DuplicateTransferError, ValueError)
    assert issubclass(UnknownRequestError, KvFerryError)
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(KvFerryError, Exception)


def test_errors_raised_by_the_core_are_the_python_classes() -> None:
    with pytest.raises(KvFerryError) as info:
        kvferry.BlockRange(-1, 0)
    assert type(info.value) is InvalidArgumentError
    led = TransferLedger(4, 8)
    led.claim(kvferry.BlockRange(0, 1))
    with pytest.raises(KvFerryError) as info:
        led.claim(kvferry.BlockRange(0, 1))
    assert type(info.value) is DuplicateTransferError
    with pytest.raises(KvFerryError) as info:
        TransferBook(4).remove(3)
    assert type(info.value) is UnknownRequestError


def test_unknown_request_message_is_readable() -> None:
    # KeyError would quote its argument; the message must read as a sentence.
    with pytest.raises(UnknownRequestError) as info:
        TransferBook(4).cancel(42)
    assert str(info.value) == "unknown request_id=42: it was never added or was already removed"


def test_invalid_argument_message_names_argument_and_value() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        TransferLedger(0, 8)
    assert str(info.value) == "invalid tokens_per_block=0: must be > 0"


def test_public_names() -> None:
    """``__all__`` is exactly the package's public surface: every public name it binds that is
    not a submodule, each one present. (A name added to the package without a line in
    ``__all__``, or listed there without being bound, fails.)"""
    bound = {n: v for n, v in vars(kvferry).items() if not n.startswith("_") and v is not __future__.annotations}
    public = {n for n, v in bound.items() if not isinstance(v, types.ModuleType)}
    assert set(kvferry.__all__) == public | {"__version__"}
    assert len(kvferry.__all__) == len(set(kvferry.__all__))
    for name in kvferry.__all__:
        assert hasattr(kvferry, name), name
    errors = {
        n
        for n in kvferry.__all__
        if isinstance(getattr(kvferry, n), type) and issubclass(getattr(kvferry, n), BaseException)
    }
    assert errors == {
        "DuplicateTransferError",
        "InvalidArgumentError",
        "KvFerryError",
        "MissingDependencyError",
        "UnknownRequestError",
    }
    assert kvferry.MAX_LEDGER_BLOCKS == 1 << 24


def test_keyword_only_arguments() -> None:
    with pytest.raises(TypeError):
        kvferry.chunk_blocks(4, 32, 12, 24, 12)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TransferLedger(4, 32, 12)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TransferBook(4, False)  # type: ignore[misc]
    with pytest.raises(TypeError):
        kvferry.select_early(4, [8], [True], [False], [True])  # type: ignore[misc]
    book = TransferBook(4)
    with pytest.raises(TypeError):
        book.add(1, 32, 12)  # type: ignore[misc]
    assert 1 not in book
