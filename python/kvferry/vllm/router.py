"""KvferryConnector under the routers serving teams run: NixlConnector's ``kv_transfer_params``
protocol (vLLM's toy proxy, vllm-router, llm-d's nixlv2 sidecar), on kvferry's push.

Such a router sends the prefill leg ``do_remote_decode: true`` and nothing about the decode
server; the decode leg gets ``do_remote_prefill: true`` and the prefill server's address
(from the prefill's answer, or, once that answer said ``transfer_mode: "push"``, from the
router's cache of it while both legs run at once). So the decode server tells the prefill
server where its blocks go, and the prefill server pushes as under ``kvferry proxy``:

```
router --prefill leg (X-Request-Id K)--> prefill: computes; answers remote_host/port (its
                                         offer rendezvous), remote_engine_id (signed),
                                         remote_request_id K, tp_size, transfer_mode push
router --decode leg (those params)-----> decode: allocates, publishes K at its rendezvous,
                                         offers K to remote_host:remote_port
prefill: the offer starts K's lookup; its blocks are sent (early, if the offer came before
         the prompt's first forward; else late, once computed)
```
With vllm-router's push path both legs carry the same ``X-Request-Id``, so the prefill
request's transfer id (``router_key``) is known when it arrives, and it waits up to
``admission_wait_s`` for the offer before it computes: the prefix-cache hit then leaves
before the first forward. A router that waits for the prefill's answer before it sends the
decode leg gets the post-prefill push only.

`OfferBook` is the prefill scheduler's half: a rendezvous that takes offers only (started
with the first router request), and the table matching offers with requests, whichever
comes first. `offer_async` is the decode scheduler's: the offer, on its rendezvous client (no thread, no wait); one
that fails abandons the transfer at the decode server's own rendezvous, so the decode
request fails (or recomputes, by ``kv_load_failure_policy``) at once, never at its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Generic, Optional, TypeVar

from kvferry.errors import KvFerryError
from kvferry.transports import wire
from kvferry.vllm import rendezvous, trust
from kvferry.vllm.client import Client
from kvferry.vllm.config import ROUTER_KEYS, ConnectorConfig

__all__ = ["MAX_OFFERS", "PLAIN_KEYS", "OfferBook", "answer", "offer_async", "offer_listen_address"]

logger = logging.getLogger("kvferry.vllm")

# Offers kept for prefill requests that have not arrived yet (oldest dropped first).
MAX_OFFERS = 4096
# What marks a vllm-router request id: the router sends both legs at once once a prefill
# answered transfer_mode "push", so such a prefill request may wait for its offer.
CONCURRENT_MARK = "___decode_addr_"

# kv_transfer_params keys of a request that asks for no transfer without anything being lost:
# NixlConnector's with both flags false or null (as a router may send), and kvferry's own.
PLAIN_KEYS = ROUTER_KEYS | {"kvferry"}

W = TypeVar("W")


def offer_listen_address(config: ConnectorConfig) -> tuple[str, Optional[str]]:
    """Where a prefill server's offer rendezvous listens, and the host it advertises: the
    host of ``listen`` when it is tcp:// (a free port: the decode servers learn it from each
    answer), else loopback (one host)."""
    where = wire.parse_address(config.listen, "kv_connector_extra_config listen")
    if where.scheme != "tcp":
        return "tcp://127.0.0.1:0", None
    host = f"[{where.host}]" if ":" in where.host else where.host
    return f"tcp://{host}:0", config.advertise


class OfferBook(Generic[W]):
    """Prefill side: offers from decode servers, matched with router requests by transfer id.

    ``start(waiting, peer, peer_mac)`` starts a waiting request's lookup once its offer came
    (on the rendezvous's thread) and returns why it cannot (the offer is then refused), or
    None. Owned by the scheduler half; its tables are shared with the rendezvous's threads
    under one lock."""

    def __init__(self, authkey: bytes, config: ConnectorConfig, start: Callable[[W, str, str], Optional[str]]) -> None:
        self._authkey = authkey
        self._config = config
        self._start = start
        self._lock = threading.Lock()
        self._waiting: dict[str, W] = {}  # transfer -> its request's lookup, no offer yet
        self._offers: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # offers before their request
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfers that failed here: why (the newest)
        self._rendezvous: Optional[rendezvous.Rendezvous] = None
        self.address: Optional[str] = None
        self.answered_push = False  # a router has been told transfer_mode "push" by this server

    def listen(self) -> str:
        """The offer rendezvous's URL, started on first use."""
        if self._rendezvous is None:
            listen, advertise = offer_listen_address(self._config)
            self._rendezvous = rendezvous.Rendezvous(
                self._authkey,
                _no_endpoint,
                listen=listen,
                advertise=advertise,
                admit=lambda sender: "this is a prefill server's rendezvous: it publishes no destination",
                on_offer=self._offered,
            )
            self.address = self._rendezvous.address
            logger.info("kvferry: prefill offer rendezvous %s (routers: NixlConnector's protocol)", self.address)
        assert self.address is not None
        return self.address

    def expects_concurrent(self, transfer: str) -> bool:
        """Whether the decode leg of ``transfer`` likely runs beside its prefill leg (a
        vllm-router request id, after this server answered a push)."""
        return self.answered_push and CONCURRENT_MARK in transfer

    def claim(self, transfer: str, waiting: W) -> tuple[bool, Optional[tuple[str, str]]]:
        """A router prefill request arrived: ``(taken, offer)``. ``offer`` is the (peer,
        peer_mac) of an offer that came first (the caller starts the lookup itself), else
        ``waiting`` waits for it. ``taken`` is False when another live request holds this
        transfer id (``n > 1`` samples): that one serves the decode request."""
        with self._lock:
            if transfer in self._waiting:
                return False, None
            offered = self._offers.pop(transfer, None)
            if offered is None:
                self._waiting[transfer] = waiting
                return True, None
            return True, offered[:2]

    def drop(self, transfer: str, waiting: W) -> bool:
        """Stops waiting for ``transfer``'s offer, if ``waiting`` still waits; returns whether it did."""
        with self._lock:
            if self._waiting.get(transfer) is waiting:
                del self._waiting[transfer]
                return True
            return False

    def end(self, transfer: str, reason: str) -> None:
        """``transfer`` failed here: an offer for it is refused with ``reason``, at once."""
        with self._lock:
            self._offers.pop(transfer, None)
            self._ended[transfer] = reason
            while len(self._ended) > MAX_OFFERS:
                self._ended.popitem(last=False)

    def stale(self, now: float) -> list[tuple[str, str]]:
        """Offers whose prefill request did not come within ``destination_timeout_s``:
        ``(transfer, peer)`` each, dropped (the caller tells those decode servers)."""
        old = []
        with self._lock:
            while self._offers:
                transfer, (peer, _, at) = next(iter(self._offers.items()))
                if now - at < self._config.destination_timeout_s:
                    break
                del self._offers[transfer]
                old.append((transfer, peer))
        return old

    def _offered(self, transfer: str, peer: str, peer_mac: str) -> Optional[str]:
        """On the rendezvous's thread: why the offer is refused, or None."""
        try:
            trust.check_peer(self._authkey, self._config.trusted_peers, peer, peer_mac)
        except KvFerryError as err:
            return str(err)
        with self._lock:
            if transfer in self._ended:
                return f"it failed on the prefill server: {self._ended[transfer]}"
            waiting = self._waiting.pop(transfer, None)
            if waiting is None:
                if transfer in self._offers:
                    return "offered twice"
                self._offers[transfer] = (peer, peer_mac, time.monotonic())
                while len(self._offers) > MAX_OFFERS:
                    self._offers.popitem(last=False)
                return None
            return self._start(waiting, peer, peer_mac)

    def close(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()


def _no_endpoint(sender: str) -> str:
    raise KvFerryError("a prefill server's rendezvous publishes no destination")


def answer(book: OfferBook[Any], authkey: bytes, engine_id: str, transfer: str, tp_size: int) -> dict[str, Any]:
    """A router prefill request's ``kv_transfer_params``, in NixlConnector's shape: where the
    decode server offers (``remote_host``/``remote_port``, signed in ``remote_engine_id``),
    under which id (``remote_request_id``), and ``transfer_mode: "push"`` (vllm-router then
    runs both legs of later requests at once, and builds the decode leg's parameters from
    these fields alone)."""
    address = book.listen()
    where = wire.parse_address(address, "offer rendezvous")
    book.answered_push = True
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"{engine_id}.{trust.sign_peer(authkey, address)}",
        "remote_block_ids": [],
        "remote_host": where.host,
        "remote_port": where.port,
        "remote_request_id": transfer,
        "tp_size": tp_size,
        "transfer_mode": "push",
    }


def offer_async(
    client: Client,
    offer_to: str,
    offer_mac: str,
    transfer: str,
    peer: str,
    own_names: list[tuple[str, str]],
    on_failure: Callable[[str], None],
) -> None:
    """Decode side, never waiting on the network: checks the prefill server's address
    against its signature (the address came in an HTTP body), then offers ``transfer`` there
    on ``client`` (its kept connection to that prefill server's rendezvous). If either
    fails, ``transfer`` is abandoned at this server's own rendezvous (``own_names``: each
    rank's address and the names it publishes), so its decode worker gives the request up
    at its next step, and ``on_failure(reason)`` is called (on the client's thread)."""

    def failed(reason: str) -> None:
        logger.error("kvferry: transfer %r: %s", transfer, reason)
        on_failure(reason)
        for address, name in own_names:
            client.abandon(address, name, reason).add_done_callback(_log_failure)

    try:
        trust.check_peer(client.authkey, (), offer_to, offer_mac)
    except KvFerryError as err:
        failed(f"cannot tell the prefill server where to send: {err}")
        return

    def answered(future: Future[None]) -> None:
        err = future.exception()
        if err is not None:
            failed(f"cannot tell the prefill server where to send: {err}")

    client.offer(offer_to, transfer, peer, trust.sign_peer(client.authkey, peer)).add_done_callback(answered)


def _log_failure(future: Future[None]) -> None:
    err = future.exception()
    if err is not None:
        logger.warning("kvferry: %s", err)
