"""Which path each prefill engine's blocks take into this decode server: the connector's
``transport`` key, read per peer. ``auto`` (the default) offers the direct GPU path where
it can work and staging behind it; a transport named explicitly is the only one offered.

```
decode rank (CUDA caches, auto)                       prefill rank
lookup of S  -> serve cuda-ipc + staging for S
             -- destination, endpoint "auto+<cuda-ipc URL>,<staging URL>" -->
                                                      CUDA caches: open the IPC handles
                                                        opened -> writes over CUDA IPC
                                                        failed -> one log line; staging
                                                      CPU caches: staging
```
Both servers are on one host wherever ``auto`` runs (the connector refuses it with a
``tcp://`` listen address off loopback), so only the two processes' own view of the GPUs
decides: the prefill rank tries to open the decode rank's handles on its own GPU, which
works for a GPU it cannot see (disjoint ``CUDA_VISIBLE_DEVICES``) where the two GPUs have a
peer-to-peer path, and fails otherwise (no peer access, another IPC namespace, the same
process). A staging endpoint holds no ring until its sender connects, so offering it to a
peer that takes the direct path costs a listening socket.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvferry.errors import InvalidArgumentError
from kvferry.transports import registry
from kvferry.vllm.client import PATIENCE_SECONDS

__all__ = ["AUTO", "Choice", "choice_url", "connect", "offered", "urls_of"]

logger = logging.getLogger("kvferry.vllm")

AUTO = "auto"
# What ``auto`` offers: the direct path, then the fallback (rows of the registry's table,
# which says which caches each serves).
DIRECT = "cuda-ipc"
FALLBACK = "staging"
_PREFIX = AUTO + "+"
_ESCAPED = re.compile("%(25|2C)")


def offered(transport: str, device: str) -> tuple[str, ...]:
    """The transports a decode rank whose KV caches are on ``device`` serves each prefill
    engine, in the order the engine tries them: ``auto`` gives the direct path first where
    the caches are on a device it serves, then staging; a transport named explicitly is the
    only one, refused with `InvalidArgumentError` (naming both) when it cannot serve caches
    on ``device``."""
    if transport == AUTO:
        return (DIRECT, FALLBACK) if device in registry.spec(DIRECT).devices else (FALLBACK,)
    spec = registry.spec(transport, argument="kv_connector_extra_config transport")
    if device not in spec.devices:
        from kvferry.vllm.config import TRANSPORTS

        fits = [n for n in TRANSPORTS if n == AUTO or device in registry.spec(n).devices]
        raise InvalidArgumentError(
            f"invalid kv_connector_extra_config transport={transport!r} for vLLM's KV caches on {device}: "
            f"{transport} serves {' and '.join(spec.devices)} caches; for {device} caches choose from {', '.join(fits)}"
        )
    return (transport,)


def why_not_direct(device: str) -> Optional[str]:
    """Why ``auto`` gives a server whose KV caches are on ``device`` no direct path, or None."""
    if device in registry.spec(DIRECT).devices:
        return None
    return f"the KV caches are on {device}; {DIRECT} serves {' and '.join(registry.spec(DIRECT).devices)} caches"


def _escape(url: str) -> str:
    # A unix:// path under an operator's rendezvous_dir may hold any character but NUL.
    return url.replace("%", "%25").replace(",", "%2C")


def _unescape(url: str) -> str:
    return _ESCAPED.sub(lambda m: "%" if m.group(1) == "25" else ",", url)  # one pass: no escape read twice


def choice_url(urls: list[str]) -> str:
    """What a destination names as its endpoint: the one URL, or ``auto+`` and the URLs in
    the order they are tried, comma-separated (a ``%`` or ``,`` inside one escaped)."""
    if not urls:
        raise InvalidArgumentError("invalid urls=[]: a destination names at least one endpoint")
    return urls[0] if len(urls) == 1 else _PREFIX + ",".join(_escape(u) for u in urls)


def urls_of(endpoint: str) -> list[str]:
    """The URLs a destination's ``endpoint`` names, in the order they are tried
    (`choice_url`'s inverse)."""
    if not endpoint.startswith(_PREFIX):
        return [endpoint]
    return [_unescape(u) for u in endpoint[len(_PREFIX) :].split(",")]


def taken(endpoint: str, transport: str) -> list[str]:
    """The URLs of a destination's ``endpoint`` a server whose ``transport`` setting is
    ``transport`` sends over, in order: ``auto`` takes the direct path and staging, a
    transport named explicitly itself alone (the operator's choice wins on this side too).
    Raises `InvalidArgumentError` for a URL of no transport the registry knows."""
    takes = (DIRECT, FALLBACK) if transport == AUTO else (transport,)
    return [url for url in urls_of(endpoint) if registry.parse_url(url)[0] in takes]


@dataclass
class Choice:
    """The endpoints one prefill engine is offered (`registry.Served` each), in the order it
    tries them. Stands where a decode worker keeps a prefill engine's endpoint: ``url``,
    ``connected()``, ``close()``; ``endpoint`` is itself."""

    served: tuple[registry.Served, ...]

    @property
    def name(self) -> str:
        return AUTO

    @property
    def url(self) -> str:
        return choice_url([s.url for s in self.served])

    @property
    def endpoint(self) -> Choice:
        return self

    def connected(self) -> bool:
        return any(s.endpoint.connected() for s in self.served)

    def taken(self) -> Optional[str]:
        """The transport the prefill engine is connected over now, or None."""
        return next((s.name for s in self.served if s.endpoint.connected()), None)

    def close(self) -> None:
        for s in self.served:
            s.close()


def serve(transports: tuple[str, ...], make: Callable[[str], registry.Served]) -> registry.Served | Choice:
    """One prefill engine's endpoints: ``make(name)`` for each of ``transports``. Where the
    direct path cannot be served (its handles cannot be exported), the fallback alone, with
    one log line saying why."""
    if len(transports) == 1:
        return make(transports[0])
    served: list[registry.Served] = []
    try:
        for name in transports:
            try:
                served.append(make(name))
            except Exception as err:
                if name != DIRECT:
                    raise
                logger.warning("kvferry: cannot serve %s (%s); %s only", DIRECT, err, FALLBACK)
    except BaseException:
        for s in served:
            s.close()
        raise
    return served[0] if len(served) == 1 else Choice(tuple(served))


def connect(
    endpoint: str, *, transport: str, authkey: bytes, src: Any, what: str, host_src: Any = None
) -> tuple[Any, str]:
    """The prefill rank's transport to a destination's ``endpoint``, and the name of the
    transport it took: the first URL that this server's ``transport`` setting takes
    (`taken`) and that opens. The direct path is skipped for
    a pool on a device it does not serve; when it fails to open (the decode rank's handles
    cannot be mapped here), one log line names ``what`` (the peer) and why, and the next
    URL is tried. ``host_src``: the sender's host pool (NIXL registers it). The endpoint has
    `PATIENCE_SECONDS` for its handshake and hello while connected (a loaded decode host is
    slow, not gone). Raises what the
    last URL raised."""
    urls = taken(endpoint, transport)
    if not urls:
        raise InvalidArgumentError(
            f"invalid endpoint={endpoint!r}: none of its URLs is of a transport this server's transport"
            f" {transport!r} sends over"
        )
    for i, url in enumerate(urls):
        name, _ = registry.parse_url(url)
        last = i == len(urls) - 1
        if name == DIRECT and not last:
            why = why_not_direct(src.device.type) if src is not None else "no pool to send from"
            if why is not None:
                logger.info("kvferry: %s: %s (%s)", what, FALLBACK, why)
                continue
            try:
                return registry.connect(
                    url, authkey=authkey, src=src, host_src=host_src, handshake_timeout=PATIENCE_SECONDS
                ), name
            except InvalidArgumentError:  # a bug here, not the handles: staging would not mend it
                raise
            except Exception as err:  # torch's rebuild raises what CUDA said (a RuntimeError)
                logger.warning("kvferry: %s: %s, as %s could not open its KV cache: %s", what, FALLBACK, DIRECT, err)
            continue
        return registry.connect(
            url, authkey=authkey, src=src, host_src=host_src, handshake_timeout=PATIENCE_SECONDS
        ), name
    raise AssertionError("unreachable: the last URL returns or raises")
