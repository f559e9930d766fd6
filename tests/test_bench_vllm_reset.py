"""`kvferry bench vllm` without vLLM: the decode-cold turns' prefix cache reset is checked,
against a stub server that answers as vLLM's /reset_prefix_cache does; where the prefill
servers' transfer threads may run."""

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


def test_transfer_threads_apart_take_a_core_of_their_own_or_are_refused_by_name() -> None:
    from kvferry.bench.vllm import VllmBenchConfig, transfer_core
    from kvferry.errors import InvalidArgumentError

    one_host, two_hosts = (
        VllmBenchConfig(transfer_threads="apart"),
        VllmBenchConfig(transfer_threads="apart", decode_netns="b", decode_host="10.0.0.2", prefill_host="10.0.0.1"),
    )
    assert transfer_core(VllmBenchConfig(), [0, 1, 2]) is None  # with the engine, by default
    assert transfer_core(one_host, [0]) is None
    assert transfer_core(one_host, [0, 1]) == 1  # the decode servers' core
    assert transfer_core(one_host, [4, 5, 6]) == 6 and transfer_core(two_hosts, [4, 5, 6]) == 6
    with pytest.raises(InvalidArgumentError, match=r"transfer_threads='apart' across two hosts on 2 cores"):
        transfer_core(two_hosts, [0, 1])
    with pytest.raises(InvalidArgumentError, match=r"invalid transfer_threads='elsewhere': choose from with-engine"):
        transfer_core(VllmBenchConfig(transfer_threads="elsewhere"), [0, 1, 2])


def test_a_run_larger_than_the_hosts_memory_is_refused_by_name_before_any_server() -> None:
    """--realistic at 2 sessions x 6 turns of 1024 cached tokens needs about 31 GiB on its 9
    servers (12 pool shares of 1.4 GiB, 9 x vLLM's own 1.5 GiB): refused on a 23 GiB host, naming the
    sizes and the flags that lower them; one session fits, and so does the default run."""
    from kvferry.bench.vllm import SERVER_OVERHEAD_BYTES, VllmBenchConfig, check_memory, configurations, fleet_bytes
    from kvferry.errors import InvalidArgumentError
    from kvferry.geometry import VLLM_REALISTIC_MODEL

    confs = configurations(4)
    per_token = 32 * 2 * 8 * 128 * 4  # --realistic: 32 layers of K and V, 8 heads x 128, fp32
    host = 23 << 30
    big = VllmBenchConfig(model=VLLM_REALISTIC_MODEL, sessions=2, turns=6, cached_tokens=1024)
    # Pools: the longest conversation (1024 + 6 x 136 + 8 tokens: 58 blocks, 2 spare) per
    # session, half again, per configuration sharing the server (6 prefill and 6 decode shares
    # over 9 servers), and 16 MiB a server.
    share = int(1.5 * 2 * 60 * 32 * per_token)
    assert fleet_bytes(big, confs, per_token) == 12 * share + 9 * ((16 << 20) + SERVER_OVERHEAD_BYTES)
    with pytest.raises(
        InvalidArgumentError,
        match=r"its 9 servers need about 30\.5 GiB .* than this host's 23\.0 GiB: lower --sessions",
    ):
        check_memory(big, confs, per_token, host)
    check_memory(
        VllmBenchConfig(model=VLLM_REALISTIC_MODEL, sessions=1, turns=6, cached_tokens=1024), confs, per_token, host
    )
    check_memory(VllmBenchConfig(), confs, 8 * 2 * 2 * 64 * 4, host)
    # Two configurations on one prefill server and two decode servers: 3 servers.
    pair = [c for c in confs if c.name in ("kvferry-early", "kvferry-aware")]
    with pytest.raises(InvalidArgumentError, match=r"its 3 servers need"):
        check_memory(big, pair, per_token, 4 << 30)
