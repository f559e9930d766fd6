"""Attacks on the control plane from raw sockets, against real endpoints: each attack, then a
legitimate transfer that must arrive bit exact, with the endpoint's threads and descriptors
back to what they were and nothing of kvferry's left in /dev/shm (docs/security.md)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from typing import Iterator

import pytest
import torch

from kvferry.errors import TransferError
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import wire
from kvferry.transports.shm import SharedPool, ShmEndpoint, ShmTransport

from test_faults import LAYERS, SHAPE, SLACK, TPB, random_pool, until


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvferry-")}


@contextlib.contextmanager
def rig(address: str) -> Iterator[tuple[KVReceiver, ShmEndpoint, bytes]]:
    shared = SharedPool.create(num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    assert shared.pool is not None
    receiver = KVReceiver(shared.pool)
    authkey = secrets.token_bytes(32)
    endpoint = ShmEndpoint(receiver, shared, authkey=authkey, address=address)
    try:
        yield receiver, endpoint, authkey
    finally:
        endpoint.close()
        del receiver
        shared.close()


def transfer_bit_exact(receiver: KVReceiver, endpoint: ShmEndpoint, authkey: bytes, rid: int) -> None:
    """A legitimate sender moves a request's blocks; they arrive bit exact."""
    src = random_pool(rid)
    sender = KVSender(src, ShmTransport(endpoint.address, authkey=authkey))
    try:
        dst = [5, 9, 2, 11]
        epoch = receiver.expect(rid, 4 * TPB)
        sender.add(rid, 4 * TPB, reused_len=0, epoch=epoch)
        sender.send_chunks([rid], [0], [4 * TPB], [list(range(4))], [dst])
        sender.flush(timeout=SLACK)
        receiver.wait(rid, timeout=SLACK)
        for layer_src, layer_dst in zip(src.layers, receiver.pool.layers):
            assert torch.equal(layer_src[:4], layer_dst[dst])
        receiver.release(rid)
        sender.remove(rid)
    finally:
        sender.close()


class Relay:
    """A TCP forwarder: whoever is told its address reaches ``target`` through it. Keeps what
    the target sent, to show what the relay's owner could read."""

    def __init__(self, target: wire.Address) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.from_target = bytearray()
        self.relayed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = wire.connect(self.target, SLACK)
        self.relayed.set()

        def pipe(a: socket.socket, b: socket.socket, keep: bool) -> None:
            try:
                while data := a.recv(65536):
                    if keep:
                        self.from_target.extend(data)
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        self._threads = [
            threading.Thread(target=pipe, args=(client, upstream, False), daemon=True),
            threading.Thread(target=pipe, args=(upstream, client, True), daemon=True),
        ]
        for t in self._threads:
            t.start()
        for t in self._threads:
            t.join(SLACK)
        client.close()
        upstream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(SLACK)


def test_a_relayed_handshake_to_an_endpoint_fails() -> None:
    """A sender told a relay's address (as a forged kv_transfer_params.kvferry.peer would tell
    a prefill server) reaches a real endpoint through it: the handshake fails on both sides,
    the relay never sees the hello (the segment name), and a direct sender is served."""
    with rig("tcp://127.0.0.1:0") as (receiver, endpoint, authkey):
        segment = endpoint._hello["segment"]["name"]  # noqa: SLF001
        before_errors = endpoint.error_count
        relay = Relay(wire.parse_address(endpoint.address))
        try:
            with pytest.raises(TransferError, match="cannot reach the receiver"):
                ShmTransport(relay.address, authkey=authkey)
            assert relay.relayed.is_set()
        finally:
            relay.close()
        assert segment.encode() not in relay.from_target
        assert until(lambda: endpoint.error_count > before_errors)
        assert "meant another endpoint" in str(endpoint.errors[-1])
        transfer_bit_exact(receiver, endpoint, authkey, 1)
