"""Where kvferry's own threads run (kvferry.affinity): the transfer cores a serving engineer
names keep the transfer's work (the sender's announcer, copy threads, NIXL's progress
thread) off the cores the engine computes on, and a sender with ``handoff`` starts every
write on its announcer, so not even the first bytes of a write leave from the engine's
thread. Each placement is read back from the kernel (``sched_getaffinity``, /proc)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from helpers import TRANSFER_POOLS as POOLS
from helpers import assert_nothing_leased
from kvferry import affinity
from kvferry.errors import InvalidArgumentError
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.base import Write
from kvferry.transports.inprocess import InProcessTransport

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores to tell placements apart")


@pytest.fixture
def engine_core() -> Iterator[tuple[int, int]]:
    """The test thread pinned to one core (the "engine's"), the transfer cores set to
    another; both put back afterwards."""
    before = os.sched_getaffinity(0)
    engine, transfer = CORES[0], CORES[-1]
    os.sched_setaffinity(0, {engine})
    affinity.set_transfer_cores([transfer])
    try:
        yield engine, transfer
    finally:
        affinity.set_transfer_cores(None)
        os.sched_setaffinity(0, before)


def _mask_of(call: Any) -> set[int]:
    """The CPU mask of a thread started (by ``call``) and read from inside it."""
    seen: list[set[int]] = []
    thread = call(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


@needs_two_cores
def test_kvferry_threads_run_on_the_transfer_cores_and_the_engine_keeps_its_own(engine_core: Any) -> None:
    engine, transfer = engine_core
    assert _mask_of(affinity.Thread) == {transfer}
    assert _mask_of(threading.Thread) == {engine}  # not kvferry's: inherits the starter's
    with affinity.on_transfer_cores():  # what native code starts inside inherits them
        assert os.sched_getaffinity(0) == {transfer}
        assert _mask_of(threading.Thread) == {transfer}
    assert os.sched_getaffinity(0) == {engine}
    affinity.set_transfer_cores(None)
    assert _mask_of(affinity.Thread) == {engine}  # unset: where the starter runs
    with affinity.on_transfer_cores():
        assert os.sched_getaffinity(0) == {engine}


class _Recording(InProcessTransport):
    """An in-process transport noting the thread and CPU mask each write was handed over on."""

    def __init__(self, receiver: KVReceiver) -> None:
        super().__init__(receiver)
        self.handed: list[tuple[str, frozenset[int]]] = []

    def write(self, engine: Any, job: Write) -> Any:
        self.handed.append((threading.current_thread().name, frozenset(os.sched_getaffinity(0))))
        return super().write(engine, job)


@needs_two_cores
def test_a_handoff_sender_starts_every_write_on_its_announcer_on_the_transfer_cores(engine_core: Any) -> None:
    _, transfer = engine_core
    src, dst = POOLS.random(3), POOLS.nan()
    receiver = KVReceiver(dst)
    transport = _Recording(receiver)
    transport.max_write_blocks = 2  # several writes per call
    sender = KVSender(src, transport, handoff=True)
    try:
        for rid in (1, 2):
            receiver.expect(rid, 40)
            sender.add(rid, 40, reused_len=24)
        table = np.arange(20).reshape(2, 10)
        sender.send_early([1, 2], table, table)
        sender.send_chunks([1, 2], [24, 24], [40, 40], table, table)
        sender.flush(timeout=60)
        for rid in (1, 2):
            assert receiver.wait(rid, timeout=60)
            assert sender.remove(rid).is_complete
        ids = table.ravel()
        for layer_src, layer_dst in zip(src.layers, dst.layers):
            assert (layer_dst[ids] == layer_src[ids]).all()
        assert len(transport.handed) == 20 // 2
        assert set(transport.handed) == {("kvferry-sender-progress", frozenset({transfer}))}
        assert_nothing_leased(sender=sender)
    finally:
        sender.close()


class _Costly(_Recording):
    """A transport whose submission costs its caller (`Transport.costly_submit`, as NIXL's)."""

    costly_submit = True


def test_handoff_by_default_only_for_cuda_pools_over_a_costly_transport() -> None:
    """With CUDA pools, a write handed to NIXL would hold the engine's thread before its
    forward (590 ms for a 4 GiB early send of scattered blocks on an H200): such a sender
    hands its writes to its announcer unless told otherwise. With CPU pools, or a cheap
    transport, or no announcer, nothing moves; an explicit ``handoff`` always wins."""
    from kvferry.sender import default_handoff
    from kvferry.transports.nixl import NixlTransport

    assert NixlTransport.costly_submit and not InProcessTransport.costly_submit
    costly, cheap = _Costly(KVReceiver(POOLS.nan())), InProcessTransport(KVReceiver(POOLS.nan()))
    assert default_handoff("cuda", costly, True)
    assert not default_handoff("cuda", costly, False)
    assert not default_handoff("cuda", cheap, True)
    assert not default_handoff("cpu", costly, True)
    for handoff, want in ((None, False), (True, True), (False, False)):
        sender = KVSender(POOLS.random(0), _Costly(KVReceiver(POOLS.nan())), handoff=handoff)
        try:
            assert sender.handoff is want, handoff
        finally:
            sender.close()


@pytest.mark.cuda
def test_a_cuda_sender_over_a_costly_transport_submits_from_its_announcer() -> None:
    """CUDA pools and a costly transport, no ``handoff`` given: every write of an early send
    and a chunk is handed over on the announcer's thread, never the caller's, and lands bit
    exact."""
    src, dst = POOLS.random(3, "cuda"), POOLS.nan("cuda")
    receiver = KVReceiver(dst)
    transport = _Costly(receiver)
    sender = KVSender(src, transport)
    try:
        assert sender.handoff
        receiver.expect(1, 40)
        sender.add(1, 40, reused_len=24)
        table = np.arange(10).reshape(1, 10)
        sender.send_early([1], table, table)
        sender.send_chunks([1], [24], [40], table, table)
        sender.flush(timeout=60)
        assert receiver.wait(1, timeout=60)
        assert sender.remove(1).is_complete
        for layer_src, layer_dst in zip(src.layers, dst.layers):
            assert (layer_dst[:10] == layer_src[:10]).all()
        assert transport.handed and {name for name, _ in transport.handed} == {"kvferry-sender-progress"}
        assert_nothing_leased(sender=sender)
    finally:
        sender.close()


def test_a_handoff_needs_the_announcer() -> None:
    with pytest.raises(InvalidArgumentError, match=r"handoff=True with progress=False"):
        KVSender(POOLS.random(0), InProcessTransport(KVReceiver(POOLS.nan())), handoff=True, progress=False)


@pytest.mark.parametrize(
    "cores, named",
    [
        ("1", r"transfer_cores='1': must be a list of CPU ids"),
        (3, r"transfer_cores=3: must be a list"),
        ([-1], r"-1 is not a CPU id of this machine"),
        ([1 << 20], r"1048576 is not a CPU id"),
        ([True], r"True is not a CPU id"),
        ([0.5], r"0.5 is not a CPU id"),
    ],
)
def test_transfer_cores_that_cannot_be_are_refused_by_name(cores: Any, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        affinity.set_transfer_cores(cores)
    assert affinity.transfer_cores() is None


def _native_threads() -> dict[int, str]:
    """This process's threads: id -> the CPUs the kernel lets it run on."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


@needs_two_cores
def test_a_nixl_agents_own_threads_start_on_the_transfer_cores(engine_core: Any) -> None:
    pytest.importorskip("nixl._api")
    from kvferry.transports import nixl_hub

    engine, transfer = engine_core
    before = _native_threads()
    agent = nixl_hub._agent("tx")  # UCX's progress thread starts here, in native code
    try:
        started = {tid: cpus for tid, cpus in _native_threads().items() if tid not in before}
        assert started, "the agent started no thread"
        assert set(started.values()) == {str(transfer)}
        assert os.sched_getaffinity(0) == {engine}
    finally:
        del agent
