"""`kvferry bench vllm`'s decode-cold turns: the decode server's prefix cache reset is checked,
against a stub server that answers as vLLM's /reset_prefix_cache does (no vLLM needed)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
from kvferry.bench.vllm import _reset_prefix_cache


class _Decode:
    """A decode server whose reset answers ``{"success": false}`` ``refusals`` times, then
    true; ``kv_blocks`` reports the blocks it still holds."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.asked = refusals, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                assert self.path == "/reset_prefix_cache"
                outer.asked += 1
                body = json.dumps({"success": outer.asked > outer.refusals}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def kv_blocks(self) -> tuple[int, int]:
        return 3, 64

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def decode(request: pytest.FixtureRequest) -> Iterator[_Decode]:
    server = _Decode(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("decode", [2], indirect=True)
def test_a_refused_reset_is_asked_again_until_it_happens(decode: _Decode) -> None:
    _reset_prefix_cache(decode)
    assert decode.asked == 3


@pytest.mark.parametrize("decode", [10**9], indirect=True)
def test_a_reset_that_never_happens_fails_the_turn(decode: _Decode) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"answered \{'success': False\} .*\(3 KV blocks still held\): the decode-cold turn would run warm",
    ):
        _reset_prefix_cache(decode, timeout_s=0)
    assert decode.asked >= 1
