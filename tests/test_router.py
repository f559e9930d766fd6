"""The connector under routers that speak NixlConnector's ``kv_transfer_params`` protocol
(kvferry.vllm.router), at the scheduler halves, against real rendezvous sockets: a prefill
request learns its decode server from that server's offer (before or after the request
arrives), its answer is NixlConnector's shape, every failure is refused at once with its
reason and counted. No vLLM needed; tests/test_vllm_router.py runs the same flows through
real vLLM servers and vllm-router."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from typing import Any, Iterator

import pytest
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.vllm import client, rendezvous, trust
from kvferry.vllm.config import ConnectorConfig, parse_router_params, router_key
from kvferry.vllm.proxy import NIXL_PREFILL_LEG
from kvferry.vllm.scheduler import SchedulerSide

sys.path.insert(0, os.path.dirname(__file__))
from helpers import until  # noqa: E402
from sched_fakes import Manager, Request, Status, publish, scheduler_pair, step  # noqa: E402

KEY = b"r" * 32
PREFILL_LEG = NIXL_PREFILL_LEG  # the toy proxy's prefill leg


@pytest.fixture
def pair(tmp_path: Any) -> Iterator[tuple[SchedulerSide, SchedulerSide, Any, Manager]]:
    """A prefill scheduler half, a decode scheduler half and the decode server's real
    rendezvous (destinations are published by hand: the decode worker's part)."""
    with scheduler_pair(str(tmp_path), KEY) as pair:
        yield pair


def _prefill_request(rid: str, prompt: list[int]) -> Request:
    return Request(f"cmpl-{rid}-0-0123abcd", prompt, dict(PREFILL_LEG))


def _finish(side: SchedulerSide, req: Request, blocks: list[int]) -> tuple[bool, dict[str, Any]]:
    req.status = Status("FINISHED_LENGTH_CAPPED")
    delay, answer = side.request_finished(req, blocks)
    assert answer is not None
    return delay, answer


def _counts(side: SchedulerSide) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in side.tally.totals.items() if k.startswith("unhonoured/")}


def test_prefill_first_answer_then_offer_sends_late(pair: Any) -> None:
    """The toy proxy's order: the prefill request computes with no decode server known; its
    answer is NixlConnector's shape (signed address, transfer id, push mode) and its blocks
    wait; the decode request built from that answer offers, the prefill half looks the
    destination up and sends the whole prompt in one late send."""
    prefill, decode, rdv, manager = pair
    prompt = list(range(1, 11))
    req = _prefill_request("X1", prompt)
    manager.tables[req.request_id] = [7, 8, 9]
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)  # no decode server to wait for
    assert prefill.build_connector_meta(step({req.request_id: (0, 10)})).sends == []
    delay, answer = _finish(prefill, req, [7, 8, 9])
    assert delay is True  # the blocks wait for the decode server
    assert answer["do_remote_prefill"] is True and answer["transfer_mode"] == "push"
    assert answer["remote_request_id"] == "X1" and answer["tp_size"] == 1
    address = f"tcp://{answer['remote_host']}:{answer['remote_port']}"
    assert answer["remote_engine_id"] == f"prefill-engine.{trust.sign_peer(KEY, address)}"

    dreq = Request("cmpl-X1-0-99990000", prompt, answer)  # the router passes the answer on
    assert decode.get_num_new_matched_tokens(dreq, 0) == (10, True)
    manager.tables[dreq.request_id] = [100, 101, 102]
    decode.update_state_after_alloc(dreq, None, 10)
    (recv,) = decode.build_connector_meta(step({})).recvs
    assert recv.transfer == "X1"
    publish(rdv, "X1", prompt)  # what the decode worker does with that RecvSpec
    (late,) = prefill._late.values()
    assert late.lookup is not None and late.lookup.done.wait(30)
    meta = prefill.build_connector_meta(step({}))
    (spec,) = meta.sends
    assert (spec.transfer, spec.finished, spec.destination["dst_blocks"]) == ("X1", True, [100, 101, 102])
    assert [(c.start, c.end, c.src_blocks) for c in meta.chunks] == [(0, 10, [[7, 8, 9]])]
    assert rdv.taker("X1") == "prefill-engine"
    assert not prefill.has_pending() and _counts(prefill) == {} and _counts(decode) == {}


def test_offer_before_the_prefill_request_sends_early(pair: Any) -> None:
    """vllm-router's concurrent legs: the offer arrives first (the decode leg was quicker);
    the prefill request, once it arrives, waits for its destination and sends its hit before
    its first forward, as under kvferry proxy."""
    prefill, _, rdv, manager = pair
    prompt = list(range(1, 13))
    address = prefill._book.listen()
    publish(rdv, "X2", prompt)
    rendezvous.offer(address, KEY, "X2", rdv.address, trust.sign_peer(KEY, rdv.address))
    req = _prefill_request("X2", prompt)
    manager.tables[req.request_id] = [4, 5, 6]
    first = prefill.get_num_new_matched_tokens(req, 8)  # 8 tokens: its prefix-cache hit
    assert first in ((None, False), (0, False))
    assert until(lambda: prefill.get_num_new_matched_tokens(req, 8) == (0, False), 30)
    meta = prefill.build_connector_meta(step({req.request_id: (8, 4)}))
    (spec,) = meta.sends
    assert (spec.transfer, spec.reused_len, spec.early, spec.finished) == ("X2", 8, True, False)
    assert [(c.start, c.end) for c in meta.chunks] == [(8, 12)]


def test_concurrent_router_ids_wait_for_the_offer(pair: Any) -> None:
    """Once this server answered push, a vllm-router request id (both peers in it) waits up
    to admission_wait_s for its offer instead of computing at once."""
    prefill, _, _, manager = pair
    rid = "___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_"
    first = _prefill_request(rid + uuid.uuid4().hex, [1, 2, 3, 4])
    assert prefill.get_num_new_matched_tokens(first, 0) == (0, False)  # nothing answered push yet
    _finish(prefill, first, [1])
    second = _prefill_request(rid + uuid.uuid4().hex, [1, 2, 3, 4])
    assert prefill.get_num_new_matched_tokens(second, 0) == (None, False)  # waits for the offer


def test_no_decode_leg_frees_the_blocks_and_counts(pair: Any) -> None:
    """The decode leg never comes (the client left between the legs): once the wait passes
    (forced here), the blocks are released and the reason counted."""
    prefill, _, _, manager = pair
    req = _prefill_request("X3", [1, 2, 3, 4, 5])
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)
    assert _finish(prefill, req, [1, 2])[0] is True
    (late,) = prefill._late.values()
    assert late.lookup is not None and late.lookup.offer_deadline is not None
    assert prefill.build_connector_meta(step({})).releases == []  # still within its wait
    late.lookup.offer_deadline = 0.0  # the wait has passed
    ((rid, transfer, why),) = prefill.build_connector_meta(step({})).releases
    assert (rid, transfer) == (req.request_id, "X3") and "no decode server asked for its KV" in why
    assert _counts(prefill) == {"no_offer": 1} and not prefill.has_pending()
    # A decode server offering after that is refused at once, not left to its timeout.
    with pytest.raises(TransferError, match="refused"):
        rendezvous.offer(prefill._book.listen(), KEY, "X3", "unix:///x", trust.sign_peer(KEY, "unix:///x"))


def test_an_aborted_prefill_refuses_its_offer_with_the_reason(pair: Any) -> None:
    prefill, _, rdv, _ = pair
    req = _prefill_request("X4", [1, 2, 3])
    assert prefill.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = Status("FINISHED_ABORTED")
    delay, answer = prefill.request_finished(req, [1])
    assert delay is False and answer is not None and answer["remote_request_id"] == "X4"
    with pytest.raises(TransferError, match=r"ended \(finished_aborted\) before its KV was sent"):
        rendezvous.offer(prefill._book.listen(), KEY, "X4", rdv.address, trust.sign_peer(KEY, rdv.address))


def test_an_unsigned_offer_is_refused(pair: Any) -> None:
    """An offer names a rendezvous the prefill server will connect to: only a signed one."""
    prefill, _, _, _ = pair
    address = prefill._book.listen()
    with pytest.raises(TransferError, match="not a trusted decode server"):
        rendezvous.offer(address, KEY, "X5", "tcp://10.9.9.9:1", "0" * 64)


def test_a_decode_server_that_cannot_offer_fails_its_request_at_once(pair: Any) -> None:
    """The prefill server the request names is unreachable: the decode half abandons the
    transfer at its own rendezvous (its worker then fails the request at its next step, by
    kv_load_failure_policy), and counts it."""
    _, decode, rdv, manager = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    address = f"tcp://127.0.0.1:{port}"
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "X6",
              "remote_engine_id": f"p.{trust.sign_peer(KEY, address)}", "tp_size": 1}  # fmt: skip
    dreq = Request("cmpl-X6-0-11112222", [1, 2, 3, 4], params)
    manager.tables[dreq.request_id] = [1]
    assert decode.get_num_new_matched_tokens(dreq, 0) == (4, True)
    decode.update_state_after_alloc(dreq, None, 4)
    assert until(lambda: rdv.abandoned("X6") is not None, 30)
    assert "cannot tell the prefill server where to send" in str(rdv.abandoned("X6"))
    decode.build_connector_meta(step({}))
    assert _counts(decode) == {"offer_failed": 1}


def test_a_forged_prefill_address_is_never_offered_to(pair: Any) -> None:
    """remote_host/remote_port come in an HTTP body: without the prefill server's signature
    the decode half abandons the transfer and opens nothing."""
    _, decode, rdv, manager = pair
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.setblocking(False)
        port = trap.getsockname()[1]
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                  "remote_request_id": "X7", "remote_engine_id": "p." + "ab" * 32}  # fmt: skip
        dreq = Request("cmpl-X7-0-11112222", [1, 2, 3, 4], params)
        manager.tables[dreq.request_id] = [1]
        assert decode.get_num_new_matched_tokens(dreq, 0) == (4, True)
        decode.update_state_after_alloc(dreq, None, 4)
        assert until(lambda: rdv.abandoned("X7") is not None, 30)
        assert "not a trusted" in str(rdv.abandoned("X7"))
        with pytest.raises(BlockingIOError):
            trap.accept()  # the abandon came after the check: no connection was ever made


def test_wrong_role_and_prefill_size_are_refused_by_name(pair: Any) -> None:
    prefill, decode, _, manager = pair
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "X",
              "remote_engine_id": "p." + "ab" * 32}  # fmt: skip
    assert prefill.get_num_new_matched_tokens(Request("a", [1, 2], params), 0) == (1, True)
    assert "kv_transfer_params.do_remote_prefill on a kv_producer server" in prefill._refused["a"]
    assert decode.get_num_new_matched_tokens(Request("b", [1, 2], dict(PREFILL_LEG)), 0) == (1, True)
    assert "kv_transfer_params.do_remote_decode on a kv_consumer server" in decode._refused["b"]
    # A size that pairs is learnt (no setting); one that cannot is refused by both sizes.
    assert decode.get_num_new_matched_tokens(Request("c", [1, 2], dict(params, tp_size=2)), 0) == (2, True)
    two_heads = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_consumer", engine_id="d2",
                              kv_cache_manager_getter=lambda: manager, authkey=KEY, num_kv_heads=2)  # fmt: skip
    assert two_heads.get_num_new_matched_tokens(Request("d", [1, 2], dict(params, tp_size=3)), 0) == (1, True)
    assert "tensor_parallel_size=3 (kv_transfer_params.tp_size) cannot send" in two_heads._refused["d"]
    assert "tensor_parallel_size=1" in two_heads._refused["d"]
    assert _counts(decode) == {"refused": 1} and _counts(prefill) == {"refused": 1}


def test_foreign_and_extra_keys_are_logged_and_counted(pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Parameters of another protocol never pass silently: served here alone, or served
    without the keys kvferry does not read, each with a log line and a count."""
    prefill, decode, _, _ = pair
    assert decode.get_num_new_matched_tokens(Request("f", [1, 2], {"transfer_id": "xfer-1"}), 0) == (0, False)
    assert "ask for no kvferry transfer" in caplog.text
    assert prefill.get_num_new_matched_tokens(Request("g", [1, 2], dict(PREFILL_LEG, transfer_id="t")), 0) == (0, False)
    assert "['transfer_id'] are not NixlConnector's and are ignored" in caplog.text
    assert _counts(decode) == {"not_kvferry": 1} and _counts(prefill) == {"ignored_keys": 1}
    plain = {"do_remote_decode": False, "do_remote_prefill": False}
    assert decode.get_num_new_matched_tokens(Request("h", [1, 2], plain), 0) == (0, False)
    assert _counts(decode) == {"not_kvferry": 1}  # NixlConnector's own "no transfer" is plain


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"remote_host": None}, "remote_host=None"),
        ({"remote_host": "a b"}, "remote_host='a b'"),
        ({"remote_port": 0}, "remote_port=0"),
        ({"remote_port": True}, "remote_port=True"),
        ({"remote_request_id": ""}, "remote_request_id=''"),
        ({"remote_request_id": "a\nb"}, "remote_request_id='a\\\\nb'"),
        ({"remote_request_id": "x" * 257}, "remote_request_id='xxx"),
        ({"remote_engine_id": "nixl-engine"}, "remote_engine_id='nixl-engine'"),
        ({"tp_size": 0}, "tp_size=0"),
        ({"do_remote_decode": True}, "both true"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill='yes'"),
    ],
)
def test_router_params_name_the_bad_field(change: dict[str, Any], named: str) -> None:
    good = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 7000, "remote_request_id": "K",
            "remote_engine_id": "e." + "0f" * 32}  # fmt: skip
    assert parse_router_params(good, "r") is not None
    with pytest.raises(InvalidArgumentError, match=named.replace("(", r"\(")):
        parse_router_params(dict(good, **change), "r")


@pytest.mark.parametrize(
    ("request_id", "key"),
    [
        (
            "cmpl-___prefill_addr_a:1___decode_addr_b:2_" + "e" * 32 + "-0-0123abcd",
            "___prefill_addr_a:1___decode_addr_b:2_" + "e" * 32,
        ),
        ("chatcmpl-K-0123abcd", "K"),
        ("1_cmpl-K-0-0123abcd", "K"),
        ("no-vllm-shape", "no-vllm-shape"),
    ],
)
def test_router_key_is_the_shared_x_request_id(request_id: str, key: str) -> None:
    """Both legs of a vllm-router request carry one X-Request-Id; vLLM decorates each side's."""
    assert router_key(request_id) == key


def test_a_destination_taken_then_refused_is_abandoned_by_its_taker(pair: Any) -> None:
    """The prefill half took a destination it must refuse (another prompt there): its abandon
    names the taken destination's epoch, so the decode side (which takes an abandon of a
    taken transfer from its taker only) gives the request up at once."""
    prefill, _, rdv, manager = pair
    address = prefill._book.listen()
    publish(rdv, "X8", [9, 9, 9, 9, 9])  # the decode request's prompt is another one
    rendezvous.offer(address, KEY, "X8", rdv.address, trust.sign_peer(KEY, rdv.address))
    req = _prefill_request("X8", list(range(1, 6)))
    manager.tables[req.request_id] = [1, 2]
    assert until(lambda: prefill.get_num_new_matched_tokens(req, 0) == (1, True), 30)  # refused
    assert "another prompt" in prefill._refused[req.request_id]
    assert until(lambda: rdv.abandoned("X8") is not None, 30)
    assert "refused the destination" in str(rdv.abandoned("X8"))


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1025])
def test_a_recv_s_prefill_tp_is_checked_by_name(bad: Any) -> None:
    """kvferry proxy passes the prefill servers' size (their hello's tp_size) with each recv."""
    from kvferry.vllm.config import parse_params

    assert parse_params({"kvferry": {"op": "recv", "transfer": "T", "prefill_tp": 2}}).prefill_tp == 2
    with pytest.raises(InvalidArgumentError, match=r"invalid kv_transfer_params.kvferry.prefill_tp="):
        parse_params({"kvferry": {"op": "recv", "transfer": "T", "prefill_tp": bad}})
    with pytest.raises(InvalidArgumentError, match=r"\['prefill_tp'\] for op 'send'"):
        parse_params({"kvferry": {"op": "send", "transfer": "T", "peer": "unix:///p", "prefill_tp": 2}})


def test_hello_names_the_server_s_sizes(pair: Any) -> None:
    prefill, decode, _, _ = pair
    for side in (prefill, decode):
        req = Request("h", [0], {"kvferry": {"op": "hello"}})
        req.status = Status("FINISHED_LENGTH_CAPPED")
        _, answer = side.request_finished(req, [])
        assert answer is not None and (answer["kvferry"]["tp_size"], answer["kvferry"]["pp_size"]) == (1, 1)


def test_a_stalled_handshake_is_not_reported_as_a_key_mismatch(tmp_path: Any) -> None:
    """A rendezvous that accepts and never answers (a busy or stopped server) fails the
    handshake by its deadline; that says nothing about the keys, and the error says so,
    where it used to tell the operator the two servers hold different keys."""
    path = str(tmp_path / "stalled.sock")
    with socket.socket(socket.AF_UNIX) as stalled:
        stalled.bind(path)
        stalled.listen()
        with pytest.raises(TransferError) as err:
            client.connect(f"unix://{path}", KEY, timeout=0.5)
    assert "is connected but did not complete the handshake within 0.5 s" in str(err.value)
    assert "different keys" not in str(err.value)
    # A server with another key still gets the key named.
    other = rendezvous.Rendezvous(b"o" * 32, lambda sender: "x", str(tmp_path))
    try:
        with pytest.raises(TransferError, match="hold different keys"):
            client.connect(other.address, KEY)
    finally:
        other.close()


def test_a_refusals_answer_names_no_address(pair: Any) -> None:
    """The reason in a refused request's answer (kv_transfer_params, which vLLM returns to the
    client) has every address replaced by ``<address>``; the server's log keeps it."""
    prefill, _, _, _ = pair
    params = {"kvferry": {"op": "send", "transfer": "t1", "peer": "tcp://10.0.0.5:4100"}}
    req = Request("a", [1, 2, 3], params)
    assert prefill.get_num_new_matched_tokens(req, 0) == (1, True)  # refused: failed as a load
    assert "10.0.0.5" in prefill._refused["a"]  # what the log line says
    _, answer = _finish(prefill, req, [1])
    assert "not a trusted decode server" in answer["kvferry"]["error"], answer
    assert "10.0.0.5" not in answer["kvferry"]["error"] and "<address>" in answer["kvferry"]["error"], answer
