"""The vLLM connector's control plane against hostile clients and key-holders, without an
engine (no vLLM needed): the rendezvous's abandons and connections, the per-request
parameters a client sends, what a client reads back of a server's reasons, and the files a
server opens (docs/security.md)."""

from __future__ import annotations

import os
import secrets
from typing import Any, Iterator

import pytest
from helpers import SLACK, in_thread, until
from kvferry.errors import InvalidArgumentError, TransferError
from kvferry.transports import wire
from kvferry.vllm import rendezvous
from kvferry.vllm.config import load_authkey, parse_params, router_key

KEY = secrets.token_bytes(32)
DESTINATION = {
    "request_id": 7,
    "epoch": 3,
    "prompt_len": 40,
    "digest": "0123456789abcdef0123456789abcdef",
    "block_size": 16,
    "dst_blocks": [7, 3, 9],
    "held_blocks": 0,
    "engine": "decode-0",
}


@pytest.fixture
def server() -> Iterator[rendezvous.Rendezvous]:
    rdv = rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///nowhere.sock", listen="tcp://127.0.0.1:0")
    try:
        yield rdv
    finally:
        rdv.close()


# -- abandons ----------------------------------------------------------------------------------


def test_only_the_request_that_took_a_transfer_may_abandon_it(server: rendezvous.Rendezvous) -> None:
    """A prefill request takes T's destination and writes. Another request naming T (a
    client's second request, aborted; or another prefill engine) abandons T: that used to be
    recorded, and the decode worker then freed T's blocks as never written while the taker's
    writes still landed in them. Now it is refused by name and changes nothing; the taker's
    own abandon (naming its destination's epoch) is taken, as is any abandon of a transfer
    no one took (which no lookup can take afterwards)."""
    server.publish("T", DESTINATION)
    taken = rendezvous.lookup(server.address, KEY, "T", 5, "prefill-a")
    for epoch in (0, 4):
        with pytest.raises(TransferError, match="refused the abandon: .*only that request may abandon it"):
            rendezvous.abandon(server.address, KEY, "T", "aborted before its first chunk", epoch)
    assert server.abandoned("T") is None and server.take_abandoned() == []
    rendezvous.abandon(server.address, KEY, "T", "cannot reach the decode endpoint", taken["epoch"])
    assert server.abandoned("T") == "cannot reach the decode endpoint"
    rendezvous.abandon(server.address, KEY, "U", "aborted before its destination came")  # untaken
    server.publish("U", dict(DESTINATION, epoch=5))
    with pytest.raises(TransferError, match="was abandoned"):
        rendezvous.lookup(server.address, KEY, "U", 5, "prefill-a")


def test_an_abandon_wakes_the_lookup_waiting_for_it(server: rendezvous.Rendezvous) -> None:
    """A lookup waits (up to its hour) for a transfer that is then abandoned: it used to wait
    on, holding its thread and socket on both servers; now it is refused at once."""
    done, outcome = in_thread(lambda: rendezvous.lookup(server.address, KEY, "W", 3600, "prefill-a"))
    assert until(lambda: server.connections == 1)  # the lookup is being served (waiting)
    rendezvous.abandon(server.address, KEY, "W", "the prefill request was aborted")
    assert done.wait(SLACK), "the lookup kept waiting after its transfer was abandoned"
    assert isinstance(outcome[0], TransferError) and "was abandoned" in str(outcome[0])


def test_a_revoked_transfer_is_offered_again_to_its_taker_only(server: rendezvous.Rendezvous) -> None:
    """A prefill engine preempted the request that took P and revoked it: its lookup of P
    again waits until the decode server offers P again (a new epoch), and takes it; no other
    engine may take P meanwhile, nor after the offer; the old epoch's abandon is refused once
    P is taken again. Only a taken transfer can be offered again."""
    server.publish("P", DESTINATION)
    assert rendezvous.lookup(server.address, KEY, "P", 5, "prefill-a")["epoch"] == 3
    done, outcome = in_thread(lambda: rendezvous.lookup(server.address, KEY, "P", 3600, "prefill-a"))
    assert until(lambda: server.connections == 1)  # its taker's lookup waits
    with pytest.raises(TransferError, match="already taken by another prefill request"):
        rendezvous.lookup(server.address, KEY, "P", 0, "prefill-b")
    server.republish("P", dict(DESTINATION, epoch=9))
    assert done.wait(SLACK) and outcome[0]["epoch"] == 9, outcome
    with pytest.raises(TransferError, match="only that request may abandon it"):
        rendezvous.abandon(server.address, KEY, "P", "the first take's abandon", 3)
    server.publish("Q", DESTINATION)
    with pytest.raises(TransferError, match="is not taken"):
        server.republish("Q", dict(DESTINATION, epoch=10))
    rendezvous.lookup(server.address, KEY, "Q", 5, "prefill-a")
    server.republish("Q", dict(DESTINATION, epoch=11))
    with pytest.raises(TransferError, match="taken by another prefill engine"):
        rendezvous.lookup(server.address, KEY, "Q", 0, "prefill-b")
    assert rendezvous.lookup(server.address, KEY, "Q", 5, "prefill-a")["epoch"] == 11


# -- the rendezvous's connections --------------------------------------------------------------


def test_the_rendezvous_serves_a_bounded_number_of_connections() -> None:
    """Each authenticated connection holds a thread (each one-shot lookup here opens its
    own): at ``max_connections`` the next one is refused by name (its question read and
    answered), and served again once a place is free."""
    rdv = rendezvous.Rendezvous(KEY, lambda sender: "staging+unix:///x", listen="tcp://127.0.0.1:0", max_connections=2)
    try:
        waiting = [in_thread(lambda n=n: rendezvous.lookup(rdv.address, KEY, n, 3600, "p")) for n in ("A", "B")]
        assert until(lambda: rdv.connections == 2)
        with pytest.raises(TransferError, match=r"serves at most 2 connections at once \(max_connections\)"):
            rendezvous.lookup(rdv.address, KEY, "C", 0, "p")
        rdv.withdraw("A", "its decode request ended")  # its lookup is answered, its place freed
        assert waiting[0][0].wait(SLACK) and "ended on the decode server" in str(waiting[0][1][0])
        rdv.publish("C", DESTINATION)
        assert rendezvous.lookup(rdv.address, KEY, "C", 5, "p")["epoch"] == DESTINATION["epoch"]
        with pytest.raises(InvalidArgumentError, match="invalid max_connections=0"):
            rendezvous.Rendezvous(KEY, lambda sender: "x", max_connections=0)
    finally:
        rdv.close()
    assert waiting[1][0].wait(SLACK)  # the close answers it


def test_an_authenticated_connection_that_sends_nothing_is_closed(
    server: rendezvous.Rendezvous, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its handshake a connection with no question pending must send one within
    IDLE_SECONDS (made short here), or it is closed with a goodbye saying why: silence holds
    no thread."""
    from kvferry.transports.frames import Goodbye
    from kvferry.vllm.frames import RENDEZVOUS

    monkeypatch.setattr(rendezvous, "IDLE_SECONDS", 0.2)
    sock = wire.connect(wire.parse_address(server.address), SLACK)
    try:
        wire.handshake(sock, KEY, wire.ROLE_SENDER, SLACK, server.address)
        sock.settimeout(SLACK)  # bounds a hang of the old code; the close comes first
        goodbye = wire.recv_frame(sock, frames=RENDEZVOUS)
        assert isinstance(goodbye, Goodbye) and "no frame within 0.2 s" in goodbye.reason
        with pytest.raises(EOFError):
            wire.recv_frame(sock, frames=RENDEZVOUS)
    finally:
        sock.close()
    assert until(lambda: server.connections == 0)


# -- what a client sends -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "transfer",
    [
        "t\nkvferry: decode request r1 (transfer t) failed: forged",  # a whole log line
        "t\r",
        "t\x1b[2J",
        "t'",
        "t t",
        "T@p0of2",  # a part's name the rendezvous makes itself
        "é",
        "x" * 257,
        "",
    ],
)
def test_a_transfer_id_outside_the_safe_alphabet_is_refused_by_name(transfer: str) -> None:
    """A transfer id is logged and answered back: one holding a newline forged a connector
    log line. Ids are 1 to 256 characters of [A-Za-z0-9._:-] (UUIDs, routers' X-Request-Id),
    refused by name otherwise, for every op; the refusal quotes the id escaped."""
    for op in ({"op": "recv"}, {"op": "status"}, {"op": "send", "peer": "tcp://127.0.0.1:1"}):
        with pytest.raises(InvalidArgumentError, match=r"kvferry.transfer=.*\[A-Za-z0-9._:-\]") as err:
            parse_params({"kvferry": {**op, "transfer": transfer}})
        assert "\n" not in str(err.value) and "\r" not in str(err.value) and "\x1b" not in str(err.value)


def test_router_ids_stay_valid_and_anything_else_is_made_safe() -> None:
    """A router's X-Request-Id becomes the transfer id (`router_key`): vllm-router's stay
    as they are and pass `parse_params`; any other character a client put in one becomes
    ``_``."""
    hex32 = "0123456789abcdef" * 2
    routed = f"___prefill_addr_127.0.0.1:8001___decode_addr_127.0.0.1:8002_{hex32}"
    assert router_key(f"cmpl-{routed}-0-0123abcd") == routed
    assert router_key(f"chatcmpl-{routed}-0123abcd") == routed
    assert parse_params({"kvferry": {"op": "status", "transfer": routed}}) is not None
    forged = router_key("chatcmpl-a\nkvferry: forged line é-0123abcd")
    assert forged == "chatcmpl-a_kvferry:_forged_line__-0123abcd"
    assert parse_params({"kvferry": {"op": "status", "transfer": forged}}) is not None
    assert router_key("x" * 300) == "x" * 256


@pytest.mark.parametrize("timeout", [1e300, 86400.5, float("inf"), float("nan"), 0, -1, True, "5"])
def test_an_absurd_timeout_is_refused_by_name(timeout: Any) -> None:
    """``timeout_s`` is capped by the server's own bounds (a request may ask to wait less,
    never more); past a day it is refused by name."""
    with pytest.raises(InvalidArgumentError, match=r"kvferry.timeout_s=.*at most 86400"):
        parse_params({"kvferry": {"op": "recv", "transfer": "t", "timeout_s": timeout}})
    assert parse_params({"kvferry": {"op": "recv", "transfer": "t", "timeout_s": 86400}}).timeout_s == 86400.0


# -- what a client reads back ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "scrubbed"),
    [
        ("sender #1 (tcp 127.0.0.1:49014) went away", "sender #1 (<address>) went away"),
        (
            "the receiver at <address> (tcp 127.0.0.1:46295) went away",
            "the receiver at <address> (<address>) went away",
        ),
        ("sender #2 (pid 4242): revoked", "sender #2 (<address>): revoked"),
        ("cannot reach staging+tcp://[fd00::5]:4100: refused", "cannot reach <address>: refused"),
        ("sender #3 (tcp [fd00::7]:49014)", "sender #3 (<address>)"),
        ("unix:///run/kvferry/r.sock, then 10.0.0.5:4100", "<address>, then <address>"),
        ("blocks [0, 4) of slots [5:9] in 1.5 s", "blocks [0, 4) of slots [5:9] in 1.5 s"),
    ],
)
def test_reasons_a_client_reads_name_no_address(reason: str, scrubbed: str) -> None:
    """kvferry writes a peer as ``tcp HOST:PORT`` or ``pid N`` (`wire.peer_name`), which the
    proxy's scrub (URLs only) let through, and a ``status`` answer quoted reasons unscrubbed.
    Every form reads ``<address>`` now, in the ``status`` answers' outcomes and in the proxy's
    errors; the server's log keeps the full reason."""
    from kvferry.vllm.metadata import Outcome
    from kvferry.vllm.redact import scrub

    assert scrub(reason) == scrubbed
    assert Outcome("t", "failed", reason).error == scrubbed


def test_the_proxys_scrub_takes_every_form() -> None:
    pytest.importorskip("aiohttp")
    from kvferry.vllm import proxy

    assert proxy.scrub("sender #1 (tcp 127.0.0.1:49014) and pid 77") == "sender #1 (<address>) and <address>"


# -- files a server opens ----------------------------------------------------------------------


def _key_file(tmp_path: Any, content: bytes) -> str:
    path = os.path.join(str(tmp_path), "authkey")
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)
    return path


def test_a_link_to_a_kernel_file_is_no_key_file(tmp_path: Any) -> None:
    """A symbolic link to /proc/self/environ passed every check (a regular file of this
    user, 0400, more than 32 bytes) and made the process's environment the key. A file
    whose size is not what it holds (the kernel's) is refused by name."""
    link = os.path.join(str(tmp_path), "authkey")
    os.symlink("/proc/self/environ", link)
    with pytest.raises(InvalidArgumentError, match="a file of the kernel's"):
        load_authkey(link)


@pytest.mark.parametrize("content", [b"k" * 32, b"ab" * 32, bytes(range(7)) * 5])
def test_a_key_of_few_distinct_bytes_is_refused(tmp_path: Any, content: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="distinct values, not a random key"):
        load_authkey(_key_file(tmp_path, content))
    for good in (os.urandom(32), os.urandom(32).hex().encode(), os.urandom(32).hex().encode() + b"\n"):
        assert load_authkey(_key_file(tmp_path, good)) == good


def test_a_directory_as_the_key_file_is_refused_by_name(tmp_path: Any) -> None:
    """It raised a bare IsADirectoryError (from opening the descriptor as a file)."""
    os.mkdir(os.path.join(str(tmp_path), "keys"), 0o700)
    with pytest.raises(InvalidArgumentError, match=r"keys'?: a directory, not a regular file"):
        load_authkey(os.path.join(str(tmp_path), "keys"))


def test_an_existing_trace_file_is_made_private(tmp_path: Any) -> None:
    """Trace lines name every transfer and request; a trace file that existed with 0644 kept
    it. Opening it makes it 0600."""
    from kvferry.trace import Tracer

    path = os.path.join(str(tmp_path), "trace.jsonl")
    with open(path, "w") as f:
        f.write("")
    os.chmod(path, 0o644)
    Tracer(path, engine="e").close()
    assert os.stat(path).st_mode & 0o777 == 0o600
