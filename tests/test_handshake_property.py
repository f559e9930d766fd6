"""The handshake as a state machine, under hypothesis: a peer plays any sequence of steps
(challenges of either role, proofs right or wrong or bound to another endpoint, garbage,
truncated frames, an early end) against a real `wire.handshake` over a socket pair.

Properties: the handshake completes exactly when the peer sent a sender's challenge and then
the right proof for this endpoint's URL; otherwise it raises `AuthenticationError` and
nothing else; the endpoint never sends its own proof (nor anything past its challenge) to a
peer that did not prove itself first; and what it says never quotes the peer's bytes."""

from __future__ import annotations

import secrets
import socket
import threading
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvferry.transports import wire
from kvferry.transports.frames import Challenge, Goodbye, Proof

KEY = secrets.token_bytes(32)
URL = "tcp://127.0.0.1:7000"
OTHER = "tcp://127.0.0.1:7001"
MARK = b"\xa5ZQ"  # in every garbage step: must never appear in an error message

STEPS = [
    "challenge", "challenge-endpoint-role", "proof", "proof-other-url", "proof-wrong-key",
    "garbage", "truncated", "end",
]  # fmt: skip
step = st.sampled_from(STEPS)


def _play(steps: list[str]) -> tuple[Any, bytes]:
    endpoint, peer = socket.socketpair()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(wire.handshake(endpoint, KEY, wire.ROLE_ENDPOINT, 5.0, URL))
        except BaseException as err:  # noqa: BLE001  (the property looks at it)
            outcome.append(err)
        finally:
            endpoint.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=run)
    thread.start()
    header = wire._recv_exact(peer, wire.HEADER.size)  # noqa: SLF001
    _, _, _, length = wire.HEADER.unpack(header)
    role_and_nonce = wire._recv_exact(peer, length)  # noqa: SLF001
    theirs = role_and_nonce[1:]
    mine = secrets.token_bytes(wire.NONCE_BYTES)
    try:
        for s in steps:
            if s == "challenge":
                peer.sendall(wire.encode(Challenge(wire.ROLE_SENDER, mine)))
            elif s == "challenge-endpoint-role":
                peer.sendall(wire.encode(Challenge(wire.ROLE_ENDPOINT, mine)))
            elif s.startswith("proof"):
                key = secrets.token_bytes(32) if s == "proof-wrong-key" else KEY
                url = OTHER if s == "proof-other-url" else URL
                proof = wire._mac(key, wire.ROLE_SENDER, wire.binding(url), theirs, mine)  # noqa: SLF001
                peer.sendall(wire.encode(Proof(proof)))
            elif s == "garbage":
                peer.sendall(MARK + secrets.token_bytes(20))
            elif s == "truncated":
                peer.sendall(wire.encode(Challenge(wire.ROLE_SENDER, mine))[:-5])
            elif s == "end":
                peer.shutdown(socket.SHUT_WR)
                break
        else:
            peer.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the endpoint closed its end already
    peer.settimeout(10)
    rest = b""
    while True:
        try:
            chunk = peer.recv(4096)
        except OSError:
            break
        if not chunk:
            break
        rest += chunk
    thread.join(10)
    assert not thread.is_alive()
    peer.close()
    endpoint.close()
    return outcome[0], rest


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=5))
def test_the_handshake_completes_only_for_a_proved_sender(steps: list[str]) -> None:
    result, sent_after_challenge = _play(steps)
    proved = steps[:2] == ["challenge", "proof"]
    if proved:
        assert result == URL
        assert len(sent_after_challenge) == wire.HEADER.size + 32  # the endpoint's proof, nothing more
    else:
        assert isinstance(result, wire.AuthenticationError), result
        # No proof, no hello, to a peer that did not prove itself: at most the refusal of a
        # wrong proof, after one came.
        assert sent_after_challenge in (b"", wire.encode(Goodbye(wire.REFUSED_PROOF)))
        if sent_after_challenge:
            assert steps[0] == "challenge" and steps[1].startswith("proof")
        said = str(result)
        assert MARK.hex() not in said and repr(MARK)[2:-1] not in said and str(list(MARK)) not in said
