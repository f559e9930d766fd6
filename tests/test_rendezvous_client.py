"""The rendezvous's control plane under bursts (kvferry.vllm.client, kvferry.vllm.rendezvous):
one kept authenticated connection per peer carries every lookup, abandon and offer; a
waiting lookup holds no thread on either side. No vLLM needed (the scheduler half runs on
tests/sched_fakes.py, as in tests/test_router.py)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator

import pytest
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.transports import wire
from kvferry.transports.frames import Challenge
from kvferry.vllm import client as client_module
from kvferry.vllm import rendezvous, trust
from kvferry.vllm.client import Client
from kvferry.vllm.config import ConnectorConfig
from kvferry.vllm.scheduler import SchedulerSide

sys.path.insert(0, os.path.dirname(__file__))
from helpers import SLACK, in_thread  # noqa: E402
from sched_fakes import Manager, Request, publish  # noqa: E402

KEY = b"c" * 32
BURST = 200


class SlowHandshakes:
    """The rendezvous's handshakes, held (as on a loaded host, where they take seconds) until
    ``release`` is set; counts the handshakes the rendezvous made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.count = 0
        self._lock = threading.Lock()
        real = wire.handshake

        def handshake(sock: Any, key: bytes, role: int, *args: Any, **kwargs: Any) -> Any:
            if role == wire.ROLE_ENDPOINT:  # the rendezvous's side
                with self._lock:
                    self.count += 1
                self.release.wait(SLACK)
            return real(sock, key, role, *args, **kwargs)

        monkeypatch.setattr(wire, "handshake", handshake)


@pytest.fixture
def server() -> Iterator[rendezvous.Rendezvous]:
    rdv = rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///nowhere.sock", listen="tcp://127.0.0.1:0")
    yield rdv
    rdv.close()


def _prompt(i: int) -> list[int]:
    return [i + 1] * 8


def test_a_burst_of_new_prefill_requests_shares_one_handshake_and_no_thread_each(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 new prefill requests from one prefill server ask at once, while the rendezvous's
    handshakes are held (a loaded host). Each used to open its own connection and thread:
    past the 32 pending handshakes the rendezvous admits per source address they were cut
    off mid-handshake and failed. Now the scheduler's steps start no thread, the one
    connection's handshake is the only one, and every request gets its destination."""
    slow = SlowHandshakes(monkeypatch)
    manager = Manager({})
    prefill = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_producer", engine_id="prefill-engine",
                            kv_cache_manager_getter=lambda: manager, authkey=KEY)  # fmt: skip
    peer, mac = server.address, trust.sign_peer(KEY, server.address)
    requests = [
        Request(f"r{i}", _prompt(i), {"kvferry": {"op": "send", "transfer": f"T{i}", "peer": peer, "peer_mac": mac}})
        for i in range(BURST)
    ]
    try:
        threads = threading.active_count()
        for req in requests:
            assert prefill.get_num_new_matched_tokens(req, 0) == (None, False)  # waits for its destination
        assert threading.active_count() <= threads + 2  # the line's keeper and reader, not one per request
        for i in range(BURST):
            publish(server, f"T{i}", _prompt(i))
        slow.release.set()
        lookups = [prefill._lookups[req.request_id] for req in requests]
        for found in lookups:
            assert found.done.wait(SLACK), found.transfer
        assert [found.error for found in lookups] == [None] * BURST
        assert [found.destination["epoch"] for found in lookups if found.destination] == [1] * BURST
        assert slow.count == 1 and prefill._client.handshakes == 1
        assert {server.taker(f"T{i}") for i in range(BURST)} == {"prefill-engine"}
    finally:
        prefill.close()


def test_lookups_on_one_connection_are_answered_in_any_order(server: rendezvous.Rendezvous) -> None:
    """A lookup waiting for its transfer holds up no other question on the same connection:
    a later lookup, an abandon and an offer are each answered first (their calls matched)."""
    with Client(KEY) as client:
        waiting = client.lookup(server.address, "W", 3600, "prefill-a")
        publish(server, "X", _prompt(1))
        assert client.lookup(server.address, "X", 5, "prefill-a").result(SLACK)["epoch"] == 1
        client.abandon(server.address, "U", "the prefill request was aborted").result(SLACK)
        with pytest.raises(TransferError, match="refused the offer: transfer 'X': this is a decode server's"):
            client.offer(server.address, "X", "unix:///p", "0f" * 32).result(SLACK)
        assert not waiting.done()
        server.withdraw("W", "its decode request ended")
        with pytest.raises(TransferError, match="ended on the decode server: its decode request ended"):
            waiting.result(SLACK)
        assert client.handshakes == 1 and client.lines == 1


def test_a_lookup_whose_connection_breaks_fails_and_is_not_sent_again(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection breaks while a lookup waits there: the lookup fails (the rendezvous
    may have handed it its destination: it is never asked twice, so no destination is taken
    twice), the rendezvous drops the parked lookup (it takes nothing later), and the next
    question makes a new connection."""
    parked = threading.Event()
    real_park = server._park

    def park(entry: Any) -> None:
        real_park(entry)
        parked.set()

    # The rendezvous drops the lookup once it sees its connection end (under its lock, which
    # a publish takes too): the publish waits for that, as a publish after the break would.
    dropped = threading.Event()
    real_stale = server._stale_names

    def stale() -> set[str]:
        names = real_stale()
        if "B" in names:
            dropped.set()
        return names

    monkeypatch.setattr(server, "_park", park)
    monkeypatch.setattr(server, "_stale_names", stale)
    with Client(KEY) as client:
        waiting = client.lookup(server.address, "B", 3600, "prefill-a")
        assert parked.wait(SLACK)
        (line,) = client._lines.values()
        line._channel.sock.shutdown(2)  # the connection breaks (a reset, a dead middlebox)
        with pytest.raises(TransferError, match="the decode server at .* went away"):
            waiting.result(SLACK)
        assert dropped.wait(SLACK)
        publish(server, "B", _prompt(2))
        assert server.taker("B") is None  # the dropped lookup took nothing
        assert client.lookup(server.address, "B", 5, "prefill-a").result(SLACK)["epoch"] == 1
        assert client.handshakes == 2


def test_an_engine_thread_ask_never_waits_on_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking returns at once while the connection is being made (its handshake held):
    the connect runs on the line's own thread; the questions go once it is made."""
    slow = SlowHandshakes(monkeypatch)
    rdv = rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///nowhere.sock", listen="tcp://127.0.0.1:0")
    try:
        publish(rdv, "E", _prompt(3))
        with Client(KEY) as client:
            done, outcome = in_thread(lambda: client.lookup(rdv.address, "E", 5, "prefill-a"))
            assert done.wait(SLACK) and isinstance(outcome[0], Future) and not outcome[0].done()
            slow.release.set()
            assert outcome[0].result(SLACK)["epoch"] == 1
    finally:
        slow.release.set()
        rdv.close()


def test_bad_questions_are_refused_before_anything_is_sent() -> None:
    """A wait or transfer the wire cannot carry is refused by name at the ask; a closed
    client fails what it is asked."""
    client = Client(KEY)
    with pytest.raises(InvalidArgumentError, match="invalid wait_s=-1"):
        client.lookup("tcp://127.0.0.1:1", "T", -1, "p")
    with pytest.raises(InvalidArgumentError, match="transfer"):
        client.lookup("tcp://127.0.0.1:1", "", 1, "p")
    assert client.lines == 0 and client.handshakes == 0
    client.close()
    with pytest.raises(TransferError, match="the client closed"):
        client.abandon("tcp://127.0.0.1:1", "T", "why").result(SLACK)


def test_questions_waiting_on_one_connection_are_bounded_by_name(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At MAX_PENDING questions waiting on one connection, the next lookup is refused naming
    the bound (the others wait on); an answered one frees its place."""
    monkeypatch.setattr(rendezvous, "MAX_PENDING", 2)
    with Client(KEY) as client:
        waiting = [client.lookup(server.address, name, 3600, "prefill-a") for name in ("P1", "P2")]
        with pytest.raises(TransferError, match=r"has 2 questions waiting already.*\(MAX_PENDING=2\)"):
            client.lookup(server.address, "P3", 3600, "prefill-a").result(SLACK)
        publish(server, "P1", _prompt(1))
        assert waiting[0].result(SLACK)["epoch"] == 1
        publish(server, "P3", _prompt(3))
        assert client.lookup(server.address, "P3", 5, "prefill-a").result(SLACK)["epoch"] == 1
        assert not waiting[1].done()


def test_an_idle_line_closes_and_the_next_question_opens_another(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line with nothing to ask closes after LINE_IDLE_SECONDS (made short here), before
    the rendezvous's own idle bound; the next question makes a new connection and is
    answered."""

    monkeypatch.setattr(client_module, "LINE_IDLE_SECONDS", 0.05)
    with Client(KEY) as client:
        publish(server, "I1", _prompt(1))
        asked = client.lookup(server.address, "I1", 5, "prefill-a")
        (line,) = client._lines.values()  # (it stays while a question waits on it)
        assert asked.result(SLACK)["epoch"] == 1
        line._keeper.join(SLACK)  # its keeper ends with the line
        assert not line._keeper.is_alive() and client.lines == 0
        publish(server, "I2", _prompt(2))
        assert client.lookup(server.address, "I2", 5, "prefill-a").result(SLACK)["epoch"] == 1
        assert client.handshakes == 2


def test_a_tensor_parallel_send_refused_on_one_link_gives_back_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP-2 prefill request looks up both links at once; one decode rank refuses (its
    name ended there) while the other hands its destination out. The request fails, and the
    destination it took is abandoned under its epoch, so that decode rank frees its blocks at
    once instead of waiting for a send that will not come."""
    from kvferry.vllm.metadata import leg_name

    slow = SlowHandshakes(monkeypatch)  # both lookups are asked before either is answered
    servers = [
        rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///nowhere.sock", listen="tcp://127.0.0.1:0")
        for _ in range(2)
    ]
    abandoned = threading.Event()
    real_abandon = servers[0]._abandon

    def abandon(transfer: str, reason: str, epoch: int = 0) -> Any:
        why = real_abandon(transfer, reason, epoch)
        abandoned.set()
        return why

    monkeypatch.setattr(servers[0], "_abandon", abandon)
    peer = " ".join(s.address for s in servers)
    names = [leg_name("T", rank, 2, 1) for rank in range(2)]
    prefill = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_producer", engine_id="prefill-engine",
                            kv_cache_manager_getter=lambda: Manager({}), authkey=KEY, tp_size=2,
                            num_kv_heads=2)  # fmt: skip
    try:
        publish(servers[0], names[0], _prompt(0))
        servers[1].withdraw(names[1], "its decode request ended")
        params = {"kvferry": {"op": "send", "transfer": "T", "peer": peer, "peer_mac": trust.sign_peer(KEY, peer)}}
        assert prefill.get_num_new_matched_tokens(Request("r", _prompt(0), params), 0) == (None, False)
        found = prefill._lookups["r"]
        slow.release.set()
        assert found.done.wait(SLACK)
        assert found.error is not None and "ended on the decode server: its decode request ended" in found.error
        assert abandoned.wait(SLACK)
        assert servers[0].taker(names[0]) == leg_name("prefill-engine", 0, 2, 1)  # it was taken, then given back
        assert (servers[0].abandoned(names[0]) or "").startswith("another link of the send failed")
    finally:
        prefill.close()
        for server in servers:
            server.close()


class _Clock:
    """The client's clock, moved on by the test (a host where seconds pass while a process
    waits for the CPU); ``looked`` is set once the line's keeper read it after a move."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.looked = threading.Event()

    def monotonic(self) -> float:
        if self.offset and threading.current_thread().name == "kvferry-rendezvous-line":
            self.looked.set()
        return time.monotonic() + self.offset


def test_an_answer_that_comes_a_minute_late_from_a_connected_rendezvous_is_taken(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rendezvous that is connected but slow (its threads starved on a loaded host: four
    engine processes on two cores) answers an abandon a minute after it was written. The
    client used to give an answer 10 s and fail the question; a peer still connected is slow,
    not gone, so it waits (up to PATIENCE_SECONDS) and takes the answer."""
    held, entered = threading.Event(), threading.Event()
    real_abandon = server._abandon

    def abandon(transfer: str, reason: str, epoch: int = 0) -> Any:
        entered.set()
        held.wait(SLACK)  # the rendezvous's thread, starved
        return real_abandon(transfer, reason, epoch)

    monkeypatch.setattr(server, "_abandon", abandon)
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    with Client(KEY) as client:
        asked = client.abandon(server.address, "H", "the prefill request was aborted")
        assert entered.wait(SLACK)  # written, and being answered
        clock.offset = 60.0
        (line,) = client._lines.values()
        with line._cond:
            line._cond.notify_all()  # the keeper looks at its deadlines a minute on
        assert clock.looked.wait(SLACK)
        held.set()
        assert asked.result(SLACK) is None
    assert server.abandoned("H") == "the prefill request was aborted"


def test_a_lookup_the_rendezvous_never_answered_is_abandoned_there(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill request's lookup is written, then its connection breaks before any answer
    (the rendezvous may never have seen it). The request fails, and the prefill side tells
    that rendezvous it gave up (an abandon, on a new connection), so the decode request that
    publishes the transfer fails at once instead of waiting out its own timeout."""
    parked, abandoned = threading.Event(), threading.Event()
    real_park, real_abandon = server._park, server._abandon

    def park(entry: Any) -> None:
        real_park(entry)
        parked.set()

    def abandon(transfer: str, reason: str, epoch: int = 0) -> Any:
        why = real_abandon(transfer, reason, epoch)
        if transfer == "N" and why is None:
            abandoned.set()
        return why

    monkeypatch.setattr(server, "_park", park)
    monkeypatch.setattr(server, "_abandon", abandon)
    prefill = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_producer", engine_id="prefill-engine",
                            kv_cache_manager_getter=lambda: Manager({}), authkey=KEY)  # fmt: skip
    peer = server.address
    params = {"kvferry": {"op": "send", "transfer": "N", "peer": peer, "peer_mac": trust.sign_peer(KEY, peer)}}
    try:
        assert prefill.get_num_new_matched_tokens(Request("r", _prompt(5), params), 0) == (None, False)
        assert parked.wait(SLACK)
        (line,) = prefill._client._lines.values()
        line._channel.sock.shutdown(2)  # the connection breaks with the lookup unanswered
        found = prefill._lookups["r"]
        assert found.done.wait(SLACK) and "went away" in (found.error or "")
        assert abandoned.wait(SLACK)
        assert (server.abandoned("N") or "").startswith("the prefill request gave up")
        assert server.taker("N") is None
    finally:
        prefill.close()


def test_a_handshake_cut_off_after_the_proof_is_not_reported_as_a_key_mismatch(tmp_path: Any) -> None:
    """An endpoint that closes after the client's proof without refusing it (its deadline
    passed while the client waited for the CPU, or it made room for newer connections) says
    nothing about the keys: the error says the handshake was cut off, where it used to tell
    the operator that the two servers hold different keys. (A refused proof is said in
    words, wire.REFUSED_PROOF: tests/test_router.py still gets the keys named.)"""
    path = str(tmp_path / "cut.sock")

    def recv_exact(conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "the client closed early"
            data += chunk
        return data

    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()

        def endpoint() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(SLACK)
                conn.sendall(wire.encode(Challenge(wire.ROLE_ENDPOINT, secrets.token_bytes(wire.NONCE_BYTES))))
                recv_exact(conn, 2 * wire.HEADER.size + 1 + 2 * wire.NONCE_BYTES)  # its challenge, then its proof

        done, outcome = in_thread(endpoint)
        with pytest.raises(TransferError) as err:
            client_module.connect(f"unix://{path}", KEY, timeout=SLACK)
        assert done.wait(SLACK) and outcome == [None]
    said = str(err.value)
    assert "cut the handshake off" in said and "different keys" not in said, said


def test_a_question_whose_connection_closed_before_it_was_written_goes_on_the_next(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection ends between the handshake and the first question (the rendezvous
    closes a connection quiet for IDLE_SECONDS while the client's thread waits for the CPU).
    Nothing of the question left, so it is written on a new connection and answered, where it
    used to wait out its bound with nobody left to answer it."""
    real_write = client_module._Line._write
    ended: list[Any] = []

    def write(line: Any, channel: wire.Channel) -> None:
        if not ended:
            ended.append(channel)
            readers = [t for t in threading.enumerate() if t.name == "kvferry-rendezvous-answers"]
            channel.sock.shutdown(socket.SHUT_RDWR)  # the end, seen by the line's reader first
            for reader in readers:
                reader.join(SLACK)
            assert not any(reader.is_alive() for reader in readers)
        real_write(line, channel)

    monkeypatch.setattr(client_module._Line, "_write", write)
    with Client(KEY) as client:
        assert client.abandon(server.address, "Q", "the prefill request was aborted").result(SLACK) is None
        assert ended and client.handshakes == 2
    assert server.abandoned("Q") == "the prefill request was aborted"
