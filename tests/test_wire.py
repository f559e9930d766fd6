"""The control channel: addresses (unix://, tcp:// over IPv4 and IPv6), the handshake, and
the frame codec's refusals at a live endpoint."""

from __future__ import annotations

import contextlib
import re
import secrets
import socket
from typing import Iterator

import numpy as np
import pytest
import torch

from kvferry.errors import InvalidArgumentError
from kvferry.notice import Notice
from kvferry.receiver import KVReceiver
from kvferry.transports import wire
from kvferry.transports.shm import SharedPool, ShmEndpoint, ShmTransport

from test_faults import LAYERS, SHAPE, SLACK, TPB, random_pool


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def shm_rig(address: str = "unix://", **options: object) -> Iterator[tuple[KVReceiver, ShmEndpoint, bytes]]:
    shared = SharedPool.create(num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    assert shared.pool is not None
    receiver = KVReceiver(shared.pool)
    authkey = secrets.token_bytes(32)
    endpoint = ShmEndpoint(receiver, shared, authkey=authkey, address=address, **options)  # type: ignore[arg-type]
    try:
        yield receiver, endpoint, authkey
    finally:
        endpoint.close()
        del receiver
        shared.close()


@pytest.mark.parametrize(
    "listen, host",
    [
        ("tcp://127.0.0.1:0", "127.0.0.1"),
        pytest.param("tcp://[::1]:0", "[::1]", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")),
        ("unix://", None),
    ],
)
def test_a_transfer_over_each_address_family(listen: str, host: str | None) -> None:
    """The endpoint advertises the host it bound and the port it got; a sender connecting
    to that URL is served end to end (the blocks land, the request completes)."""
    from kvferry.sender import KVSender

    with shm_rig(listen) as (receiver, endpoint, authkey):
        if host is None:
            assert endpoint.address.startswith("unix:///") and endpoint.address.endswith("/notices.sock")
        else:
            prefix = f"tcp://{host}:"
            assert endpoint.address.startswith(prefix) and 0 < int(endpoint.address[len(prefix) :]) < 65536
        src = random_pool(7)
        transport = ShmTransport(endpoint.address, authkey=authkey)
        assert endpoint.address in transport.peer
        sender = KVSender(src, transport)
        dst = [5, 9, 2, 11]
        epoch = receiver.expect(1, 16)
        sender.add(1, 16, reused_len=0, epoch=epoch)
        sender.send_chunks([1], [0], [16], [list(range(4))], [dst])
        sender.flush(timeout=SLACK)
        receiver.wait(1, timeout=SLACK)
        for layer_src, layer_dst in zip(src.layers, receiver.pool.layers):
            assert torch.equal(layer_src[:4], layer_dst[dst])
        receiver.release(1)
        sender.remove(1)
        sender.close()


def test_a_wildcard_bind_advertises_the_host_it_is_told() -> None:
    with pytest.raises(InvalidArgumentError, match=r"invalid address='tcp://0.0.0.0:0': a wildcard bind needs advertise="):
        with shm_rig("tcp://0.0.0.0:0"):
            pass
    with shm_rig("tcp://0.0.0.0:0", advertise="127.0.0.1") as (receiver, endpoint, authkey):
        assert endpoint.address.startswith("tcp://127.0.0.1:")
        transport = ShmTransport(endpoint.address, authkey=authkey)
        receiver.expect(1, 8)
        transport.post([Notice(1, 0, 0, 2, True)])
        receiver.wait(1, timeout=SLACK)
        transport.close()


@pytest.mark.parametrize(
    "text, why",
    [
        ("/tmp/x.sock", "expected unix:///path or tcp://host:port"),
        ("unix://relative.sock", "absolute path"),
        ("tcp://host", "expected tcp://host:port"),
        ("tcp://::1:5", "IPv6 in brackets"),
        ("tcp://[127.0.0.1]:5", "not an IPv6 address"),
        ("tcp://[::1]5", "written tcp://"),
        ("tcp://h:70000", r"port must be a number in \[0, 65535\]"),
        ("tcp://h:-1", "port must be a number"),
        ("tcp://:5", "expected tcp://host:port"),
        ("http://h:5", "expected unix:///path or tcp://host:port"),
    ],
)
def test_bad_addresses_are_refused_by_name(text: str, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"invalid address={re.escape(repr(text))}: .*{why}"):
        wire.parse_address(text)
    with pytest.raises(InvalidArgumentError, match=f"invalid address={re.escape(repr(text))}"):
        ShmTransport(text, authkey=secrets.token_bytes(32))


def test_address_round_trips() -> None:
    for text in ("unix:///run/k.sock", "tcp://10.0.0.5:7000", "tcp://[fe80::1]:0", "tcp://node-3.example:443"):
        assert wire.parse_address(text).url() == text


def test_bad_handshake_timeout_is_refused() -> None:
    for bad in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(InvalidArgumentError, match="invalid handshake_timeout="):
            with shm_rig(handshake_timeout=bad):
                pass
