"""The vLLM connector's control plane under attack, without an engine: which decode servers a
prefill server connects to (kvferry.vllm.trust), and the rendezvous behind a relay. The real
prefill server refusing forged peers is in test_vllm_connector (its engines are shared)."""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not importable: run in the vLLM venv, see docs/vllm.md")

sys.path.insert(0, os.path.dirname(__file__))


def test_only_trusted_or_signed_peers_pass() -> None:
    from kvferry.errors import InvalidArgumentError
    from kvferry.vllm import trust
    from kvferry.vllm.config import ConnectorConfig, parse_params

    key = secrets.token_bytes(32)
    peer = "tcp://127.0.0.1:7000"
    mac = trust.sign_peer(key, peer)
    assert trust.check_peer(key, (), peer, mac) == peer
    assert trust.check_peer(key, (), "tcp://:7000", mac) == peer  # one URL, canonical form
    for url, sig, why in [
        (peer, None, "it has no peer_mac"),
        (peer, trust.sign_peer(secrets.token_bytes(32), peer), "does not match"),
        ("tcp://127.0.0.1:7001", mac, "does not match"),
        (None, None, "no kv_transfer_params.kvferry.peer"),
    ]:
        with pytest.raises(trust.UntrustedPeerError, match=why):
            trust.check_peer(key, (), url, sig)
    config = ConnectorConfig.from_extra({"trusted_peers": ["tcp://:7002", "unix:///run/r.sock"]})
    assert config.trusted_peers == ("tcp://127.0.0.1:7002", "unix:///run/r.sock")
    assert trust.check_peer(key, config.trusted_peers, "tcp://127.0.0.1:7002", None) == "tcp://127.0.0.1:7002"
    bad_lists = [("tcp://x:1", "trusted_peers="), (["http://x"], r"trusted_peers\[0\]"), ([5], r"trusted_peers\[0\]")]
    for bad, named in bad_lists:
        with pytest.raises((InvalidArgumentError, TypeError), match=named):
            ConnectorConfig.from_extra({"trusted_peers": bad})
    assert parse_params({"kvferry": {"op": "send", "transfer": "t", "peer": peer, "peer_mac": mac}}).peer_mac == mac
    for params, named in [
        ({"op": "send", "transfer": "t", "peer": peer, "peer_mac": "zz"}, "peer_mac='zz'"),
        ({"op": "send", "transfer": "t", "peer": peer, "peer_mac": 5}, "peer_mac='5'"),
        ({"op": "recv", "transfer": "t", "peer_mac": mac}, "only a send names a peer"),
    ]:
        with pytest.raises(InvalidArgumentError, match=named):
            parse_params({"kvferry": params})


def test_a_relayed_handshake_to_a_rendezvous_fails() -> None:
    """A forwarder in front of a decode server's rendezvous: the lookup never reaches it (the
    rendezvous records no lookup, so nothing was taken) and the relay reads no destination."""
    from kvferry.errors import TransferError
    from kvferry.transports import wire
    from kvferry.vllm import rendezvous
    from test_attacks import Relay

    key = secrets.token_bytes(32)
    server = rendezvous.Rendezvous(key, lambda sender: "staging+unix:///x", listen="tcp://127.0.0.1:0")
    relay = Relay(wire.parse_address(server.address))
    try:
        with pytest.raises(TransferError, match="authentication failed"):
            rendezvous.lookup(relay.address, key, "t1", 0, "engine-0")
        assert relay.relayed.is_set() and b"destination" not in relay.from_target
        assert server.taker("t1") is None
    finally:
        relay.close()
        server.close()


def test_a_key_file_that_is_a_fifo_is_refused_at_once(tmp_path: object) -> None:
    """A FIFO named as the key file: refused by name instead of blocking the server's start
    forever (reading one blocks until a writer comes)."""
    import pathlib
    import threading

    from kvferry.errors import InvalidArgumentError
    from kvferry.vllm.config import load_authkey

    fifo = pathlib.Path(str(tmp_path)) / "authkey"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            load_authkey(str(fifo))
        except BaseException as err:  # noqa: BLE001  (the test looks at it)
            outcome.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # the old code: stuck in open(); a writer lets it go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not thread.is_alive() and len(outcome) == 1, "load_authkey blocked on a FIFO"
    assert isinstance(outcome[0], InvalidArgumentError) and "not a regular file" in str(outcome[0])
