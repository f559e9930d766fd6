"""``kvferry proxy``: an OpenAI-compatible front for a prefill/decode (P/D) pair of vLLM servers.

Each ``/v1/completions`` or ``/v1/chat/completions`` request (streaming or not) goes through one
prefill server and one decode server, and the client gets the decode server's answer. How the
two legs are wired is one small :class:`Flow` per KV connector (:data:`FLOWS`):

```
client --> proxy --(prefill leg: flow.prefill_body)--> prefill server
               \\--(decode leg: flow.decode_body(prefill answer))--> decode server --> client
```

Routing: the prefill server with the fewest requests in flight; the decode server is sticky per
session (its prefix cache then serves the next turn). A session is, in order: the
``X-Session-Id`` header, the request's ``user`` field, else a hash of the start of the prompt
(the first 64 prompt tokens, 256 prompt characters, or the first two chat messages), so turns of
one conversation land together even when the client names no session. A new session goes to the
decode server with the fewest requests in flight.

Every answer carries a ``Server-Timing`` header: ``decode-start`` (and ``prefill``, where the
flow waits for the prefill leg first), in ms since the request arrived.

Failures: an upstream that cannot be reached or answers an error gives the client a 502 (or the
upstream's own 4xx) naming the server, or, once a stream has started, a final SSE ``error``
event; the server is skipped for new sessions for ``DOWN_S`` seconds and the proxy keeps
serving. A decode server that refuses the connection never saw the request, so the next live
decode server takes it (the prepared KV waits on the prefill server for whichever reads it). A
client that disconnects cancels the leg in flight: the proxy closes that upstream connection and
vLLM aborts the request; a decode server aborted before it read the KV tells the prefill server
to free it (NixlConnector does), so nothing stays allocated. What is left to the connector's
lease: KV prepared for a decode server that died before reading it. With KvferryConnector, a
leg whose server answers an error (vLLM says only "Internal server error" for a request it
finished with finish_reason "error") makes the proxy ask that server the transfer's
``status``, and the client's error names the reason (docs/vllm.md, "Status"). A prefill leg
failing before the decode server sent a token ends the decode leg too, unless the prefill
server gave the transfer up because the decode server had not admitted its request in time
(`rendezvous.UNCLAIMED`): that server computes the prompt itself once it admits it.

Idle upstream connections are kept ``KEEPALIVE_S`` seconds, under the servers' own HTTP
keep-alive; a request that meets a connection its server closed before answering goes once
more on a fresh connection (the server never read it) instead of failing.

``/health`` asks every upstream's own ``/health``: 200 while one prefill and one decode server
answer (``"degraded"`` naming those down by their place in ``--prefill``/``--decode``), else
503 naming the role with no server up.

A stream is whole at its ``data: [DONE]`` event: the proxy returns there, so a client that
closes right after it (before the server ends its stream) is a served request, not a failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

import aiohttp
from aiohttp import web

from kvferry.transports.guard import RateLimitedLog
from kvferry.vllm import redact
from kvferry.vllm.rendezvous import UNCLAIMED

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SESSION_HEADER = "X-Session-Id"
# The key of kvferry's parameters in kv_transfer_params (docs/vllm.md).
PARAMS_KEY = "kvferry"
# The prefill leg's kv_transfer_params in NixlConnector's protocol (vLLM's toy proxy sends
# these; KvferryConnector takes them too: docs/routers.md).
NIXL_PREFILL_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Seconds a server that failed to answer is passed over for new sessions.
DOWN_S = 10.0
# Sessions remembered for stickiness (least recently used forgotten first).
MAX_SESSIONS = 65536
# A stream's bytes held while looking for the end of an event (vLLM's events are far
# smaller): past this the bytes go through as they are.
MAX_EVENT_BYTES = 1 << 20
# Seconds an idle upstream connection is kept for reuse: under the servers' own HTTP keep-alive
# (uvicorn, vLLM's server, closes an idle connection after 5 s), so the proxy drops it first
# instead of sending a request into a connection the server is closing. A close that still
# crosses a request on the wire is retried once on a fresh connection (Proxy._request).
KEEPALIVE_S = 2.0
# Seconds each upstream has to answer its /health when the proxy's /health asks.
HEALTH_TIMEOUT_S = 2.0
# A client's request head must arrive whole within HEAD_S of its connection (or of its first
# byte, on a kept-alive connection), its body within BODY_S; a kept-alive connection idle for
# IDLE_S after an answer is closed (aiohttp's own keep-alive); one client address holds at most
# MAX_PER_CLIENT connections at once (one more is closed on arrival). Without them,
# half-sent requests held the proxy's every descriptor (a slowloris).
HEAD_S = 10.0
BODY_S = 30.0
IDLE_S = 75.0
MAX_PER_CLIENT = 64


class _Refused(Exception):
    """The decode server refused the connection: it never saw the request."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


_ADDRESS = redact.ADDRESS  # every form kvferry writes an address in (URLs, "tcp HOST:PORT", "pid N")
MAX_REASON_CHARS = 1000


def scrub(text: str) -> str:
    """A reason for a client: addresses (unix://, tcp://, http://, a transport's URL) replaced
    by ``<address>``, at most ``MAX_REASON_CHARS`` characters."""
    text = _ADDRESS.sub("<address>", str(text))
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


# Each failed leg is logged with its server's URL and the error's whole text; a flood of
# failing requests logs a few lines and a count.
_log = RateLimitedLog(logging.getLogger("kvferry.vllm.proxy"))


def _http_reason(status: int, text: str) -> str:
    """An upstream's error answer for the client: a 4xx says what was wrong with the client's
    own request, so its body goes on; a 5xx's body is the server's business (logged only)."""
    return f"HTTP {status}: {text[:2000]}" if 400 <= status < 500 else f"HTTP {status}"


class UpstreamError(Exception):
    """One leg failed: which server, the status to give the client and a message;
    ``upstream_status``: the HTTP status the server answered, or the code of a stream's error
    event (``None``: no answer); ``transfer``: the kvferry transfer it concerns, if any."""

    def __init__(
        self,
        leg: str,
        url: str,
        status: int,
        message: str,
        upstream_status: Optional[int] = None,
        transfer: Optional[str] = None,
        *,
        detail: Optional[str] = None,
    ) -> None:
        super().__init__(f"{leg} server {url}: {message}" + (f" [{detail}]" if detail else ""))
        self.leg, self.url, self.status, self.message = leg, url, status, message
        self.upstream_status, self.transfer = upstream_status, transfer

    def public(self) -> str:
        """What the client is told: which leg failed and a short reason, never the server's
        URL, an exception's text or what the upstream answered (those go to the log)."""
        return f"{self.leg} server: {scrub(self.message)}"

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.public(), "type": "upstream_error", "code": self.status}
        error["leg"] = self.leg
        if self.transfer is not None:
            error["transfer"] = self.transfer
        return {"error": error}


class Flow:
    """How one KV connector wants the two legs of a request. :meth:`serve` runs one client
    request through an :class:`Exchange` (which picks servers, fails over and writes to the
    client) and returns the client's response; an :class:`UpstreamError` it raises reaches the
    client as an error."""

    name = ""

    async def serve(self, ex: Exchange) -> web.StreamResponse:
        raise NotImplementedError


def _one_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: the same prompt, one token, not streamed. A shallow copy:
    the legs only replace the body's top-level keys, and a deep copy of a long prompt's token
    list costs a quarter of a millisecond in front of both legs."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # One sample: the prompt's KV is the same for every sample of the decode leg, and one
    # prefill request per sample would race to send one transfer.
    out.pop("n", None)
    out.pop("best_of", None)
    return out


class NixlFlow(Flow):
    """vLLM's NIXL connectors: the prefill server computes the prompt and one token, keeps the KV
    (``do_remote_decode``) and answers where it is; then the decode server READs it and tells
    the prefill server to free it (NixlConnector, the pull one), or registers its blocks with the
    prefill server, which WRITEs into them (NixlPushConnector). Both legs carry one
    ``X-Request-Id``, as vLLM's own proxy sends them: the push connector pairs a decode
    server's registration with the prefill server's finished request by that id."""

    name = "nixl"

    async def serve(self, ex: Exchange) -> web.StreamResponse:
        ex.headers["X-Request-Id"] = uuid.uuid4().hex
        first = _one_token(ex.body)
        first["kv_transfer_params"] = dict(NIXL_PREFILL_LEG)
        answer = await ex.prefill(first)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise UpstreamError(
                "prefill",
                ex.prefill_url,
                502,
                "answer has no kv_transfer_params (is it running NixlConnector as kv_producer?)",
            )
        # Any decode server can read the KV the prefill server holds, so a refused connection
        # fails over to the next one.
        return await ex.decode(dict(ex.body, kv_transfer_params=params), failover=True)


def _hello_body(ex: Exchange) -> dict[str, Any]:
    """kvferry's one-token ``hello`` request, for the client's model."""
    hello: dict[str, Any] = {"prompt": [0], "max_tokens": 1, "kv_transfer_params": {PARAMS_KEY: {"op": "hello"}}}
    if "model" in ex.body:
        hello["model"] = ex.body["model"]
    return hello


class KvferryFlow(Flow):
    """kvferry's KvferryConnector (docs/vllm.md, "The per-request protocol"): the decode server
    says once where its endpoint listens (``hello``); then the decode request (``recv``) and the
    prefill request (``send`` to that endpoint) go out together, so the prefill server pushes the
    reused prefix while it computes the rest of the prompt."""

    name = "kvferry"

    def __init__(self) -> None:
        # Decode server URL -> its hello answer (peer, engine). Dropped when a request through
        # it fails, so a restarted server (new engine, new address) is asked again. The key is
        # not here: both servers read it from their own key file, it never crosses HTTP.
        self.peers: dict[str, dict[str, Any]] = {}
        self.hellos = 0  # hello requests sent (a figure for benches: should stay one per decode server)
        # Prefill server URL -> its tensor parallel size (its hello answer's tp_size): passed to
        # the decode leg when every prefill server has one size, so the decode server takes
        # that size with no prefill_tp_size setting.
        self.prefill_tps: dict[str, int] = {}
        self.statuses = 0  # status requests sent (one per failed request)
        self._background: set[asyncio.Future[Any]] = set()  # legs ending after their answer

    async def _peer(self, ex: Exchange) -> dict[str, Any]:
        while True:
            server = ex.decode_server
            known = self.peers.get(server.url)
            if known is not None:
                return known
            hello = _hello_body(ex)
            self.hellos += 1
            try:
                answer = await ex.post_json("decode", server, "/v1/completions", hello, retry=True)
            except _Refused as refused:
                ex.failover_decode(refused.cause)  # raises when no decode server is left
                continue
            info = (answer.get("kv_transfer_params") or {}).get(PARAMS_KEY)
            if not isinstance(info, dict) or info.get("role") not in ("kv_consumer", "kv_both") or not info.get("peer"):
                why = "its hello answer is not a kvferry decode server's (KvferryConnector as kv_consumer?)"
                raise UpstreamError("decode", server.url, 502, why, detail=repr(info)[:500])
            self.peers[server.url] = info
            return info

    async def _prefill_tp(self, ex: Exchange) -> Optional[int]:
        """The prefill servers' one tensor parallel size, asked once per server (``hello``);
        None when they differ, or one cannot say (then the decode server's own
        ``prefill_tp_size`` decides)."""
        for server in ex.proxy.router.prefills:
            if server.url in self.prefill_tps:
                continue
            hello = _hello_body(ex)
            try:
                answer = await ex.post_json("prefill", server, "/v1/completions", hello, retry=True)
            except (_Refused, UpstreamError):
                return None  # asked again with the next request
            size = ((answer.get("kv_transfer_params") or {}).get(PARAMS_KEY) or {}).get("tp_size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                return None
            self.prefill_tps[server.url] = size
        sizes = {self.prefill_tps[s.url] for s in ex.proxy.router.prefills}
        return sizes.pop() if len(sizes) == 1 else None

    async def serve(self, ex: Exchange) -> web.StreamResponse:
        peer = await self._peer(ex)
        prefill_tp = await self._prefill_tp(ex)
        server = ex.decode_server
        transfer = uuid.uuid4().hex
        send = _one_token(ex.body)
        ours = {"op": "send", "transfer": transfer, "peer": peer["peer"]}
        if isinstance(peer.get("peer_mac"), str):  # the decode server's signature of its address (kvferry.vllm.trust)
            ours["peer_mac"] = peer["peer_mac"]
        send["kv_transfer_params"] = {PARAMS_KEY: ours}
        ours_recv: dict[str, Any] = {"op": "recv", "transfer": transfer}
        if prefill_tp is not None:
            ours_recv["prefill_tp"] = prefill_tp
        recv = dict(ex.body, kv_transfer_params={PARAMS_KEY: ours_recv})
        # The decode leg goes out first: the prefill server computes once the decode server
        # has admitted its half and published the destination, so the decode leg's way in
        # (HTTP, vLLM's queue, one scheduler step) is on the critical path and the prefill
        # leg's is not.
        decode = asyncio.ensure_future(ex.decode(recv, failover=False))
        prefill = asyncio.ensure_future(ex.prefill(send))
        ex.explain = functools.partial(self._explain_decode, ex, server, transfer, prefill)
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and prefill.exception() is not None and not decode.done() and ex.events_out == 0:
                # No token came yet, so the decode request is still waiting for blocks that
                # will not come (it would wait out its transfer timeout): give it up and report
                # the prefill server's failure, as a JSON error or, once the stream's headers
                # went out, as the stream's last event. Unless the decode server had not
                # admitted it when the prefill side gave it up: it computes it itself then.
                failed = await self._explain_prefill(ex, prefill.exception(), transfer)  # type: ignore[arg-type]
                if not (isinstance(failed, UpstreamError) and UNCLAIMED in failed.message):
                    raise failed
                _log.warning(
                    "unclaimed",
                    "kvferry proxy: %s; the decode server computes the prompt once it admits the request",
                    failed,
                )
            response = await decode
        except BaseException:
            if ex.delivered:
                # The client has its whole answer ([DONE] written, or the whole JSON) and
                # closed its connection before this handler resumed (which cancels it): that
                # is how a streamed turn normally ends, not a failure. The decode leg may
                # still be waiting for its server to end the stream: it ends on its own.
                if ex.failed:
                    self.peers.pop(server.url, None)
                self._watch(prefill, server.url)
                self._settle(decode)
                raise
            # Failed, or the client left: both halves are aborted (closing a leg's connection
            # makes vLLM abort it; the connectors then free both sides).
            self.peers.pop(server.url, None)
            pending = [t for t in (prefill, decode) if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in (prefill, decode):
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: a failure already reported is not logged twice
            raise
        if ex.failed:
            self.peers.pop(server.url, None)
        # The decode server had every block, so the prefill leg is ending on its own; its
        # answer only says whether the peer must be asked again. It is not awaited here: the
        # client, having its whole answer, may close the connection, which cancels this handler.
        self._watch(prefill, server.url)
        return response

    async def _status(self, ex: Exchange, leg: str, server: Upstream, transfer: str) -> dict[str, Any]:
        """The server's ``status`` answer for ``transfer`` (docs/vllm.md): a one-token request
        that moves no KV but, like ``hello``, is not free: vLLM runs one forward of its one
        token (a slot in one engine step)."""
        body: dict[str, Any] = {
            "prompt": [0],
            "max_tokens": 1,
            "kv_transfer_params": {PARAMS_KEY: {"op": "status", "transfer": transfer}},
        }
        if "model" in ex.body:
            body["model"] = ex.body["model"]
        self.statuses += 1
        try:
            answer = await ex.post_json(leg, server, "/v1/completions", body)
        except UpstreamError as err:
            return {"state": "unavailable", "error": f"its status request failed: {err.message}"}
        info = (answer.get("kv_transfer_params") or {}).get(PARAMS_KEY)
        if not isinstance(info, dict) or not isinstance(info.get("state"), str):
            return {"state": "unavailable", "error": f"its status request answered {info!r}"}
        return info

    @staticmethod
    def _why(status: dict[str, Any], transfer: str, err: UpstreamError) -> str:
        """The message of a failed leg: the reason its server gives for the transfer, else
        what it answered and what its status said."""
        if status.get("state") in ("failed", "aborted") and status.get("error"):
            return f"transfer {transfer} {status['state']}: {status['error']}"
        said = (
            status.get("error")
            if status.get("state") == "unavailable"
            else f"the server reports it {status.get('state')!r}"
        )
        return f"{err.message} (transfer {transfer}: {said})"

    async def _explain_decode(
        self, ex: Exchange, server: Upstream, transfer: str, prefill: asyncio.Future[dict[str, Any]], err: UpstreamError
    ) -> UpstreamError:
        """The decode server answered an error (vLLM says only "Internal server error" for a
        request it finished with finish_reason "error"): the reason, from its ``status``, and
        the prefill leg's own error if it has one by now. The peer is dropped here, before the
        client hears of the failure (a stream's error event goes out before serve resumes), so
        the next request through this server asks it ``hello`` again."""
        self.peers.pop(server.url, None)
        why = self._why(await self._status(ex, "decode", server, transfer), transfer, err)
        if prefill.done() and not prefill.cancelled():
            failed = prefill.exception()
            if failed is not None:
                why += f"; and {failed.public() if isinstance(failed, UpstreamError) else 'the prefill leg failed'}"
            else:
                theirs = ((prefill.result().get("kv_transfer_params") or {}).get(PARAMS_KEY) or {}).get("error")
                if theirs is not None:
                    why += f"; prefill server: {theirs}"
        return UpstreamError("decode", server.url, 502, why, err.upstream_status, transfer, detail=str(err))

    async def _explain_prefill(self, ex: Exchange, err: BaseException, transfer: str) -> BaseException:
        """The prefill leg failed: an error answer (vLLM's "Internal server error" for a
        refused send, an unreachable peer, ...) gets the reason from that server's ``status``."""
        if (
            not isinstance(err, UpstreamError)
            or err.upstream_status is None
            or err.upstream_status < 500
            or ex.prefill_server is None
        ):
            return err
        why = self._why(await self._status(ex, "prefill", ex.prefill_server, transfer), transfer, err)
        return UpstreamError("prefill", err.url, 502, why, err.upstream_status, transfer, detail=str(err))

    def _settle(self, task: asyncio.Future[Any]) -> None:
        """Keeps a leg that ends after its handler (its outcome no longer matters) until it
        ends, and retrieves its exception so that nothing is logged as never retrieved."""
        if task.done():
            if not task.cancelled():
                task.exception()
            return
        self._background.add(task)

        def done(t: asyncio.Future[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled():
                t.exception()

        task.add_done_callback(done)

    def _watch(self, prefill: asyncio.Future[dict[str, Any]], url: str) -> None:
        self._background.add(prefill)
        prefill.add_done_callback(functools.partial(self._prefill_done, url=url))

    def _prefill_done(self, task: asyncio.Future[dict[str, Any]], url: str) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is not None:
            self.peers.pop(url, None)
            return
        info = (task.result().get("kv_transfer_params") or {}).get(PARAMS_KEY) or {}
        if info.get("error") is not None:
            self.peers.pop(url, None)


FLOWS: dict[str, type[Flow]] = {NixlFlow.name: NixlFlow, KvferryFlow.name: KvferryFlow}


@dataclass
class Upstream:
    url: str
    in_flight: int = 0
    down_until: float = 0.0

    def up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class Router:
    """Least-loaded prefill choice and sticky decode choice per session."""

    prefills: list[Upstream]
    decodes: list[Upstream]
    sessions: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def _least(self, servers: list[Upstream]) -> Upstream:
        now = time.monotonic()
        live = [s for s in servers if s.up(now)] or servers
        turn = next(self._rr)
        # Ties go round-robin, so equal servers share new work.
        return min(live, key=lambda s: (s.in_flight, (servers.index(s) - turn) % len(servers)))

    def prefill(self) -> Upstream:
        return self._least(self.prefills)

    def decode(self, session: str) -> Upstream:
        index = self.sessions.get(session)
        if index is not None and self.decodes[index].up(time.monotonic()):
            self.sessions.move_to_end(session)
            return self.decodes[index]
        chosen = self._least(self.decodes)
        self.sessions[session] = self.decodes.index(chosen)
        self.sessions.move_to_end(session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return chosen


def session_of(headers: Any, body: dict[str, Any]) -> str:
    """The session a request belongs to (see the module docstring for the order)."""
    named = headers.get(SESSION_HEADER)
    if named:
        return f"h:{named}"
    if isinstance(body.get("user"), str) and body["user"]:
        return f"u:{body['user']}"
    if "messages" in body:
        start: Any = body["messages"][:2] if isinstance(body["messages"], list) else body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        start = prompt[:64] if isinstance(prompt, list) else str(prompt)[:256]
    return "p:" + hashlib.sha256(json.dumps(start, sort_keys=True).encode()).hexdigest()[:24]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class ClientGuard:
    """The proxy's bounds on its clients' connections (`HEAD_S`, `MAX_PER_CLIENT`): counts
    each address's connections and closes those whose request head is late. Its counts are
    figures for tests and logs."""

    def __init__(self, head_s: float = HEAD_S, max_per_client: int = MAX_PER_CLIENT, idle_s: float = IDLE_S) -> None:
        for name, value in (("head_s", head_s), ("idle_s", idle_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if isinstance(max_per_client, bool) or not isinstance(max_per_client, int) or max_per_client < 1:
            raise ValueError(f"max_per_client must be an int >= 1, got {max_per_client!r}")
        self.head_s, self.max_per_client, self.idle_s = head_s, max_per_client, idle_s
        self.per_client: collections.Counter[str] = collections.Counter()
        self.by_transport: dict[Any, _Guarded] = {}
        self.turned_away = 0  # connections closed on arrival (their address at the bound)
        self.late_heads = 0  # connections closed for a head not whole in time
        self.idle_closed = 0  # kept-alive connections closed for idling past idle_s

    def protocol(self, handler_factory: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for the listening socket: aiohttp's handler behind the bounds."""
        return lambda: _Guarded(handler_factory(), self)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """A request's head arrived whole: no deadline while it is served; once its answer
        ended, the connection may idle for idle_s."""
        conn = self.by_transport.get(request.transport)
        if conn is not None:
            conn.disarm()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.arm(idle=True)


class _Guarded(asyncio.Protocol):
    """One client connection: its aiohttp handler, behind `ClientGuard`'s bounds."""

    def __init__(self, handler: Any, guard: ClientGuard) -> None:
        self._handler, self._guard = handler, guard
        self._transport: Any = None
        self._client = ""
        self._timer: Optional[asyncio.TimerHandle] = None
        self._idle = False  # the timer is the idle one (no byte of a next head yet)

    def connection_made(self, transport: Any) -> None:
        guard = self._guard
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if guard.per_client[self._client] >= guard.max_per_client:
            guard.turned_away += 1
            _log.warning(
                "turned-away",
                "kvferry proxy: a client at %s already holds %d connections (MAX_PER_CLIENT): one more closed",
                self._client,
                guard.max_per_client,
            )
            transport.abort()
            return
        self._transport = transport  # admitted: set only here
        guard.per_client[self._client] += 1
        guard.by_transport[transport] = self
        self.arm()
        self._handler.connection_made(transport)

    def arm(self, idle: bool = False) -> None:
        """Starts the head deadline, or with ``idle`` the kept-alive one."""
        self.disarm()
        if self._transport is not None and not self._transport.is_closing():
            self._idle = idle
            wait = self._guard.idle_s if idle else self._guard.head_s
            self._timer = asyncio.get_running_loop().call_later(wait, self._late)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            if self._idle:
                self._guard.idle_closed += 1
            else:
                self._guard.late_heads += 1
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            if self._idle and self._timer is not None:
                self.arm()  # a next head began: it has head_s to arrive whole
            self._handler.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self._handler.eof_received() if self._transport is not None else None

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self._transport is None:  # turned away: aiohttp's handler never saw it
            return
        self.disarm()
        guard = self._guard
        guard.by_transport.pop(self._transport, None)
        guard.per_client[self._client] -= 1
        if guard.per_client[self._client] <= 0:
            del guard.per_client[self._client]
        self._handler.connection_lost(exc)


class Proxy:
    """The aiohttp application and its upstream client session."""

    def __init__(
        self,
        prefills: Sequence[str],
        decodes: Sequence[str],
        connector: str = "nixl",
        timeout_s: float = 3600.0,
        keepalive_s: float = KEEPALIVE_S,
        guard: Optional[ClientGuard] = None,
        body_s: float = BODY_S,
    ) -> None:
        if not prefills:
            raise ValueError(f"prefills must name at least one server, got {list(prefills)!r}")
        if not decodes:
            raise ValueError(f"decodes must name at least one server, got {list(decodes)!r}")
        if connector not in FLOWS:
            raise ValueError(f"connector must be one of {sorted(FLOWS)}, got {connector!r}")
        for url in (*prefills, *decodes):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URLs must start with http:// or https://, got {url!r}")
        self.flow = FLOWS[connector]()
        self.router = Router([Upstream(u.rstrip("/")) for u in prefills], [Upstream(u.rstrip("/")) for u in decodes])
        if not keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {keepalive_s!r}")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self.keepalive_s = keepalive_s
        self.client: Optional[aiohttp.ClientSession] = None
        # New connections only (none kept): the one retry of a request whose pooled connection
        # the upstream closed before answering.
        self.fresh: Optional[aiohttp.ClientSession] = None
        self.retries = 0  # requests sent again on a fresh connection (a figure for tests)
        if not body_s > 0:
            raise ValueError(f"body_s must be > 0, got {body_s!r}")
        self.body_s = body_s
        self.guard = guard if guard is not None else ClientGuard()
        self.app = web.Application(middlewares=[self.guard.middleware])
        for path in ENDPOINTS:
            self.app.router.add_post(path, self.handle)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, app: web.Application) -> None:
        pooled = aiohttp.TCPConnector(keepalive_timeout=self.keepalive_s)
        self.client = aiohttp.ClientSession(timeout=self.timeout, connector=pooled)
        self.fresh = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(force_close=True))

    async def _close(self, app: web.Application) -> None:
        for session in (self.client, self.fresh):
            if session is not None:
                await session.close()

    async def _request(self, method: str, url: str, **options: Any) -> aiohttp.ClientResponse:
        """The upstream's response, its head read. A pooled connection that the upstream
        closed before answering (its keep-alive ran out as the request went out: the server
        disconnects, or resets the connection the request was written into) never got the
        request read, so it goes once more on a fresh connection; any other failure, and a
        second one, is the caller's."""
        assert self.client is not None and self.fresh is not None
        try:
            return await self.client.request(method, url, **options)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            closed = isinstance(err, aiohttp.ServerDisconnectedError) or (
                not isinstance(err, aiohttp.ClientConnectorError) and err.errno in (errno.ECONNRESET, errno.EPIPE)
            )
            if not closed:
                raise
        self.retries += 1
        return await self.fresh.request(method, url, **options)

    async def _down(self, server: Upstream) -> Optional[str]:
        """Why ``server`` does not answer its own ``/health`` with 200 within
        ``HEALTH_TIMEOUT_S`` (None: it does). Short words only: /health answers any client."""
        try:
            r = await self._request(
                "GET", server.url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            )
            async with r:
                return None if r.status == 200 else f"HTTP {r.status}"
        except asyncio.TimeoutError:
            return f"no answer within {HEALTH_TIMEOUT_S:g} s"
        except (aiohttp.ClientError, OSError):
            return "unreachable"

    async def health(self, request: web.Request) -> web.Response:
        """The proxy serves while one prefill and one decode server answer their own
        ``/health``: 200 (``"status": "ok"``, or ``"degraded"`` when some server is down), else
        503 (``"unavailable"``) with a reason naming the role whose servers are all down. Each
        role says how many of its servers are up and which are down, by their place in
        ``--prefill``/``--decode`` (0 first), never by URL."""
        servers = {"prefill": self.router.prefills, "decode": self.router.decodes}
        found = await asyncio.gather(*(self._down(s) for group in servers.values() for s in group))
        body: dict[str, Any] = {"status": "ok", "connector": self.flow.name}
        lost = []
        for role, group in servers.items():
            reasons, found = found[: len(group)], found[len(group) :]
            down = [{"index": i, "reason": why} for i, why in enumerate(reasons) if why is not None]
            body[role] = {"up": len(group) - len(down), "of": len(group), "down": down}
            if len(down) == len(group):
                lost.append(f"every {role} server is down ({len(group)} of {len(group)})")
            elif down:
                body["status"] = "degraded"
        if lost:
            body.update(status="unavailable", reason="; ".join(lost))
            return web.json_response(body, status=503)
        return web.json_response(body)

    async def models(self, request: web.Request) -> web.Response:
        try:
            answer = await self._post_json("decode", self.router.decodes[0], "/v1/models", None)
        except UpstreamError as err:
            return web.json_response(err.body(), status=err.status)
        return web.json_response(answer)

    async def _post_json(
        self,
        leg: str,
        server: Upstream,
        path: str,
        body: Optional[dict[str, Any]],
        retry: bool = False,
        headers: Optional[dict[str, str]] = None,
    ) -> dict[str, Any]:
        """One non-streaming call; a transport failure marks the server down. ``retry``: a
        refused connection raises _Refused (the caller tries another server)."""
        server.in_flight += 1
        try:
            if body is None:
                r = await self._request("GET", server.url + path)
            else:
                r = await self._request("POST", server.url + path, json=body, headers=headers)
            async with r:
                text = await r.text()
                if r.status != 200:
                    status = r.status if 400 <= r.status < 500 else 502
                    reason = _http_reason(r.status, text)
                    raise UpstreamError(leg, server.url, status, reason, r.status, detail=text[:2000])
                try:
                    data = json.loads(text)
                except ValueError:
                    raise UpstreamError(leg, server.url, 502, "answer is not JSON", detail=repr(text[:200])) from None
                if not isinstance(data, dict):
                    raise UpstreamError(leg, server.url, 502, "answer is not a JSON object", detail=repr(text[:200]))
                return data
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
            server.down_until = time.monotonic() + DOWN_S
            if retry and isinstance(err, aiohttp.ClientConnectorError):
                raise _Refused(f"{type(err).__name__}: {err}") from err
            raise UpstreamError(leg, server.url, 502, "unreachable", detail=f"{type(err).__name__}: {err}") from err
        finally:
            server.in_flight -= 1

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await asyncio.wait_for(request.json(), self.body_s)
        except asyncio.TimeoutError:
            return _error(408, f"request body not received whole within {self.body_s:g} s")
        except ValueError as err:
            return _error(400, f"request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, got {type(body).__name__}")
        ex = Exchange(self, request, body)
        try:
            return await self.flow.serve(ex)
        except UpstreamError as err:
            _log.warning(err.leg, "kvferry proxy: %s", err)  # the whole story, for the operator (not the client)
            if ex.out is None:
                return web.json_response(err.body(), status=err.status)
            # The stream has started: its last event says what went wrong.
            with contextlib.suppress(Exception):
                await ex.out.write(f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode())
                await ex.out.write_eof()
            return ex.out


class Exchange:
    """One client request on its way through a flow: its servers, the failover rules, and the
    client's response once streaming has begun (``out``)."""

    def __init__(self, proxy: Proxy, request: web.Request, body: dict[str, Any]) -> None:
        self.proxy, self.request, self.body, self.path = proxy, request, body, request.path
        self.session = session_of(request.headers, body)
        self.decode_server = proxy.router.decode(self.session)
        self.prefill_url = ""
        self.prefill_server: Optional[Upstream] = None
        self.out: Optional[web.StreamResponse] = None
        self.events_out = 0  # SSE events of the decode leg written to the client
        self.delivered = False  # the client has the whole answer (a stream: its [DONE])
        self.failed = False  # the answer the client got ends in an error event
        # The flow's explanation of a decode server's error answer (kvferry: the transfer's
        # status); None: the error goes to the client as the server gave it.
        self.explain: Optional[Callable[[UpstreamError], Awaitable[UpstreamError]]] = None
        self._tried_decodes: list[str] = []
        self._t0 = time.perf_counter()
        self.timing: dict[str, float] = {}  # ms since the request arrived, per milestone
        self.headers: dict[str, str] = {}  # the flow's headers for both legs

    def mark(self, name: str) -> None:
        self.timing[name] = 1e3 * (time.perf_counter() - self._t0)

    def server_timing(self) -> str:
        """The ``Server-Timing`` header of the client's answer: when the prefill leg ended
        (``prefill``) and the decode leg was sent (``decode-start``), in ms since arrival."""
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in self.timing.items())

    async def post_json(
        self, leg: str, server: Upstream, path: str, body: dict[str, Any], retry: bool = False
    ) -> dict[str, Any]:
        return await self.proxy._post_json(leg, server, path, body, retry, self.headers)

    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg on the least loaded prefill server; one that refuses the connection
        never saw the request, so the next live one takes it."""
        tried: list[str] = []
        while True:
            server = self.proxy.router.prefill()
            self.prefill_url, self.prefill_server = server.url, server
            try:
                answer = await self.post_json("prefill", server, self.path, body, retry=True)
                self.mark("prefill")
                return answer
            except _Refused as refused:
                tried.append(server.url)
                if not [s for s in self.proxy.router.prefills if s.url not in tried and s.up(time.monotonic())]:
                    raise UpstreamError("prefill", server.url, 502, "unreachable", detail=refused.cause) from None

    def failover_decode(self, cause: str) -> None:
        """Moves the session to another live decode server, or raises when none is left."""
        self._tried_decodes.append(self.decode_server.url)
        now = time.monotonic()
        if not [s for s in self.proxy.router.decodes if s.url not in self._tried_decodes and s.up(now)]:
            also = f" (also tried {', '.join(self._tried_decodes[:-1])})" if len(self._tried_decodes) > 1 else ""
            why = "unreachable" + (" (every decode server was tried)" if also else "")
            raise UpstreamError("decode", self.decode_server.url, 502, why, detail=f"{cause}{also}")
        self.decode_server = self.proxy.router.decode(self.session)

    async def decode(self, body: dict[str, Any], failover: bool) -> web.StreamResponse:
        """The decode leg, whose answer goes to the client (streamed as it comes)."""
        while True:
            try:
                return await self._decode_once(body)
            except _Refused as refused:
                if not failover:
                    url = self.decode_server.url
                    raise UpstreamError("decode", url, 502, "unreachable", detail=refused.cause) from None
                self.failover_decode(refused.cause)

    async def _event(self, out: web.StreamResponse, server: Upstream, event: bytes) -> bool:
        """Writes one SSE event of the decode stream to the client; an error event goes out
        as the flow explains it. True for the stream's last event (``[DONE]``)."""
        data = event.strip()
        if data == b"data: [DONE]":
            await out.write(event)
            self.delivered = True
            return True
        if self.explain is not None and data.startswith(b"data:") and b'"error"' in data:
            try:
                payload = json.loads(data[5:])
            except ValueError:
                payload = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                upstream = payload["error"]
                code = upstream.get("code")
                said = repr(upstream.get("message"))[:500]
                status = code if isinstance(code, int) else None
                err = UpstreamError("decode", server.url, 502, "stream error", status, detail=said)
                self.failed = True
                explained = await self.explain(err)
                _log.warning("decode", "kvferry proxy: %s", explained)  # the client gets explained.public()
                event = f"data: {json.dumps(explained.body())}\n\n".encode()
        await out.write(event)
        self.events_out += 1
        return False

    async def _decode_once(self, body: dict[str, Any]) -> web.StreamResponse:
        server = self.decode_server
        self.mark("decode-start")
        if not body.get("stream"):
            try:
                answer = await self.post_json("decode", server, self.path, body, retry=True)
            except UpstreamError as err:
                if self.explain is None or err.upstream_status is None or err.upstream_status < 500:
                    raise
                raise await self.explain(err) from None
            self.delivered = True
            return web.json_response(answer, headers={"Server-Timing": self.server_timing()})
        server.in_flight += 1
        try:
            r = await self.proxy._request("POST", server.url + self.path, json=body, headers=self.headers)
            async with r:
                if r.status != 200:
                    text = await r.text()
                    status = r.status if 400 <= r.status < 500 else 502
                    raise UpstreamError("decode", server.url, status, _http_reason(r.status, text), detail=text[:2000])
                out = web.StreamResponse(
                    headers={
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache",
                        "Server-Timing": self.server_timing(),
                    }
                )
                await out.prepare(self.request)
                self.out = out
                pending = b""
                async for chunk in r.content.iter_any():
                    # A client that has gone raises here (or cancels this task): leaving the
                    # `async with` closes the upstream connection and vLLM aborts the request.
                    pending += chunk
                    while (end := pending.find(b"\n\n")) >= 0:
                        event, pending = pending[: end + 2], pending[end + 2 :]
                        if await self._event(out, server, event):
                            # The answer is whole: the client may close now, before the
                            # server ends its stream (leaving here closes the connection).
                            with contextlib.suppress(ConnectionError):
                                await out.write_eof()
                            return out
                    if len(pending) > MAX_EVENT_BYTES:
                        await out.write(pending)
                        pending = b""
                if pending:
                    await out.write(pending)
                await out.write_eof()
                self.delivered = True
                return out
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise  # the client went away: nothing to tell it
            server.down_until = time.monotonic() + DOWN_S
            if self.out is None and isinstance(err, aiohttp.ClientConnectorError):
                raise _Refused(f"{type(err).__name__}: {err}") from err
            detail = f"{type(err).__name__}: {err}"
            raise UpstreamError("decode", server.url, 502, "unreachable", detail=detail) from err
        finally:
            server.in_flight -= 1


@dataclass
class Serving:
    """A started proxy: its aiohttp runner and its listening server (`start`)."""

    runner: web.AppRunner
    server: asyncio.Server

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def cleanup(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def start(proxy: Proxy, host: str, port: int) -> Serving:
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream connection in flight (and vLLM aborts that request).
    runner = web.AppRunner(proxy.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    # Listened on here, not by a web.TCPSite: each connection goes through the proxy's
    # ClientGuard before aiohttp's handler sees it.
    server = await asyncio.get_running_loop().create_server(
        proxy.guard.protocol(runner.server), host, port, reuse_address=True
    )
    return Serving(runner, server)


def serve(
    prefills: Sequence[str],
    decodes: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    connector: str = "nixl",
    max_per_client: int = MAX_PER_CLIENT,
    head_s: float = HEAD_S,
) -> None:
    """Runs the proxy until interrupted."""
    proxy = Proxy(prefills, decodes, connector, guard=ClientGuard(head_s, max_per_client))

    async def main() -> None:
        serving = await start(proxy, host, port)
        try:
            await asyncio.Event().wait()
        finally:
            await serving.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


class ProxyThread:
    """The proxy on a free loopback port in a thread of this process (tests and benches)."""

    def __init__(
        self,
        prefills: Sequence[str],
        decodes: Sequence[str],
        connector: str = "nixl",
        host: str = "127.0.0.1",
        keepalive_s: float = KEEPALIVE_S,
        guard: Optional[ClientGuard] = None,
        body_s: float = BODY_S,
    ) -> None:
        self.proxy = Proxy(prefills, decodes, connector, keepalive_s=keepalive_s, guard=guard, body_s=body_s)
        self.host = host
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvferry-proxy", daemon=True)
        self._runner: Optional[Serving] = None

    def start(self) -> None:
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(start(self.proxy, self.host, 0), self._loop).result(30)
        self.url = f"http://{self.host}:{self._runner.port}"

    def in_flight(self) -> int:
        r = self.proxy.router
        return sum(s.in_flight for s in r.prefills + r.decodes)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
