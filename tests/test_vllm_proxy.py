"""kvferry proxy in front of real vLLM servers (a prefill and a decode server, with vLLM's
NixlConnector and with kvferry's KvferryConnector), checked
against a plain single server: greedy outputs token for token over multi-turn sessions
(completions and chat, streaming and not), the decode server's prefix cache on the next turn,
a client that leaves mid-stream, and dead upstreams. Routing rules run against stub upstreams.

Needs vLLM (``make setup-vllm && make test-vllm``); skipped where it is not importable.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import random
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make setup-vllm; make test-vllm runs these)")
pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (it comes with vLLM)")

from aiohttp import web  # noqa: E402
from kvferry.vllm import testbed, trust  # noqa: E402
from kvferry.vllm.config import load_authkey  # noqa: E402
from kvferry.vllm.proxy import SESSION_HEADER, ProxyThread, session_of  # noqa: E402
from kvferry.vllm.rendezvous import UNCLAIMED  # noqa: E402
from kvferry.vllm.testbed import Answer, Testbed, call  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import metric_total  # noqa: E402
from vllm_harness import wait_until  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testbed.build_tiny_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[testbed.Server]:
    """A plain server (no connector): the reference. Started here, waited for by ``servers`` so
    that it comes up together with the first pair."""
    server = testbed.start_server("plain", model, tmp_path_factory.mktemp("plain"))
    yield server
    server.stop()


@pytest.fixture(scope="module", params=sorted(testbed.CONNECTORS))
def servers(
    request: pytest.FixtureRequest, plain: testbed.Server, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[testbed.Server, Testbed]]:
    """The plain server and a prefill/decode pair of one connector behind the proxy (one pair
    at a time: each connector's tests run together)."""
    prefill_config, decode_config = testbed.CONNECTORS[request.param]
    with Testbed(
        model, tmp_path_factory.mktemp(request.param), prefill_config, decode_config, proxy_connector=request.param
    ) as bed:
        testbed.wait_ready([plain])
        yield plain, bed


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, testbed.VOCAB) for _ in range(n)]


def _conversation(
    base: str, path: str, stream: bool, seed: int, turns: int = 3, headers: dict[str, str] | None = None
) -> list[Answer]:
    """A multi-turn session: each turn's prompt is the last prompt, the last answer and new
    tokens (completions: token ids; chat: messages)."""
    rng = random.Random(seed)
    answers: list[Answer] = []
    prompt: list[int] = _tokens(rng, 200)
    messages: list[dict[str, str]] = [{"role": "system", "content": "you are a tool-using agent " * 8}]
    for turn in range(turns):
        body: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if path == COMPLETIONS:
            body["prompt"] = prompt
        else:
            messages.append(
                {"role": "user", "content": f"tool output {seed}-{turn}: " + "data " * rng.randrange(20, 60)}
            )
            body["messages"] = messages
        answer = call(base, path, body, headers=headers)
        assert answer.status == 200, answer.body
        answers.append(answer)
        prompt = prompt + answer.token_ids + _tokens(rng, 70)
        messages = messages + [{"role": "assistant", "content": answer.text}]
    return answers


def _used(bed: Testbed) -> list[int]:
    return [s.kv_blocks()[0] for s in bed.servers()]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_outputs_equal_plain_server(servers: tuple[testbed.Server, Testbed], path: str, stream: bool) -> None:
    plain, bed = servers
    seed = (10 if path == COMPLETIONS else 20) + int(stream)
    want = _conversation(plain.url, path, stream, seed)
    hellos = getattr(bed.proxy.proxy.flow, "hellos", 0)
    got = _conversation(bed.url, path, stream, seed, headers={SESSION_HEADER: f"s{seed}"})
    if bed.proxy_connector == "kvferry":
        assert bed.proxy.proxy.flow.hellos == max(hellos, 1)  # served turns never make it ask again
    for turn, (w, g) in enumerate(zip(want, got)):
        assert len(w.token_ids) == 12, w.body
        assert g.token_ids == w.token_ids, f"turn {turn}"
        assert g.text == w.text, f"turn {turn}"
    # Random weights still give varied tokens: the comparison is not between constant streams.
    assert len({t for a in want for t in a.token_ids}) > 6
    wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks after the session")


def test_next_turn_hits_decode_prefix_cache(servers: tuple[testbed.Server, Testbed]) -> None:
    """The session's second turn reaches the same decode server, which then pulls only the
    tokens past its own prefix-cache hit (the decode-warm case)."""
    _, bed = servers
    decode = bed.decodes[0]

    def hits() -> float:
        return metric_total(decode.metrics(), "vllm:prefix_cache_hits_total")

    before = hits()
    answers = _conversation(bed.url, COMPLETIONS, False, seed=7, turns=2, headers={SESSION_HEADER: "warm"})
    assert all(len(a.token_ids) == 12 for a in answers)
    # Turn 2's prompt starts with turn 1's 200 + 12 tokens: at least 6 full blocks of 32 hit.
    assert hits() - before >= 6 * 32


def test_client_disconnect_mid_stream_frees_kv(servers: tuple[testbed.Server, Testbed]) -> None:
    _, bed = servers
    decode = bed.decodes[0]
    # vLLM counts finished requests by reason but not aborted ones: an abort shows as the
    # running gauge going to zero with no request finished. A first request makes the proxy's
    # one-off requests (kvferry's hello) happen before the count is taken; vLLM records a
    # request's stats before its answer leaves.
    assert (
        call(bed.url, COMPLETIONS, {"model": "tiny", "prompt": [4] * 40, "max_tokens": 2, "temperature": 0}).status
        == 200
    )
    finished = metric_total(decode.metrics(), "vllm:request_success_total")
    host, port = bed.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "tiny", "prompt": _tokens(random.Random(3), 300), "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = 0
    while events < 3:
        if r.readline().startswith(b"data:"):
            events += 1
    # The decode is running and holds the request's blocks: now the client goes away.
    assert decode.kv_blocks()[0] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(
        lambda: metric_total(decode.metrics(), "vllm:num_requests_running") == 0,
        "the decode server to drop the request",
    )
    assert metric_total(decode.metrics(), "vllm:request_success_total") == finished  # aborted, not run to the end
    wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks")
    wait_until(lambda: bed.proxy.in_flight() == 0, "the proxy to have no upstream call in flight")
    # And the proxy still serves.
    assert (
        call(bed.url, COMPLETIONS, {"model": "tiny", "prompt": [5] * 40, "max_tokens": 2, "temperature": 0}).status
        == 200
    )


def _error_of(a: Answer) -> dict[str, Any]:
    """The error the client got: a whole answer's JSON error (HTTP 502), or a stream's last
    event before [DONE] (HTTP 200: the stream had started)."""
    if a.status == 200:
        assert isinstance(a.body, list) and a.body and "error" in a.body[-1], a.body
        return dict(a.body[-1]["error"])
    assert a.status == 502, (a.status, a.body)
    return dict(a.body["error"])


def _kvferry_only(bed: Testbed) -> None:
    if bed.proxy_connector != "kvferry":
        pytest.skip("KvferryConnector's status op")


def test_failed_transfer_reason_reaches_the_client(servers: tuple[testbed.Server, Testbed], tmp_path: Path) -> None:
    """Real servers: a transfer that fails on the decode side (its prefill side gives up) and
    one that fails on the prefill side (the decode peer it is given is unreachable); the
    client's error names the server, the transfer and the reason."""
    _, bed = servers
    _kvferry_only(bed)
    prefill, decode = bed.prefills[0], bed.decodes[0]
    body = {"model": "tiny", "prompt": _tokens(random.Random(12), 100), "max_tokens": 4, "temperature": 0}
    # The decode side: a prefill server that gives the transfer up at once (it tells the
    # decode server's rendezvous, as a prefill request aborted before its first chunk does).
    quitter = _Stub("prefill", abandon="the stub prefill server gave up")
    proxy = ProxyThread([quitter.url], [decode.url], connector="kvferry")
    proxy.start()
    try:
        for stream in (False, True):
            a = call(proxy.url, COMPLETIONS, dict(body, stream=stream))
            assert a.status == (200 if stream else 502), a.body
            error = _error_of(a)
            transfer = quitter.seen[-1]["kv_transfer_params"]["kvferry"]["transfer"]
            assert error["leg"] == "decode" and error["transfer"] == transfer and "server" not in error
            assert error["message"].startswith(
                f"decode server: transfer {transfer} failed: the prefill side gave up: the stub prefill server gave up"
            ), error
    finally:
        proxy.stop()
        quitter.stop()
    # The decode server answers status itself: the failure, an unknown id, bad input refused.
    assert _status(decode.url, transfer) == {
        "op": "status",
        "transfer": transfer,
        "state": "failed",
        "error": "the prefill side gave up: the stub prefill server gave up",
    }
    assert _status(decode.url, "never-seen") == {"op": "status", "transfer": "never-seen", "state": "unknown"}
    # The prefill side: the decode peer it is sent to is unreachable.
    nobody = f"unix://{tmp_path / 'nobody.sock'}"
    lost = ProxyThread([prefill.url], [decode.url], connector="kvferry")
    lost.start()
    try:
        for stream in (False, True):
            # What the proxy knows of the decode server (its hello answer) names a dead address.
            # Signed with the servers' key: an unsigned address would be refused before any connection.
            signed = trust.sign_peer(load_authkey(), nobody)
            lost.proxy.flow.peers[decode.url] = {
                "role": "kv_consumer",
                "peer": nobody,
                "peer_mac": signed,
                "engine": "gone",
            }  # type: ignore[attr-defined]
            error = _error_of(call(lost.url, COMPLETIONS, dict(body, stream=stream)))
            transfer = error["transfer"]
            assert error["leg"] == "prefill", error
            assert error["message"].startswith(
                f"prefill server: transfer {transfer} failed: request refused: no destination for transfer "
                f"{transfer!r}: "
            ), error
            # The reason, without the internal address (the proxy logs it).
            assert "cannot reach the decode server's rendezvous at '<address>'" in error["message"], error
            assert nobody not in error["message"] and prefill.url not in error["message"], error
            assert _status(prefill.url, transfer)["state"] == "failed"
        wait_until(lambda: lost.in_flight() == 0, "the proxy to have no upstream call in flight")
    finally:
        lost.stop()
    wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks")
    # And the pair still serves through its own proxy.
    assert call(bed.url, COMPLETIONS, body).status == 200


def _status(url: str, transfer: Any) -> dict[str, Any]:
    a = call(
        url,
        COMPLETIONS,
        {
            "model": "tiny",
            "prompt": [0],
            "max_tokens": 1,
            "kv_transfer_params": {"kvferry": {"op": "status", "transfer": transfer}},
        },
    )
    assert a.status == 200, a.body
    return dict(a.body["kv_transfer_params"]["kvferry"])


def test_status_op_refuses_bad_input(servers: tuple[testbed.Server, Testbed]) -> None:
    """A status request whose parameters are wrong fails like any refused kvferry request
    (vLLM's error answer, a log line naming the field and value); the server goes on."""
    _, bed = servers
    _kvferry_only(bed)
    decode = bed.decodes[0]
    for params, named in [
        ({"op": "status"}, "invalid kv_transfer_params.kvferry.transfer=None"),
        ({"op": "status", "transfer": 7}, "invalid kv_transfer_params.kvferry.transfer=7"),
        ({"op": "status", "transfer": ""}, "invalid kv_transfer_params.kvferry.transfer=''"),
        (
            {"op": "status", "transfer": "t", "peer": "/x"},
            "invalid kv_transfer_params.kvferry keys ['peer'] for op 'status'",
        ),
    ]:
        a = call(
            decode.url,
            COMPLETIONS,
            {"model": "tiny", "prompt": [0], "max_tokens": 1, "kv_transfer_params": {"kvferry": params}},
        )
        assert a.status == 500, a.body
        wait_until(lambda: named in decode.log_tail(200000), f"the decode server's log to name {named!r}")
    assert _status(decode.url, "t")["state"] == "unknown"  # a refused status request marks nothing failed


def test_a_forged_peer_through_the_http_port_is_never_connected_to(servers: tuple[testbed.Server, Testbed]) -> None:
    """An HTTP client of the prefill server names an address of its own as the decode peer
    (unsigned, or with another address's signature): the request fails as untrusted, the
    address sees no connection (no server-side request forgery, no relay), and the pair still
    serves."""
    _, bed = servers
    _kvferry_only(bed)
    prefill = bed.prefills[0]
    with socket.create_server(("127.0.0.1", 0)) as bait:
        url = f"tcp://127.0.0.1:{bait.getsockname()[1]}"
        other = trust.sign_peer(load_authkey(), "tcp://127.0.0.1:1")
        for n, extra in enumerate([{}, {"peer_mac": other}]):
            transfer = f"forged-{n}"
            params = {"kvferry": {"op": "send", "transfer": transfer, "peer": url, **extra}}
            prompt = _tokens(random.Random(30 + n), 40)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
            assert call(prefill.url, COMPLETIONS, body).status == 500
            status = _status(prefill.url, transfer)
            assert status["state"] == "failed" and "not a trusted decode server" in status["error"], status
        bait.setblocking(False)
        with pytest.raises(BlockingIOError):
            bait.accept()  # nothing ever connected
    good = {"model": "tiny", "prompt": _tokens(random.Random(33), 40), "max_tokens": 2, "temperature": 0}
    assert call(bed.url, COMPLETIONS, good).status == 200


@contextlib.contextmanager
def _dead_urls(n: int) -> Iterator[list[str]]:
    """``n`` URLs that nothing answers, for as long as the block runs. Each port is held by a
    socket that is bound but never listens: a connection to it is refused at once, and the port
    can be handed to no other socket meanwhile. (A port only picked free and closed again could
    be taken by a later bind, or be chosen as the source port of the proxy's own connection to
    it: on loopback that connects to itself, and the proxy reads its own request as an answer.)"""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]


def test_dead_upstream_gives_clear_error_and_proxy_keeps_serving(servers: tuple[testbed.Server, Testbed]) -> None:
    plain, bed = servers
    body = {"model": "tiny", "prompt": _tokens(random.Random(11), 90), "max_tokens": 6, "temperature": 0}
    want = call(plain.url, COMPLETIONS, body)
    with _dead_urls(2) as (dead, dead_decode):
        _dead_upstreams(bed, body, want, dead, dead_decode)
    wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks")


def _dead_upstreams(bed: Testbed, body: dict[str, Any], want: Any, dead: str, dead_decode: str) -> None:
    lone = ProxyThread([dead], [bed.decodes[0].url], connector=bed.proxy_connector or "")
    lone.start()
    try:
        for stream in (False, True):
            a = call(lone.url, COMPLETIONS, dict(body, stream=stream))
            # A stream whose headers went out first (the decode leg answers them at once; on a
            # loaded host before the dead prefill is found out) reports it as its last event.
            error = a.body["error"] if a.status == 502 else a.body[-1]["error"]
            assert a.status == 502 or (stream and a.status == 200 and a.token_ids == []), a
            assert error["leg"] == "prefill" and error["message"] == "prefill server: unreachable", a
        # The proxy itself stays up and answers.
        assert call(lone.url, COMPLETIONS, body).status == 502
    finally:
        lone.stop()
    # With a live server next to each dead one, every request is served, whatever the order.
    mixed = ProxyThread(
        [dead, bed.prefills[0].url], [dead_decode, bed.decodes[0].url], connector=bed.proxy_connector or ""
    )
    mixed.start()
    try:
        for i in range(3):
            a = call(mixed.url, COMPLETIONS, dict(body, stream=bool(i % 2)), headers={SESSION_HEADER: f"m{i}"})
            assert a.status == 200, a.body
            assert a.token_ids == want.token_ids
    finally:
        mixed.stop()


# ---- routing rules against stub upstreams (no engine) ---------------------------------------


class _Stub:
    """An upstream that answers like a vLLM server of the given role and records requests.
    kvferry's protocol: answers ``hello`` and ``status`` (from ``outcomes``: transfer -> its
    status answer, else ``unknown``); with ``hang_recv`` a ``recv`` request waits (for blocks
    that never come) until its connection closes; with ``fail_recv`` a ``recv`` request ends
    as vLLM ends one it finished with finish_reason "error" (HTTP 500, or a stream's error
    event) and its transfer's status says ``fail_recv``; with ``fail_after`` a prefill
    request fails once that stub has seen a request (its transfer's status then says
    ``fail_status``, when given); with ``hold_recv`` (an event) a ``recv`` request is
    answered only once it is set; with ``linger`` a stream stays open after its ``[DONE]``
    until the connection closes (vLLM ends its stream a moment later). ``status_answered`` is
    set once the stub answered a ``status`` request."""

    def __init__(self, role: str, cut_stream: bool = False, hang_recv: bool = False, fail_after: _Stub | None = None,
                 fail_recv: str | None = None, linger: bool = False, abandon: str | None = None) -> None:  # fmt: skip
        self.role, self.cut_stream, self.hang_recv, self.fail_after = role, cut_stream, hang_recv, fail_after
        self.fail_recv, self.linger = fail_recv, linger
        self.remember = True  # fail_recv: the status answer knows the failed transfer
        self.abandon = abandon
        self.fail_status: str | None = None
        self.hold_recv: threading.Event | None = None
        self.status_answered = threading.Event()
        self.seen: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []  # each seen request's X-Request-Id header
        self.hellos = 0
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.status_asked: list[str] = []
        self.closed = threading.Event()  # a hanging request's connection was closed
        self.got = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        asyncio.run_coroutine_threadsafe(self._runner.setup(), self._loop).result(10)
        self.port = testbed.free_port()
        asyncio.run_coroutine_threadsafe(web.TCPSite(self._runner, "127.0.0.1", self.port).start(), self._loop).result(
            10
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        op = ((body.get("kv_transfer_params") or {}).get("kvferry") or {}).get("op")
        if op == "hello":
            self.hellos += 1
            return web.json_response({"choices": [], "kv_transfer_params": {"kvferry": {
                "op": "hello", "role": "kv_consumer", "peer": f"/tmp/peer-{self.port}",
                "peer_mac": f"{self.port:064x}", "engine": "e1"}}})  # fmt: skip
        if op == "status":
            transfer = body["kv_transfer_params"]["kvferry"]["transfer"]
            self.status_asked.append(transfer)
            known = self.outcomes.get(transfer, {"state": "unknown"})
            answer = web.json_response(
                {"choices": [], "kv_transfer_params": {"kvferry": {"op": "status", "transfer": transfer, **known}}}
            )
            self.status_answered.set()
            return answer
        self.seen.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        self.got.set()
        if op == "recv" and self.fail_recv is not None:
            if self.remember:
                self.outcomes[body["kv_transfer_params"]["kvferry"]["transfer"]] = {
                    "state": "failed",
                    "error": self.fail_recv,
                }
            vllm_error = {
                "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
            }
            if not body.get("stream"):
                return web.json_response(vllm_error, status=500)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(f"data: {json.dumps(vllm_error)}\n\ndata: [DONE]\n\n".encode())
            return out
        if op == "send" and self.abandon is not None:
            from kvferry.vllm import rendezvous
            from kvferry.vllm.config import load_authkey

            ours = body["kv_transfer_params"]["kvferry"]
            await asyncio.get_running_loop().run_in_executor(
                None, rendezvous.abandon, ours["peer"], load_authkey(), ours["transfer"], self.abandon
            )
            answer = {"op": "send", "transfer": ours["transfer"], "error": self.abandon}
            return web.json_response(
                {
                    "choices": [{"index": 0, "text": "", "token_ids": [1], "finish_reason": "length"}],
                    "kv_transfer_params": {"kvferry": answer},
                }
            )
        if op == "recv" and self.hang_recv:
            try:
                await asyncio.Event().wait()
            finally:
                self.closed.set()
        if op == "recv" and self.hold_recv is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.hold_recv.wait, 30)
        if self.fail_after is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.fail_after.got.wait, 30)
            if self.fail_status is not None:
                transfer = body["kv_transfer_params"]["kvferry"]["transfer"]
                self.outcomes[transfer] = {"state": "failed", "error": self.fail_status.replace("<T>", transfer)}
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        choice = {"index": 0, "text": self.role, "token_ids": [1], "finish_reason": "length"}
        if op == "send":
            return web.json_response(
                {
                    "choices": [choice],
                    "kv_transfer_params": {
                        "kvferry": {"op": "send", "transfer": body["kv_transfer_params"]["kvferry"]["transfer"]}
                    },
                }
            )
        if self.role == "prefill":
            return web.json_response({"choices": [choice], "kv_transfer_params": {"remote_engine_id": self.url}})
        if not body.get("stream"):
            return web.json_response({"choices": [choice]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.cut_stream:
            request.transport.close()  # the decode server dies mid-stream
            return out
        await out.write(b"data: [DONE]\n\n")
        if self.linger:
            await asyncio.Event().wait()  # until the connection closes (which cancels this handler)
        return out

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def stubs() -> Iterator[tuple[list[_Stub], list[_Stub]]]:
    prefills, decodes = [_Stub("prefill") for _ in range(2)], [_Stub("decode") for _ in range(3)]
    yield prefills, decodes
    for s in prefills + decodes:
        s.stop()


def test_sessions_stick_to_one_decode_server(stubs: tuple[list[_Stub], list[_Stub]]) -> None:
    prefills, decodes = stubs
    proxy = ProxyThread([s.url for s in prefills], [s.url for s in decodes])
    proxy.start()
    try:

        def owner(body: dict[str, Any], headers: dict[str, str]) -> int:
            counts = [len(d.seen) for d in decodes]
            a = call(proxy.url, COMPLETIONS, body, headers=headers)
            assert a.status == 200
            # Server-Timing: the decode leg went out after the prefill leg ended.
            assert 0 < a.timing["prefill"] <= a.timing["decode-start"]
            moved = [i for i, d in enumerate(decodes) if len(d.seen) > counts[i]]
            assert len(moved) == 1
            return moved[0]

        base = {"model": "tiny", "max_tokens": 3}
        # Named sessions: header first, then `user`; each keeps its server over turns.
        by_header = {f"h{i}": owner(dict(base, prompt=[i] * 10), {SESSION_HEADER: f"h{i}"}) for i in range(3)}
        assert sorted(by_header.values()) == [0, 1, 2]  # new sessions spread over idle servers
        for turn in range(3):
            for name, server in by_header.items():
                assert owner(dict(base, prompt=[turn + 7] * (20 + turn)), {SESSION_HEADER: name}) == server
        first = owner(dict(base, prompt=[1], user="alice"), {})
        assert all(owner(dict(base, prompt=[2] * n, user="alice"), {}) == first for n in (5, 50))
        # No name: turns that extend the same prompt start stay together.
        start = list(range(100))
        server = owner(dict(base, prompt=start), {})
        assert owner(dict(base, prompt=start + [9] * 40), {}) == server
        # The decode server got the prefill server's kv_transfer_params; the prefill leg was
        # cut to one token and not streamed.
        assert all(
            b["kv_transfer_params"]["remote_engine_id"] in {p.url for p in prefills} for d in decodes for b in d.seen
        )
        assert all(
            b["max_tokens"] == 1 and b["stream"] is False and b["kv_transfer_params"]["do_remote_decode"]
            for p in prefills
            for b in p.seen
        )
        assert min(len(p.seen) for p in prefills) > 0  # the prefill servers share the work
        # Both legs of a request carry one X-Request-Id, a fresh one per request (vLLM's
        # NixlPushConnector pairs the decode server's registration with the prefill by it).
        sent = [i for p in prefills for i in p.request_ids]
        got = [i for d in decodes for i in d.request_ids]
        assert None not in sent and sorted(sent) == sorted(got) and len(set(sent)) == len(sent)
    finally:
        proxy.stop()


def test_prefill_leg_runs_one_sample() -> None:
    """The decode leg keeps ``n`` / ``best_of``; the prefill leg computes the prompt once (one
    sample per prefill request would race to send one transfer)."""
    from kvferry.vllm.proxy import _one_token

    body = {
        "model": "tiny",
        "prompt": [1, 2],
        "n": 3,
        "best_of": 4,
        "max_tokens": 9,
        "stream": True,
        "temperature": 0.7,
    }
    assert _one_token(body) == {"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "stream": False, "temperature": 0.7}
    assert body["n"] == 3 and body["best_of"] == 4  # the client's request is left as it was


def test_session_of_order() -> None:
    assert session_of({SESSION_HEADER: "a"}, {"user": "b", "prompt": "x"}) == "h:a"
    assert session_of({}, {"user": "b", "prompt": "x"}) == "u:b"
    assert session_of({}, {"prompt": list(range(64)) + [1]}) == session_of({}, {"prompt": list(range(64)) + [2, 3]})
    assert session_of({}, {"prompt": [1, 2]}) != session_of({}, {"prompt": [1, 3]})
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert session_of({}, {"messages": msgs}) == session_of(
        {}, {"messages": msgs + [{"role": "assistant", "content": "a"}]}
    )


def test_decode_dying_mid_stream_ends_stream_with_error_event() -> None:
    prefill, decode = _Stub("prefill"), _Stub("decode", cut_stream=True)
    proxy = ProxyThread([prefill.url], [decode.url])
    proxy.start()
    try:
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [1, 2], "max_tokens": 5, "stream": True})
        assert a.status == 200
        assert a.token_ids == [1]  # what arrived before the cut is delivered
        assert a.body[-1]["error"]["leg"] == "decode" and decode.url not in a.body[-1]["error"]["message"]
        assert proxy.in_flight() == 0
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_bad_requests_and_arguments(stubs: tuple[list[_Stub], list[_Stub]]) -> None:
    prefills, decodes = stubs
    with pytest.raises(ValueError, match="prefills must name at least one server"):
        ProxyThread([], [decodes[0].url])
    with pytest.raises(ValueError, match="connector must be one of"):
        ProxyThread([prefills[0].url], [decodes[0].url], connector="carrier-pigeon")
    with pytest.raises(ValueError, match="must start with http"):
        ProxyThread(["localhost:8000"], [decodes[0].url])
    proxy = ProxyThread([prefills[0].url], [decodes[0].url])
    proxy.start()
    try:
        host, port = proxy.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", COMPLETIONS, b"{not json", {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 400 and "not JSON" in json.loads(r.read())["error"]["message"]
        assert prefills[0].seen == []
    finally:
        proxy.stop()


def test_kvferry_flow_pairs_legs_and_discovers_once(stubs: tuple[list[_Stub], list[_Stub]]) -> None:
    prefills, decodes = stubs
    # As vLLM does, the decode server ends each stream only after its [DONE] (here: never), so
    # the client, which stops reading at [DONE] and closes, leaves while the proxy's decode
    # leg is still open (as `kvferry bench vllm`'s streamed multi-turn sessions did).
    decodes[0].linger = True
    proxy = ProxyThread([prefills[0].url], [decodes[0].url], connector="kvferry")
    proxy.start()
    try:
        prompt = [1] * 40
        streams = (False, True, True, True, False, True)
        for turn, stream in enumerate(streams):
            a = call(
                proxy.url,
                COMPLETIONS,
                {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream},
                headers={SESSION_HEADER: "agent"},
            )
            assert a.status == 200 and a.token_ids == [1]
            assert a.timing["decode-start"] > 0
            prompt = prompt + a.token_ids + [turn + 2] * 30
        # Discovered once: a streamed answer's client closing at the end does not drop it.
        wait_until(lambda: proxy.in_flight() == 0, "the proxy to have no upstream call in flight")
        assert decodes[0].hellos == 1
        assert proxy.proxy.flow.hellos == 1  # type: ignore[attr-defined]
        assert list(proxy.proxy.flow.peers) == [decodes[0].url]  # type: ignore[attr-defined]
        assert decodes[0].status_asked == []  # nothing failed: no status question
        n = len(streams)
        sends = [b["kv_transfer_params"]["kvferry"] for b in prefills[0].seen]
        recvs = [b["kv_transfer_params"]["kvferry"] for b in decodes[0].seen]
        assert [r["op"] for r in recvs] == ["recv"] * n and [s["op"] for s in sends] == ["send"] * n
        assert [s["transfer"] for s in sends] == [r["transfer"] for r in recvs]
        assert len({r["transfer"] for r in recvs}) == n
        # No key; the decode server's signature of its address passed on with it (kvferry.vllm.trust).
        mac = f"{decodes[0].port:064x}"
        assert all(
            s == {"op": "send", "transfer": s["transfer"], "peer": f"/tmp/peer-{decodes[0].port}", "peer_mac": mac}
            for s in sends
        )
        assert all(b["max_tokens"] == 1 and b["stream"] is False for b in prefills[0].seen)
        assert [b["prompt"] for b in prefills[0].seen] == [b["prompt"] for b in decodes[0].seen]
    finally:
        proxy.stop()


def test_kvferry_flow_failed_prefill_cancels_decode_leg() -> None:
    decode = _Stub("decode", hang_recv=True)
    prefill = _Stub("prefill", fail_after=decode)  # fails once the decode leg is waiting
    proxy = ProxyThread([prefill.url], [decode.url], connector="kvferry")
    proxy.start()
    try:
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [3] * 40, "max_tokens": 4, "stream": True})
        assert a.status == 502 and a.body["error"]["leg"] == "prefill"
        # What the upstream answered is logged, not passed on: only its status.
        assert "HTTP 500" in a.body["error"]["message"] and "engine dead" not in a.body["error"]["message"]
        # Its status was asked (its answer, an error again, is named too).
        assert a.body["error"]["transfer"] == prefill.seen[-1]["kv_transfer_params"]["kvferry"]["transfer"]
        assert decode.closed.wait(30)  # the decode leg's connection was closed: vLLM aborts it
        wait_until(lambda: proxy.in_flight() == 0, "the proxy to have no upstream call in flight")
        assert proxy.proxy.flow.peers == {}  # type: ignore[attr-defined]  # asked again next time
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_kvferry_flow_keeps_the_decode_leg_when_its_server_had_not_admitted_the_request(stream: bool) -> None:
    """The prefill server refuses its request because no decode request published the
    transfer within its wait (the decode server had not admitted it, and computes it itself
    once it does): the proxy keeps the decode leg, and the client gets the decode server's
    answer, not the prefill leg's error. (Any other prefill failure ends the decode leg:
    test_kvferry_flow_failed_prefill_cancels_decode_leg.)"""
    decode = _Stub("decode")
    prefill = _Stub("prefill", fail_after=decode)
    prefill.fail_status = f"request refused: no destination for transfer '<T>': transfer '<T>': {UNCLAIMED} 3 s"
    decode.hold_recv = prefill.status_answered  # answers once the proxy has the prefill leg's reason
    proxy = ProxyThread([prefill.url], [decode.url], connector="kvferry")
    proxy.start()
    try:
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [3] * 40, "max_tokens": 4, "stream": stream})
        assert a.status == 200 and "error" not in str(a.body), a.body
        assert prefill.status_asked == [prefill.seen[-1]["kv_transfer_params"]["kvferry"]["transfer"]]
        assert not decode.closed.is_set()
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_kvferry_flow_failed_transfer_names_its_reason(stream: bool) -> None:
    """A decode server that finishes the request with an error (vLLM: HTTP 500 "Internal
    server error", or a stream's error event) is asked for the transfer's status; the client
    gets the reason (whole: a 502 JSON error; stream: the error event before [DONE])."""
    prefill, decode = _Stub("prefill"), _Stub("decode", fail_recv="its blocks did not all arrive within 2.0 s")
    proxy = ProxyThread([prefill.url], [decode.url], connector="kvferry")
    proxy.start()
    try:
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [3] * 40, "max_tokens": 4, "stream": stream})
        (transfer,) = [b["kv_transfer_params"]["kvferry"]["transfer"] for b in decode.seen]
        assert decode.status_asked == [transfer]
        assert a.status == (200 if stream else 502)
        error = _error_of(a)
        assert error["leg"] == "decode" and error["transfer"] == transfer and error["code"] == 502
        assert (
            error["message"] == f"decode server: transfer {transfer} failed: its blocks did not all arrive within 2.0 s"
        )
        assert proxy.proxy.flow.peers == {}  # type: ignore[attr-defined]  # a failure: asked again next time
        # A server that no longer knows the transfer: the client still learns which one failed.
        decode.remember = False
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [4] * 40, "max_tokens": 4, "stream": stream})
        transfer = decode.seen[-1]["kv_transfer_params"]["kvferry"]["transfer"]
        message = _error_of(a)["message"]
        assert message.startswith("decode server: ") and decode.url not in message, message
        assert message.endswith(f"(transfer {transfer}: the server reports it 'unknown')"), message
        assert decode.hellos == 2  # rediscovered after the first failure
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["proxy", "--prefill", "localhost:1", "--decode", "http://a", "--port", "8000"], "expected http:// URLs"),
        (["proxy", "--prefill", "http://a", "--decode", "http://b", "--port", "70000"], "must be in [1, 65535]"),
        (
            ["proxy", "--prefill", "http://a", "--decode", "http://b", "--port", "1", "--connector", "x"],
            "invalid choice",
        ),
        (["proxy", "--prefill", "http://a", "--decode", "http://b"], "--port"),
        (["bench", "vllm", "--configs", "nixl,bogus"], "unknown configuration ['bogus']"),
        (["bench", "vllm", "--layer-groups", "9", "--layers", "8"], "--layer-groups 9 must be <= --layers 8"),
    ],
)
def test_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    from kvferry.cli import main

    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
