"""Which decode servers a prefill server connects to.

A prefill request names its decode server's rendezvous in ``kv_transfer_params.kvferry.peer``,
which arrives in an HTTP body: anyone who can POST to the prefill server's port writes it.
Connecting wherever it says would make the prefill server a tool for reaching internal
addresses (server-side request forgery). So a prefill server connects only to a peer that is

- in its ``kv_connector_extra_config`` ``trusted_peers`` (a list of rendezvous URLs), or
- signed: ``peer_mac`` is HMAC-SHA256(key, label | peer) in hex, made by a holder of the
  control channel's key. The decode server signs its own rendezvous URL in its ``hello``
  answer, and the proxy passes ``peer`` and ``peer_mac`` on together, so the default flow
  needs no configuration. A signature vouches for one exact URL (canonical form); an HTTP
  client can replay a decode server's signed URL, which only sends the prefill server to that
  real decode server, never name an address of its own.

The check runs before any connection is opened. The handshake's channel binding
(kvferry.transports.wire) is the second line: even a connection to a forwarder that relays to
a real endpoint fails its handshake, and learns nothing.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Optional, Sequence

from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.transports import wire

__all__ = ["UntrustedPeerError", "check_peer", "check_trusted_peers", "sign_peer"]

LABEL = b"kvferry-peer-v1\0"
MAX_TRUSTED = 4096


class UntrustedPeerError(KvFerryError):
    """A prefill request named a decode server this server does not trust: nothing was opened."""


def _canonical(peer: str, name: str) -> str:
    """A rendezvous URL in canonical form; a tensor-parallel decode server's ``peer`` is one
    URL per rank, separated by spaces (kvferry.vllm.scheduler), each made canonical."""
    parts = peer.split(" ") if isinstance(peer, str) else [peer]
    return " ".join(wire.parse_address(part, name).url() for part in parts)


def sign_peer(authkey: bytes, peer: str) -> str:
    """The ``peer_mac`` of a rendezvous URL: what a decode server puts in its hello answer."""
    url = _canonical(peer, "peer")
    return hmac.new(authkey, LABEL + url.encode(), hashlib.sha256).hexdigest()


def check_trusted_peers(value: Any) -> tuple[str, ...]:
    """``kv_connector_extra_config`` ``trusted_peers``: a list of rendezvous URLs (unix:///path or
    tcp://host:port), kept in canonical form."""
    if not isinstance(value, (list, tuple)) or isinstance(value, str) or len(value) > MAX_TRUSTED:
        raise InvalidArgumentError(
            f"invalid kv_connector_extra_config trusted_peers={str(value)[:200]!r}:"
            f" must be a list of at most {MAX_TRUSTED} rendezvous URLs"
        )
    urls = []
    for i, peer in enumerate(value):
        urls.append(_canonical(peer, f"kv_connector_extra_config trusted_peers[{i}]"))
    return tuple(urls)


def check_peer(authkey: bytes, trusted: Sequence[str], peer: Optional[str], peer_mac: Optional[str]) -> str:
    """The canonical URL of ``peer`` when this server may connect to it; else raises
    `UntrustedPeerError` (the peer's text is the client's own, so it may be named)."""
    if peer is None:
        raise UntrustedPeerError("no kv_transfer_params.kvferry.peer: a send names its decode server's rendezvous")
    url = _canonical(peer, "kv_transfer_params.kvferry.peer")
    if all(part in trusted for part in url.split(" ")):  # every rank's rendezvous listed
        return url
    if peer_mac is not None and hmac.compare_digest(peer_mac, sign_peer(authkey, url)):
        return url
    why = "it has no peer_mac"
    if peer_mac is not None:
        why = "its peer_mac does not match (not signed with this server's key)"
    raise UntrustedPeerError(
        f"invalid kv_transfer_params.kvferry.peer={peer[:200]!r}: not a trusted decode server ({why});"
        " pass peer and peer_mac from the decode server's hello answer,"
        " or list it in kv_connector_extra_config trusted_peers"
    )
