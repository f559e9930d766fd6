"""The connector under vllm-router's MoRI-IO WRITE mode (kvferry.vllm.moriio), at the scheduler
halves, against a real decode rendezvous: both legs carry the router's ``transfer_id``, the
prefill request reads its decode server's signed rendezvous from the X-Request-Id and sends
its prefix-cache hit before its first forward; an unsigned or foreign address, a data
parallel router and a malformed transfer id are refused by name; the registration the router
reads is what vllm-router 0.1.17 parses. No vLLM needed (the registration test needs pyzmq
and msgspec, vLLM's); tests/test_vllm_router.py runs the mode through real servers and
vllm-router."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any, Iterator

import pytest
from kvferry.errors import InvalidArgumentError
from kvferry.vllm import trust
from kvferry.vllm.config import ConnectorConfig
from kvferry.vllm.moriio import Registration, parse_moriio_params, registered_address
from kvferry.vllm.scheduler import SchedulerSide

sys.path.insert(0, os.path.dirname(__file__))
from helpers import until  # noqa: E402
from sched_fakes import Manager, Request, scheduler_pair, step  # noqa: E402
from sched_fakes import publish as publish_destination  # noqa: E402

KEY = b"m" * 32
# What vllm-router 0.1.17 sends (observed): docs/routers.md, kvferry.vllm.moriio.
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_dp_size": 1, "remote_tp_size": 1}  # fmt: skip
DECODE_LEG = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
              "remote_block_ids": None, "remote_dp_size": 1, "remote_tp_size": 1}  # fmt: skip


def _request_id(decode_zmq: str, chat: bool = False) -> str:
    """vLLM's request id for the router's X-Request-Id."""
    x = f"___prefill_addr_kvferry___decode_addr_{decode_zmq}_{uuid.uuid4().hex}"
    return f"chatcmpl-{x}-89abcdef" if chat else f"cmpl-{x}-0-0123abcd"


@pytest.fixture
def pair(tmp_path: Any) -> Iterator[tuple[SchedulerSide, SchedulerSide, Any, Manager]]:
    """A prefill and a decode scheduler half and the decode server's real rendezvous
    (destinations published by hand: the decode worker's part)."""
    with scheduler_pair(str(tmp_path), KEY) as pair:
        yield pair


def _counts(side: SchedulerSide) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in side.tally.totals.items() if k.startswith("unhonoured/")}


def test_both_legs_at_once_send_the_hit_before_the_first_forward(pair: Any) -> None:
    """The decode leg publishes its destination under the router's transfer_id; the prefill
    leg, whose request id names the decode server's signed rendezvous, looks it up before it
    computes and sends its 8-token hit early, then the rest as computed."""
    prefill, decode, rdv, manager = pair
    prompt = list(range(1, 13))
    transfer = "tx-" + uuid.uuid4().hex
    rid = _request_id(registered_address(rdv.address, trust.sign_peer(KEY, rdv.address)))

    dreq = Request(rid.replace("0123abcd", "99990000"), prompt, dict(DECODE_LEG, transfer_id=transfer))
    assert decode.get_num_new_matched_tokens(dreq, 0) == (12, True)
    manager.tables[dreq.request_id] = [100, 101, 102]
    decode.update_state_after_alloc(dreq, None, 12)
    (recv,) = decode.build_connector_meta(step({})).recvs
    assert recv.transfer == transfer
    publish_destination(rdv, transfer, prompt)  # what the decode worker does with that RecvSpec

    req = Request(rid, prompt, dict(PREFILL_LEG, transfer_id=transfer))
    manager.tables[req.request_id] = [4, 5, 6]
    assert until(lambda: prefill.get_num_new_matched_tokens(req, 8) == (0, False), 30)
    meta = prefill.build_connector_meta(step({req.request_id: (8, 4)}))
    (spec,) = meta.sends
    assert (spec.transfer, spec.reused_len, spec.early, spec.finished) == (transfer, 8, True, False)
    assert spec.destination["dst_blocks"] == [100, 101, 102]
    assert [(c.start, c.end) for c in meta.chunks] == [(8, 12)]
    assert rdv.taker(transfer) == "prefill-engine"
    assert _counts(prefill) == {} and _counts(decode) == {}


@pytest.mark.parametrize("forged", ["unsigned", "foreign"])
def test_a_decode_address_not_signed_by_the_key_is_never_connected_to(pair: Any, forged: str) -> None:
    """A client that POSTs its own X-Request-Id to the prefill server (an address signed by
    another key, or another connector's registration) is refused by name and counted; no
    lookup reaches the named rendezvous."""
    prefill, _, rdv, manager = pair
    transfer = "tx-" + uuid.uuid4().hex
    publish_destination(rdv, transfer, [1, 2, 3, 4])
    zmq = (
        registered_address(rdv.address, trust.sign_peer(b"x" * 32, rdv.address))
        if forged == "unsigned"
        else "host:127.0.0.1,handshake:6301,notify:61005"  # vLLM's MoRIIOConnector's registration
    )
    req = Request(_request_id(zmq), [1, 2, 3, 4], dict(PREFILL_LEG, transfer_id=transfer))
    manager.tables[req.request_id] = [1]
    assert prefill.get_num_new_matched_tokens(req, 0) == (1, True)  # a load the worker reports failed
    assert _counts(prefill) == {"refused": 1}
    assert rdv.taker(transfer) is None
    req.status = type(req.status)("FINISHED_ABORTED")
    _, answer = prefill.request_finished(req, [1])
    assert answer is not None
    error = answer["kvferry"]["error"]
    assert ("peer_mac does not match" if forged == "unsigned" else "decode address") in error


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"transfer_id": "tx\nforged"}, "kv_transfer_params.transfer_id"),
        ({"transfer_id": 7}, "kv_transfer_params.transfer_id"),
        ({"remote_dp_size": 2, "remote_dp_rank": 1}, "kv_transfer_params.remote_dp_size"),
    ],
)
def test_moriio_params_name_the_bad_field(change: dict[str, Any], named: str) -> None:
    for leg in (PREFILL_LEG, DECODE_LEG):
        params = {**leg, "transfer_id": "tx-" + "a" * 32, **change}
        with pytest.raises(InvalidArgumentError, match=named.replace(".", r"\.")):
            parse_moriio_params(params, _request_id(registered_address("tcp://127.0.0.1:1", "a" * 64)))


def test_the_decode_address_comes_from_either_api_s_request_id() -> None:
    """Completions and chat ids, a tensor-parallel decode server's ranks; a request id with no
    decode address (another router's) is refused by name; without transfer_id and
    remote_dp_size (NixlConnector's, mooncake mode's legs): not this mode."""
    peer = "tcp://127.0.0.1:5001 tcp://127.0.0.1:5002"
    zmq = registered_address(peer, "b" * 64)
    for chat in (False, True):
        params = parse_moriio_params(dict(PREFILL_LEG, transfer_id="tx-1", extra=1), _request_id(zmq, chat))
        assert params is not None
        assert (params.op, params.transfer, params.peer, params.peer_mac) == ("send", "tx-1", peer, "b" * 64)
        assert params.ignored == ("extra",)  # logged and counted as ignored_keys
    with pytest.raises(InvalidArgumentError, match="X-Request-Id"):
        parse_moriio_params(dict(PREFILL_LEG, transfer_id="tx-1"), "cmpl-plain-0-0123abcd")
    assert parse_moriio_params(PREFILL_LEG, _request_id(zmq)) is None
    mooncake = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}
    assert parse_moriio_params(mooncake, _request_id(zmq)) is None  # NixlConnector's parse names what it lacks
    recv = parse_moriio_params(dict(DECODE_LEG, transfer_id="tx-2"), "cmpl-anything-0-0123abcd")
    assert recv is not None and (recv.op, recv.transfer, recv.ignored) == ("recv", "tx-2", ())


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"router_discovery": "127.0.0.1:30001"}, "without http_address"),
        ({"http_address": "127.0.0.1:8100"}, "without router_discovery"),
        ({"router_discovery": "tcp://127.0.0.1:30001", "http_address": "127.0.0.1:8100"}, "router_discovery="),
        ({"router_discovery": "127.0.0.1:30001", "http_address": "127.0.0.1"}, "http_address="),
    ],
)
def test_registration_settings_are_checked_by_name(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        ConnectorConfig.from_extra(extra)


def test_a_kv_both_server_cannot_register() -> None:
    config = ConnectorConfig.from_extra({"router_discovery": "127.0.0.1:1", "http_address": "127.0.0.1:2"})
    with pytest.raises(InvalidArgumentError, match="kv_both"):
        SchedulerSide(config, block_size=4, role="kv_both", engine_id="e", kv_cache_manager_getter=None, authkey=KEY)


def test_the_registration_is_what_vllm_router_parses() -> None:
    """A decode server registers over ZMQ, msgpack, the fields vllm-router 0.1.17's
    MoriIOServiceRegistration reads, with its signed rendezvous as zmq_address, again each
    interval (the router forgets a server 5 s after its last one)."""
    zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
    msgspec = pytest.importorskip("msgspec", reason="msgspec comes with vLLM")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = "tcp://127.0.0.1:5001"
    reg = Registration(f"127.0.0.1:{port}", "D", "127.0.0.1:8200", registered_address(peer, trust.sign_peer(KEY, peer)))
    try:
        got = []
        for _ in range(2):
            assert sock.poll(10_000), "no registration came"
            _, body = sock.recv_multipart()
            got.append(msgspec.msgpack.decode(body))
        want = {"type": "D", "http_address": "127.0.0.1:8200", "transfer_mode": "WRITE",
                "zmq_address": f"{trust.sign_peer(KEY, peer)}@{peer}"}  # fmt: skip
        assert got == [want, want]
    finally:
        reg.close()
        sock.close(linger=0)
        ctx.term()
