"""kvferry proxy in front of real vLLM servers (a prefill and a decode server, with vLLM's
NixlConnector and with kvferry's KvferryConnector), checked
against a plain single server: greedy outputs token for token over multi-turn sessions
(completions and chat, streaming and not), the decode server's prefix cache on the next turn,
a client that leaves mid-stream, and dead upstreams. Routing rules run against stub upstreams.

Needs vLLM (``make setup-vllm && make test-vllm``); skipped where it is not importable.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make setup-vllm; make test-vllm runs these)")
pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (it comes with vLLM)")

from aiohttp import web  # noqa: E402

from kvferry.vllm import testbed  # noqa: E402
from kvferry.vllm.proxy import SESSION_HEADER, ProxyThread, session_of  # noqa: E402
from kvferry.vllm.testbed import Answer, Testbed, call  # noqa: E402

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
def servers(request: pytest.FixtureRequest, plain: testbed.Server, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[testbed.Server, Testbed]]:
    """The plain server and a prefill/decode pair of one connector behind the proxy (one pair
    at a time: each connector's tests run together)."""
    prefill_config, decode_config = testbed.CONNECTORS[request.param]
    with Testbed(model, tmp_path_factory.mktemp(request.param), prefill_config, decode_config, proxy_connector=request.param) as bed:
        testbed.wait_ready([plain])
        yield plain, bed


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, testbed.VOCAB) for _ in range(n)]


def _conversation(base: str, path: str, stream: bool, seed: int, turns: int = 3, headers: dict[str, str] | None = None) -> list[Answer]:
    """A multi-turn session: each turn's prompt is the last prompt, the last answer and new
    tokens (completions: token ids; chat: messages)."""
    rng = random.Random(seed)
    answers: list[Answer] = []
    prompt: list[int] = _tokens(rng, 200)
    messages: list[dict[str, str]] = [{"role": "system", "content": "you are a tool-using agent " * 8}]
    for turn in range(turns):
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
        if path == COMPLETIONS:
            body["prompt"] = prompt
        else:
            messages.append({"role": "user", "content": f"tool output {seed}-{turn}: " + "data " * rng.randrange(20, 60)})
            body["messages"] = messages
        answer = call(base, path, body, headers=headers)
        assert answer.status == 200, answer.body
        answers.append(answer)
        prompt = prompt + answer.token_ids + _tokens(rng, 70)
        messages = messages + [{"role": "assistant", "content": answer.text}]
    return answers


def _used(bed: Testbed) -> list[int]:
    return [s.kv_blocks()[0] for s in bed.servers()]


def _wait_until(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    """Waits for a condition the servers report (bounded: a failure names the condition)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_outputs_equal_plain_server(servers: tuple[testbed.Server, Testbed], path: str, stream: bool) -> None:
    plain, bed = servers
    seed = (10 if path == COMPLETIONS else 20) + int(stream)
    want = _conversation(plain.url, path, stream, seed)
    got = _conversation(bed.url, path, stream, seed, headers={SESSION_HEADER: f"s{seed}"})
    for turn, (w, g) in enumerate(zip(want, got)):
        assert len(w.token_ids) == 12, w.body
        assert g.token_ids == w.token_ids, f"turn {turn}"
        assert g.text == w.text, f"turn {turn}"
    # Random weights still give varied tokens: the comparison is not between constant streams.
    assert len({t for a in want for t in a.token_ids}) > 6
    _wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks after the session")


def test_next_turn_hits_decode_prefix_cache(servers: tuple[testbed.Server, Testbed]) -> None:
    """The session's second turn reaches the same decode server, which then pulls only the
    tokens past its own prefix-cache hit (the decode-warm case)."""
    _, bed = servers
    decode = bed.decodes[0]

    def hits() -> float:
        return _counter(decode.metrics(), "vllm:prefix_cache_hits_total")

    before = hits()
    answers = _conversation(bed.url, COMPLETIONS, False, seed=7, turns=2, headers={SESSION_HEADER: "warm"})
    assert all(len(a.token_ids) == 12 for a in answers)
    # Turn 2's prompt starts with turn 1's 200 + 12 tokens: at least 6 full blocks of 32 hit.
    assert hits() - before >= 6 * 32


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_mid_stream_frees_kv(servers: tuple[testbed.Server, Testbed]) -> None:
    _, bed = servers
    decode = bed.decodes[0]
    # vLLM counts finished requests by reason but not aborted ones: an abort shows as the
    # running gauge going to zero with no request finished. A first request makes the proxy's
    # one-off requests (kvferry's hello) happen before the count is taken; vLLM records a
    # request's stats before its answer leaves.
    assert call(bed.url, COMPLETIONS, {"model": "tiny", "prompt": [4] * 40, "max_tokens": 2, "temperature": 0}).status == 200
    finished = _counter(decode.metrics(), "vllm:request_success_total")
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
    _wait_until(lambda: _counter(decode.metrics(), "vllm:num_requests_running") == 0, "the decode server to drop the request")
    assert _counter(decode.metrics(), "vllm:request_success_total") == finished  # aborted, not run to the end
    _wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks")
    _wait_until(lambda: bed.proxy.in_flight() == 0, "the proxy to have no upstream call in flight")
    # And the proxy still serves.
    assert call(bed.url, COMPLETIONS, {"model": "tiny", "prompt": [5] * 40, "max_tokens": 2, "temperature": 0}).status == 200


def _dead_url() -> str:
    return f"http://127.0.0.1:{testbed.free_port()}"  # nothing listens there


def test_dead_upstream_gives_clear_error_and_proxy_keeps_serving(servers: tuple[testbed.Server, Testbed]) -> None:
    plain, bed = servers
    body = {"model": "tiny", "prompt": _tokens(random.Random(11), 90), "max_tokens": 6, "temperature": 0}
    want = call(plain.url, COMPLETIONS, body)
    dead = _dead_url()
    lone = ProxyThread([dead], [bed.decodes[0].url], connector=bed.proxy_connector or "")
    lone.start()
    try:
        for stream in (False, True):
            a = call(lone.url, COMPLETIONS, dict(body, stream=stream))
            assert a.status == 502
            assert a.body["error"]["server"] == dead
            assert re.search(rf"prefill server {re.escape(dead)}: unreachable", a.body["error"]["message"])
        # The proxy itself stays up and answers.
        assert call(lone.url, COMPLETIONS, body).status == 502
    finally:
        lone.stop()
    # With a live server next to each dead one, every request is served, whatever the order.
    mixed = ProxyThread([dead, bed.prefills[0].url], [_dead_url(), bed.decodes[0].url], connector=bed.proxy_connector or "")
    mixed.start()
    try:
        for i in range(3):
            a = call(mixed.url, COMPLETIONS, dict(body, stream=bool(i % 2)), headers={SESSION_HEADER: f"m{i}"})
            assert a.status == 200, a.body
            assert a.token_ids == want.token_ids
    finally:
        mixed.stop()
    _wait_until(lambda: _used(bed) == [0, 0], "both servers to hold no KV blocks")


# ---- routing rules against stub upstreams (no engine) ---------------------------------------


class _Stub:
    """An upstream that answers like a vLLM server of the given role and records requests.
    kvferry's protocol: answers ``hello``; with ``hang_recv`` a ``recv`` request waits (for
    blocks that never come) until its connection closes; with ``fail_after`` a prefill
    request fails once that stub has seen a request."""

    def __init__(self, role: str, cut_stream: bool = False, hang_recv: bool = False, fail_after: _Stub | None = None) -> None:
        self.role, self.cut_stream, self.hang_recv, self.fail_after = role, cut_stream, hang_recv, fail_after
        self.seen: list[dict[str, Any]] = []
        self.hellos = 0
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
        asyncio.run_coroutine_threadsafe(web.TCPSite(self._runner, "127.0.0.1", self.port).start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        op = ((body.get("kv_transfer_params") or {}).get("kvferry") or {}).get("op")
        if op == "hello":
            self.hellos += 1
            return web.json_response({"choices": [], "kv_transfer_params": {"kvferry": {
                "op": "hello", "role": "kv_consumer", "peer": f"/tmp/peer-{self.port}", "engine": "e1"}}})  # fmt: skip
        self.seen.append(body)
        self.got.set()
        if op == "recv" and self.hang_recv:
            try:
                await asyncio.Event().wait()
            finally:
                self.closed.set()
        if self.fail_after is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.fail_after.got.wait, 30)
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        choice = {"index": 0, "text": self.role, "token_ids": [1], "finish_reason": "length"}
        if op == "send":
            return web.json_response({"choices": [choice], "kv_transfer_params": {"kvferry": {"op": "send", "transfer": body["kv_transfer_params"]["kvferry"]["transfer"]}}})
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
        assert all(b["kv_transfer_params"]["remote_engine_id"] in {p.url for p in prefills} for d in decodes for b in d.seen)
        assert all(b["max_tokens"] == 1 and b["stream"] is False and b["kv_transfer_params"]["do_remote_decode"] for p in prefills for b in p.seen)
        assert min(len(p.seen) for p in prefills) > 0  # the prefill servers share the work
    finally:
        proxy.stop()


def test_session_of_order() -> None:
    assert session_of({SESSION_HEADER: "a"}, {"user": "b", "prompt": "x"}) == "h:a"
    assert session_of({}, {"user": "b", "prompt": "x"}) == "u:b"
    assert session_of({}, {"prompt": list(range(64)) + [1]}) == session_of({}, {"prompt": list(range(64)) + [2, 3]})
    assert session_of({}, {"prompt": [1, 2]}) != session_of({}, {"prompt": [1, 3]})
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert session_of({}, {"messages": msgs}) == session_of({}, {"messages": msgs + [{"role": "assistant", "content": "a"}]})


def test_decode_dying_mid_stream_ends_stream_with_error_event() -> None:
    prefill, decode = _Stub("prefill"), _Stub("decode", cut_stream=True)
    proxy = ProxyThread([prefill.url], [decode.url])
    proxy.start()
    try:
        a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [1, 2], "max_tokens": 5, "stream": True})
        assert a.status == 200
        assert a.token_ids == [1]  # what arrived before the cut is delivered
        assert a.body[-1]["error"]["server"] == decode.url
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
    proxy = ProxyThread([prefills[0].url], [decodes[0].url], connector="kvferry")
    proxy.start()
    try:
        for i, stream in enumerate((False, True, True, False)):
            a = call(proxy.url, COMPLETIONS, {"model": "tiny", "prompt": [i + 1] * 40, "max_tokens": 4, "stream": stream})
            assert a.status == 200 and a.token_ids == [1]
            assert a.timing["decode-start"] > 0
        # Discovered once: a streamed answer's client closing at the end does not drop it.
        assert decodes[0].hellos == 1
        assert list(proxy.proxy.flow.peers) == [decodes[0].url]  # type: ignore[attr-defined]
        sends = [b["kv_transfer_params"]["kvferry"] for b in prefills[0].seen]
        recvs = [b["kv_transfer_params"]["kvferry"] for b in decodes[0].seen]
        assert [r["op"] for r in recvs] == ["recv"] * 4 and [s["op"] for s in sends] == ["send"] * 4
        assert [s["transfer"] for s in sends] == [r["transfer"] for r in recvs]
        assert len({r["transfer"] for r in recvs}) == 4
        assert all(s == {"op": "send", "transfer": s["transfer"], "peer": f"/tmp/peer-{decodes[0].port}"} for s in sends)  # no key
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
        assert a.status == 502 and a.body["error"]["server"] == prefill.url
        assert "engine dead" in a.body["error"]["message"]
        assert decode.closed.wait(30)  # the decode leg's connection was closed: vLLM aborts it
        _wait_until(lambda: proxy.in_flight() == 0, "the proxy to have no upstream call in flight")
        assert proxy.proxy.flow.peers == {}  # type: ignore[attr-defined]  # asked again next time
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["proxy", "--prefill", "localhost:1", "--decode", "http://a", "--port", "8000"], "expected http:// URLs"),
        (["proxy", "--prefill", "http://a", "--decode", "http://b", "--port", "70000"], "must be in [1, 65535]"),
        (["proxy", "--prefill", "http://a", "--decode", "http://b", "--port", "1", "--connector", "x"], "invalid choice"),
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
