"""KvferryConnector under vllm-router's MoRI-IO WRITE mode (``--kv-connector moriio
--vllm-discovery-address HOST:PORT``): the router sends both legs of a request at once and
puts both servers' registered addresses in their shared ``X-Request-Id``, so the prefill
server knows its decode server when its request arrives and sends as under ``kvferry proxy``
(its prefix-cache hit before its first forward).

What vllm-router 0.1.17 does (vllm_service_discovery.rs, vllm_pd_router.rs; observed with
the installed binary):

```
server --ZMQ DEALER, msgpack {"type": "P"|"D", "http_address": "host:port",
        "zmq_address": <any text>, "transfer_mode": "WRITE"}--> router's ROUTER socket
        (a server is forgotten 5 s after its last registration; the first one sets the mode)
router --prefill leg, X-Request-Id ___prefill_addr_<P zmq>___decode_addr_<D zmq>_<32 hex>,
        max_tokens 1, kv_transfer_params {do_remote_decode: true, transfer_id: "tx-<32 hex>",
        remote_dp_size, remote_tp_size: 1, remote_engine_id/remote_block_ids: null}
       --decode leg, the same X-Request-Id, at the same time, kv_transfer_params
        {do_remote_prefill: true, the same transfer_id, remote_dp_size, remote_tp_size: 1}
```
Neither leg names the other server anywhere but in the X-Request-Id. So a KvferryConnector
decode server registers as its ``zmq_address`` its rendezvous URLs and their signature by the
shared key (`registered_address`: ``<peer_mac>@<url>[,<url>...]``, one URL per tensor-parallel
rank); the prefill request reads them from its request id and connects only when the
signature checks (kvferry.vllm.trust: a client that sends its own X-Request-Id to a prefill
server cannot make it connect anywhere). The transfer is named by ``transfer_id``. The decode
request publishes its destination as a proxy's ``recv`` does; the prefill request looks it up,
waits up to ``admission_wait_s`` for it and sends as a proxy's ``send`` does.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any, Optional

from kvferry import affinity
from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.vllm.config import MAX_TRANSFER_CHARS, ROUTER_KEYS, TRANSFER_ALPHABET, RequestParams

__all__ = ["MORIIO_KEYS", "PING_INTERVAL_S", "Registration", "parse_moriio_params", "registered_address"]

logger = logging.getLogger("kvferry.vllm")

# The keys vllm-router's moriio mode adds to NixlConnector's. ``remote_tp_size`` is always 1
# in 0.1.17 whatever the servers' sizes: kvferry does not read it (a decode server takes its
# prefill servers' size from kv_connector_extra_config prefill_tp_size, as under kvferry proxy).
MORIIO_KEYS = frozenset({"transfer_id", "remote_dp_size", "remote_tp_size", "remote_dp_rank"})
# The router forgets a server 5 s after its last registration (DEFAULT_PING_SECONDS).
PING_INTERVAL_S = 1.0
_TRANSFER_ID = re.compile(rf"[{TRANSFER_ALPHABET}]{{1,{MAX_TRANSFER_CHARS}}}")
# vLLM makes its request id ``cmpl-<X-Request-Id>-<index>-<8 hex>`` (``chatcmpl-<X-Request-Id>-
# <8 hex>``): the decode address runs from the mark to the router's 32-hex uuid.
_DECODE_ADDR = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-[0-9]+)?-[0-9a-f]{8}$")
_HEX = frozenset("0123456789abcdef")


def registered_address(peer: str, peer_mac: str) -> str:
    """A decode server's ``zmq_address``: its rendezvous URLs (``peer``, one per rank,
    separated by spaces) and their signature, in a form the router copies into request ids."""
    return f"{peer_mac}@{','.join(peer.split(' '))}"


def parse_moriio_params(params: Any, request_id: str) -> Optional[RequestParams]:
    """A leg of vllm-router's moriio mode (``transfer_id`` and ``remote_dp_size`` beside
    ``do_remote_decode`` or ``do_remote_prefill`` true), checked: a send to the decode server its request id names,
    or a recv; ``None`` for any other request. `InvalidArgumentError` names what is wrong."""
    if not isinstance(params, Mapping) or "transfer_id" not in params or "remote_dp_size" not in params:
        return None  # mooncake mode sends transfer_id alone: NixlConnector's parse names what it lacks
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if (decode is True) == (prefill is True):
        return None  # neither leg (or both: kvferry.vllm.config.parse_router_params names it)
    transfer = params["transfer_id"]
    if not isinstance(transfer, str) or not _TRANSFER_ID.fullmatch(transfer):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.transfer_id={str(transfer)[:300]!r}: must be 1 to {MAX_TRANSFER_CHARS}"
            f" characters of [{TRANSFER_ALPHABET}] (vllm-router's moriio mode sends tx-<32 hex digits>)"
        )
    dp = params.get("remote_dp_size", 1)
    if dp != 1 or isinstance(dp, bool):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.remote_dp_size={dp!r}: KvferryConnector under vllm-router's moriio mode"
            " serves servers of data parallel size 1 (start the router without --intra-node-data-parallel-size)"
        )
    ignored = tuple(sorted(str(k) for k in params if k not in ROUTER_KEYS | MORIIO_KEYS))
    if prefill is True:
        return RequestParams("recv", transfer, ignored=ignored)
    found = _DECODE_ADDR.search(request_id)
    if found is None:
        raise InvalidArgumentError(
            f"invalid X-Request-Id of request {request_id[:300]!r}: names no decode server (vllm-router's moriio"
            " mode sends ___prefill_addr_<P>___decode_addr_<D>_<32 hex digits>)"
        )
    address = found.group(1)
    mac, at, urls = address.partition("@")
    if not at or len(mac) != 64 or not set(mac) <= _HEX or not urls:
        raise InvalidArgumentError(
            f"invalid X-Request-Id decode address {address[:300]!r}: not a KvferryConnector decode server's"
            " registration (<peer_mac>@<rendezvous URL>[,...]); does the decode server run KvferryConnector with"
            " kv_connector_extra_config router_discovery and http_address?"
        )
    return RequestParams("send", transfer, urls.replace(",", " "), None, mac, ignored=ignored)


class Registration:
    """This server's registration with vllm-router's service discovery, sent every
    ``PING_INTERVAL_S`` from its own thread until `close`.

    ``role`` is "P" or "D"; ``http_address`` (host:port) is where the router sends this
    server's legs; ``zmq_address`` the text the router puts in their request ids. A router
    that is down (or not up yet) misses registrations; the next one after it comes up
    registers the server."""

    def __init__(self, discovery: str, role: str, http_address: str, zmq_address: str) -> None:
        try:
            import msgspec
            import zmq
        except ImportError as err:  # both come with vLLM
            raise KvFerryError(
                f"kv_connector_extra_config router_discovery={discovery!r} needs pyzmq and msgspec (vLLM's"
                f" dependencies): {err}"
            ) from None
        self._zmq = zmq
        self.payload = msgspec.msgpack.encode(
            {"type": role, "http_address": http_address, "zmq_address": zmq_address, "transfer_mode": "WRITE"}
        )
        self._discovery = discovery
        self._stop = threading.Event()
        self._thread = affinity.Thread(target=self._run, name="kvferry-moriio-register", daemon=True)
        self._thread.start()
        logger.info(
            "kvferry: registering with vllm-router at %s as %s %s (moriio WRITE mode)", discovery, role, http_address
        )

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1)  # a router that is away gets the newest registration, not a backlog
        try:
            sock.connect(f"tcp://{self._discovery}")
            while not self._stop.is_set():
                try:
                    sock.send(self.payload, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet: the next interval's registration goes
                self._stop.wait(PING_INTERVAL_S)
        finally:
            sock.close()
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
