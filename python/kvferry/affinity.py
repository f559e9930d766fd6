"""Which CPU cores kvferry's own threads run on.

Left alone, every thread kvferry starts inherits the CPU mask of the thread that started it:
inside an engine pinned to one core, the transfer's threads (the sender's announcer, the copy
engine, the control plane, NIXL's UCX progress thread and the kernel's TCP work it drives)
then take time from the forward on that same core. `set_transfer_cores` names other cores
for them; every thread kvferry starts afterwards runs there, and so do the threads a NIXL
agent starts (its agent is made under `on_transfer_cores`). The engine's own threads keep
their mask. Linux only (``os.sched_setaffinity``); elsewhere a set of cores is refused.

The vLLM connector sets it from ``kv_connector_extra_config`` ``transfer_cores``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Optional, Sequence

from kvferry.errors import InvalidArgumentError

__all__ = ["Thread", "on_transfer_cores", "pin_current_thread", "set_transfer_cores", "transfer_cores"]

_cores: Optional[frozenset[int]] = None  # one assignment replaces it: no lock needed


def check_cores(cores: Any, argument: str = "transfer_cores") -> Optional[frozenset[int]]:
    """``cores`` as a set of CPU ids this machine has, or None for "inherit" (None or an
    empty list). Refuses anything else by name and value."""
    if cores is None:
        return None
    if isinstance(cores, (str, bytes)) or not isinstance(cores, (list, tuple, set, frozenset)):
        raise InvalidArgumentError(f"invalid {argument}={cores!r}: must be a list of CPU ids (integers)")
    if not cores:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise InvalidArgumentError(f"invalid {argument}={cores!r}: this platform cannot pin threads to cores")
    count = os.cpu_count() or 1
    for core in cores:
        if isinstance(core, bool) or not isinstance(core, int) or not 0 <= core < count:
            raise InvalidArgumentError(
                f"invalid {argument}={list(cores)!r}: {core!r} is not a CPU id of this machine (0 to {count - 1})"
            )
    return frozenset(cores)


def set_transfer_cores(cores: Optional[Sequence[int]]) -> None:
    """Threads kvferry starts from now on run on ``cores`` (None or empty: where their
    starter runs). Checks the cores can be used by pinning the calling thread to them for a
    moment (an id outside this process's cpuset is refused by name)."""
    checked = check_cores(cores)
    if checked is not None:
        with _pinned(checked):
            pass
    global _cores
    _cores = checked


def transfer_cores() -> Optional[frozenset[int]]:
    return _cores


def pin_current_thread() -> None:
    """Pins the calling thread to the transfer cores, if any are set (a ThreadPoolExecutor's
    ``initializer``; `Thread` calls it first thing)."""
    cores = _cores
    if cores is not None:
        os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def _pinned(cores: frozenset[int]) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError as err:
        raise InvalidArgumentError(
            f"invalid transfer_cores={sorted(cores)!r}: this process may not run there ({err})"
        ) from err
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def on_transfer_cores() -> Iterator[None]:
    """Runs the body with the calling thread on the transfer cores (and back after), so that
    threads started inside it by native code (a NIXL agent's progress thread) inherit them."""
    cores = _cores
    if cores is None:
        yield
        return
    with _pinned(cores):
        yield


class Thread(threading.Thread):
    """A `threading.Thread` that runs on the transfer cores (`set_transfer_cores`)."""

    def run(self) -> None:
        pin_current_thread()
        super().run()
