"""kvferry proxy without vLLM (it needs only aiohttp, `kvferry[proxy]`), against stub upstreams
that answer as vLLM's OpenAI server does: its ``/health`` follows the upstreams' own, an idle
upstream connection the server closes is retried on a fresh one instead of failing the request,
and the proxy serves with vLLM and torch unimportable. The proxy with real vLLM servers is
tests/test_vllm_proxy.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp: pip install 'kvferry[proxy]'")

from aiohttp import web  # noqa: E402
from helpers import until  # noqa: E402
from kvferry.vllm.proxy import KEEPALIVE_S, ClientGuard, ProxyThread  # noqa: E402
from kvferry.vllm.testbed import call  # noqa: E402

COMPLETIONS = "/v1/completions"
# uvicorn's default HTTP keep-alive (vLLM's OpenAI server runs on uvicorn): an idle connection
# is closed after this many seconds.
UVICORN_KEEPALIVE_S = 5.0


class Upstream:
    """A stub vLLM server of one role (NixlConnector's answers) on a loopback port, in a thread.

    Its keep-alive runs out when the test says so: :meth:`expire` makes every connection that
    has served a request stale (the idle pause, forced instead of slept), and a stale
    connection is closed unanswered when the next request arrives on it, as when the server's
    close and the proxy's request cross on the wire. ``health``: the status its ``/health``
    answers."""

    def __init__(self, role: str, health: int = 200) -> None:
        self.role, self.health = role, health
        self.served: set[Any] = set()  # transports (connections) that answered a request
        self.stale: set[Any] = set()
        self.cut = 0  # requests that met a stale connection, closed without an answer
        self.answered = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        app = web.Application()
        app.router.add_post(COMPLETIONS, self._completion)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        self._run(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._run(site.start())
        self.url = "http://127.0.0.1:%d" % self._runner.addresses[0][1]

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def expire(self) -> None:
        async def expire() -> None:  # on the server's loop, as its own timer would
            self.stale |= self.served

        self._run(expire())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if request.transport in self.stale:
            self.cut += 1
            request.transport.close()  # type: ignore[union-attr]
            raise asyncio.CancelledError  # nothing is answered on a closed connection
        self.served.add(request.transport)
        self.answered += 1
        choice = {"index": 0, "text": self.role, "token_ids": [7], "finish_reason": "length"}
        if self.role == "prefill":
            return web.json_response({"choices": [choice], "kv_transfer_params": {"remote_engine_id": "e"}})
        if not body.get("stream"):
            return web.json_response({"choices": [choice]})
        # The stream in one body of known length: its end arrives with its [DONE], so the
        # connection always goes back to the proxy's pool (the proxy leaves at [DONE], and a
        # chunked stream whose last chunk came later would be closed instead, at random).
        events = f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n"
        return web.Response(text=events, content_type="text/event-stream")

    def stop(self) -> None:
        self._run(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@contextlib.contextmanager
def upstreams(*roles: str) -> Iterator[list[Upstream]]:
    made = [Upstream(role) for role in roles]
    try:
        yield made
    finally:
        for u in made:
            u.stop()


@contextlib.contextmanager
def dead_urls(n: int) -> Iterator[list[str]]:
    """URLs nothing answers: each port is held by a bound socket that never listens, so a
    connection is refused at once and no other socket can take the port meanwhile."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]


@contextlib.contextmanager
def proxy(prefills: list[str], decodes: list[str], **options: Any) -> Iterator[ProxyThread]:
    p = ProxyThread(prefills, decodes, **options)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}


def test_health_follows_the_upstreams() -> None:
    """200 while a prefill and a decode server answer their own /health; 503 naming the role
    whose servers are all down; the servers down named by their place in the flags, not by
    URL (any client may ask)."""
    with upstreams("prefill", "decode") as (p, d), dead_urls(2) as (dead, dead2):
        with proxy([p.url], [d.url]) as px:
            assert health(px.url) == (
                200,
                {
                    "status": "ok",
                    "connector": "nixl",
                    "prefill": {"up": 1, "of": 1, "down": []},
                    "decode": {"up": 1, "of": 1, "down": []},
                },
            )
            d.health = 500  # vLLM's /health answers 500 once its engine died
            status, body = health(px.url)
            assert status == 503 and body["status"] == "unavailable"
            assert body["reason"] == "every decode server is down (1 of 1)"
            assert body["decode"] == {"up": 0, "of": 1, "down": [{"index": 0, "reason": "HTTP 500"}]}
            d.health = 200
        with proxy([dead, p.url], [d.url]) as px:
            status, body = health(px.url)
            assert status == 200 and body["status"] == "degraded" and "reason" not in body
            assert body["prefill"] == {"up": 1, "of": 2, "down": [{"index": 0, "reason": "unreachable"}]}
        with proxy([dead], [dead2]) as px:
            status, body = health(px.url)
            assert status == 503 and body["reason"] == (
                "every prefill server is down (1 of 1); every decode server is down (1 of 1)"
            )
            assert p.url not in json.dumps(body) and dead.split(":")[-1] not in json.dumps(body)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_idle_connection_the_upstream_closed_is_retried_on_a_fresh_one(stream: bool) -> None:
    """Both upstreams close their idle connections (the pause forced with ``expire``, standing
    for uvicorn's keep-alive running out); the next request crosses each close on the wire and
    goes once more on a fresh connection: served, and neither server is marked down. (Before,
    ``Server disconnected`` failed it with 502 "unreachable".) The proxy keeps its idle
    connections for an hour here, so the request surely meets the closed one."""
    with upstreams("prefill", "decode") as (p, d), proxy([p.url], [d.url], keepalive_s=3600.0) as px:
        # Turns 1 and 3 meet the connection the turn before left in the pool, closed meanwhile
        # (a retry's fresh connection is not kept, so turn 2 opens the one turn 3 meets).
        for turn in range(4):
            if turn % 2:
                p.expire()
                d.expire()
            a = call(px.url, COMPLETIONS, dict(BODY, stream=stream))
            assert a.status == 200, a.body
            assert a.token_ids == [7]
        assert (p.cut, d.cut) == (2, 2) and (p.answered, d.answered) == (4, 4)
        assert px.proxy.retries == 4
        assert all(s.down_until == 0 for s in px.proxy.router.prefills + px.proxy.router.decodes)


HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Le"  # a head never finished


def _connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))


def _half_head(url: str, source: str) -> socket.socket:
    """A connection from ``source`` (an address of the loopback's 127/8) that sent part of a
    request head and stops there, as a slowloris client does."""
    sock = _connect(url, source)
    sock.sendall(HALF_HEAD)
    return sock


def _closed_by_proxy(sock: socket.socket) -> bool:
    """Whether the proxy closed ``sock``: reads what is left of an answer, then waits for the
    end, at most the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_one_client_holds_a_bounded_number_of_connections() -> None:
    """A client at 127.0.0.2 opens half-sent requests, which a client then held until it
    closed them: at MAX_PER_CLIENT (4 here) its next connection is closed on arrival, while a
    client at another address is served; once one of its connections ends it may open one
    again, and be served on it."""
    guard = ClientGuard(head_s=3600.0, max_per_client=4)
    with upstreams("prefill", "decode") as (p, d), proxy([p.url], [d.url], guard=guard) as px:
        held = [_half_head(px.url, "127.0.0.2") for _ in range(4)]
        extra = _half_head(px.url, "127.0.0.2")
        assert _closed_by_proxy(extra) and guard.turned_away == 1
        assert call(px.url, COMPLETIONS, BODY).status == 200  # another address: served
        held.pop().close()
        assert until(lambda: guard.per_client["127.0.0.2"] == 3)
        again = _connect(px.url, "127.0.0.2")
        body = json.dumps(BODY).encode()
        again.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert again.recv(12) == b"HTTP/1.1 200"
        for sock in [*held, extra, again]:
            sock.close()


def test_a_request_head_not_whole_in_time_is_cut_off() -> None:
    """A half-sent head is closed HEAD_S (here 1 s) after its connection opened, and counted;
    a kept-alive connection idle past IDLE_S (here 1 s) after its answer too. A whole request
    is served."""
    guard = ClientGuard(head_s=1.0, max_per_client=64, idle_s=1.0)
    with upstreams("prefill", "decode") as (p, d), proxy([p.url], [d.url], guard=guard) as px:
        slow = _half_head(px.url, "127.0.0.1")
        assert _closed_by_proxy(slow) and guard.late_heads == 1
        assert call(px.url, COMPLETIONS, BODY).status == 200
        kept = _connect(px.url)
        body = json.dumps(BODY).encode()
        kept.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert kept.recv(12) == b"HTTP/1.1 200"
        assert _closed_by_proxy(kept) and guard.idle_closed == 1 and guard.late_heads == 1  # idle after its answer
        for sock in (slow, kept):
            sock.close()
        with pytest.raises(ValueError, match="max_per_client must be an int >= 1, got 0"):
            ClientGuard(max_per_client=0)


def test_a_body_not_whole_in_time_is_answered_408() -> None:
    """A whole head announcing a body that never comes whole: 408 once ``body_s`` passed."""
    with upstreams("prefill", "decode") as (p, d), proxy([p.url], [d.url], body_s=0.5) as px:
        sock = _connect(px.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")  # fmt: skip
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"not received whole within 0.5 s" in answer, answer
        sock.close()


def test_idle_connections_are_dropped_before_the_upstreams_keep_alive() -> None:
    """The pool forgets an idle connection well before uvicorn closes it: the retry is for a
    close that crosses a request, not the common case."""
    assert 0 < KEEPALIVE_S < UVICORN_KEEPALIVE_S / 2
    with upstreams("prefill", "decode") as (p, d), proxy([p.url], [d.url]) as px:
        assert call(px.url, COMPLETIONS, BODY).status == 200
        assert px.proxy.client is not None
        assert px.proxy.client.connector._keepalive_timeout == KEEPALIVE_S  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"keepalive_s must be > 0, got 0"):
        ProxyThread(["http://a"], ["http://b"], keepalive_s=0)


PROXY_WITHOUT_VLLM = """
import json, sys, urllib.request
sys.modules.update(vllm=None, torch=None)  # an import of either now fails, as where neither is installed
from kvferry.cli import build_parser
from kvferry.vllm.proxy import ProxyThread
from kvferry.vllm.testbed import call

build_parser().parse_args(["proxy", "--prefill", sys.argv[1], "--decode", sys.argv[2], "--port", "1"])
proxy = ProxyThread([sys.argv[1]], [sys.argv[2]], connector="nixl")
proxy.start()
with urllib.request.urlopen(proxy.url + "/health", timeout=30) as r:
    health = r.status
answer = call(proxy.url, "/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": 2})
proxy.stop()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch") and sys.modules[m] is not None)
print(json.dumps({"health": health, "status": answer.status, "loaded": loaded}))
"""


def test_the_proxy_runs_without_vllm_or_torch() -> None:
    """What `kvferry proxy` loads serves a request where vLLM and torch cannot be imported
    (a venv with `kvferry[proxy]` only)."""
    with upstreams("prefill", "decode") as (p, d):
        done = subprocess.run(
            [sys.executable, "-c", PROXY_WITHOUT_VLLM, p.url, d.url], capture_output=True, text=True, check=False
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"health": 200, "status": 200, "loaded": []}


def test_the_cli_defaults_are_the_proxys() -> None:
    from kvferry.cli import build_parser
    from kvferry.vllm.proxy import HEAD_S, MAX_PER_CLIENT

    args = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "1"])
    assert (args.max_client_connections, args.head_timeout) == (MAX_PER_CLIENT, HEAD_S)
