"""The shared test helpers' leak check (tests/helpers.py): each leak it is meant to find, it
finds and names; once the leak is given back, it passes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from helpers import POOLS, assert_nothing_leased, in_process_pair, open_fds, serve, tables
from kvferry.sender import KVSender
from kvferry.transports.shm import SharedPool, ShmTransport
from kvferry.transports.staging import StagingTransport


def test_a_request_still_expected_is_a_leak_until_released() -> None:
    sender, receiver = in_process_pair()
    receiver.expect(7, 8)
    with pytest.raises(AssertionError, match=r"the receiver still holds requests \{7: 'PENDING'\}"):
        assert_nothing_leased(receiver)
    receiver.release_unfenced(7)
    assert_nothing_leased(receiver)
    sender.close()


def test_a_request_registered_at_the_sender_is_a_leak_until_removed() -> None:
    sender, receiver = in_process_pair()
    epoch = receiver.expect(3, 8)
    sender.add(3, 8, epoch=epoch)
    with pytest.raises(AssertionError, match=r"the sender still holds requests \{3: .*source blocks leased: \[3\]"):
        assert_nothing_leased(receiver, sender=sender)
    sender.send_early(np.array([3]), tables([0, 1]), tables([4, 5]))
    sender.send_chunks(np.array([3]), np.array([0]), np.array([8]), tables([0, 1]), tables([4, 5]))
    sender.flush()
    receiver.wait(3, timeout=0)
    sender.remove(3)
    receiver.release(3, timeout=0)
    assert_nothing_leased(receiver, sender=sender)
    sender.close()


def test_a_connected_sender_and_its_staging_ring_are_leaks_until_it_closes() -> None:
    served = serve("staging")
    try:
        transport = StagingTransport(served.endpoint.address, authkey=served.authkey)
        assert served.endpoint.ring_names() == [transport.ring_name]  # type: ignore[attr-defined]
        with pytest.raises(AssertionError, match="still connected.*still holds rings"):
            assert_nothing_leased(served.receiver, endpoint=served.endpoint, timeout=0.05)
        transport.close()
        assert_nothing_leased(served.receiver, endpoint=served.endpoint)
    finally:
        served.close()


def test_staging_slots_the_receiver_never_freed_are_a_leak() -> None:
    served = serve("staging")
    try:
        sender = KVSender(POOLS.random(0), StagingTransport(served.endpoint.address, authkey=served.authkey))
        sender.transport._reserve(2)  # type: ignore[attr-defined]  # noqa: SLF001  (slots taken, no batch posted)
        with pytest.raises(AssertionError, match="the sender's staging ring still has 2 slots in use"):
            assert_nothing_leased(sender=sender, timeout=0.05)
        sender.close()
    finally:
        served.close()


def test_a_thread_a_descriptor_and_a_segment_left_are_leaks() -> None:
    before = set(threading.enumerate())
    fds = open_fds()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="kvferry-test-leak")
    thread.start()
    read, write = os.pipe()
    leaked = SharedPool.create(
        num_layers=POOLS.layers, shape=POOLS.shape, dtype=torch.float32, tokens_per_block=POOLS.tpb
    )
    segment = leaked.descriptor["name"]  # a pool whose name nobody removed
    try:
        with pytest.raises(AssertionError) as info:
            assert_nothing_leased(threads=before, fds=fds, segments=[segment], timeout=0.05)
        message = str(info.value)
        assert "kvferry-test-leak" in message and "descriptors more open" in message and segment in message
    finally:
        stop.set()
        thread.join()
        os.close(read)
        os.close(write)
        leaked.close()
    assert_nothing_leased(threads=before, fds=fds, segments=[segment])


def test_the_leak_check_passes_after_a_transfer_over_shared_memory() -> None:
    """The control: a whole transfer over a real socket leaves nothing behind."""
    before = set(threading.enumerate())
    served = serve("shm")
    sender = KVSender(POOLS.random(0), ShmTransport(served.endpoint.address, authkey=served.authkey))
    epoch = served.receiver.expect(1, 3 * POOLS.tpb)
    sender.add(1, 3 * POOLS.tpb, epoch=epoch)
    sender.send_early(np.array([1]), tables([0, 1, 2]), tables([9, 8, 7]))
    sender.send_chunks(np.array([1]), np.array([0]), np.array([3 * POOLS.tpb]), tables([0, 1, 2]), tables([9, 8, 7]))
    sender.flush()
    served.receiver.wait(1, timeout=30)
    sender.remove(1)
    served.receiver.release(1, timeout=0)
    assert_nothing_leased(served.receiver, sender=sender)
    sender.close()
    assert_nothing_leased(served.receiver, endpoint=served.endpoint)
    served.close()
    assert_nothing_leased(threads=before)


def test_wait_until_takes_a_look_that_timed_out_for_not_yet() -> None:
    from vllm_harness import wait_until

    looks = iter([TimeoutError("slow /metrics"), ConnectionResetError("restarting"), True])

    def predicate() -> bool:
        look = next(looks)
        if isinstance(look, BaseException):
            raise look
        return look

    wait_until(predicate, "the third look", timeout_s=60)
    with pytest.raises(StopIteration):
        next(looks)  # it took all three looks

    def never() -> bool:
        raise TimeoutError("slow /metrics")

    with pytest.raises(AssertionError, match=r"timed out after 0 s waiting for x \(the last look failed: Timeout"):
        wait_until(never, "x", timeout_s=0)

    def broken() -> bool:
        raise ValueError("a malformed metric")

    with pytest.raises(ValueError, match="malformed"):  # anything else is not a slow look: raised
        wait_until(broken, "x", timeout_s=60)
