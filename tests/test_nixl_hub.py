"""One NIXL agent per process and role (kvferry.transports.nixl_hub).

A decode worker's receivers over the head slices of one pool, each served by a NixlEndpoint
of one receiver hub, written by 8 simulated prefill ranks, each a sender hub of its own (a
process of its own in a deployment) with one NixlTransport: one receiving agent, the pool
registered once, one notification poller and no more NIXL threads for 8 peers than for one;
a peer replaced without a new registration; every rank's blocks land in its own receiver's
heads, and one rank's fence reaches its receiver only.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from helpers import SLACK, until
from kvferry.errors import TransferError
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender

RANKS = 8
LAYERS, BLOCKS, TOKENS, CONTENT = 2, 16, 4, 8
SRC_IDS = np.array([1, 2, 5], dtype=np.int64)
DST_IDS = np.array([7, 3, 4], dtype=np.int64)


@pytest.fixture
def nixl_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """kvferry.transports.nixl_hub, with NIXL's register_memory counted per agent."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from kvferry.transports import nixl_hub
    from nixl._api import nixl_agent

    counted: Counter[str] = Counter()
    real = nixl_agent.register_memory

    def register_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        counted[self.name] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nixl_agent, "register_memory", register_memory)
    nixl_hub.registered_by_agent = counted  # type: ignore[attr-defined]
    yield nixl_hub


def nixl_threads() -> int:
    """Threads of this process that Python did not start (NIXL's progress threads, UCX's)."""
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for task in os.listdir("/proc/self/task") if int(task) not in python)


def head_views(heads: int, fill: float, device: str = "cpu") -> list[torch.Tensor]:
    """vLLM-like [B, H, N, C] views of one allocation, one per layer."""
    whole = torch.full((LAYERS, BLOCKS, heads, TOKENS, CONTENT), fill, device=device)
    return list(whole.unbind(0))


class Rank:
    """A simulated prefill rank: its hub, its pool (its head of the model), its sender."""

    def __init__(self, nixl_hub: Any, rank: int, address: str, authkey: bytes, device: str = "cpu") -> None:
        from kvferry.layout import paged_kv_from_views
        from kvferry.transports.nixl import SENDER_PROGRESS_THREAD, NixlTransport

        self.hub = nixl_hub.AgentHub("tx", progress_thread=SENDER_PROGRESS_THREAD)
        gen = torch.Generator().manual_seed(rank)
        self.kv = torch.randn((LAYERS, BLOCKS, 1, TOKENS, CONTENT), generator=gen).to(device)
        self.pool = paged_kv_from_views(
            list(self.kv.unbind(0)), num_blocks=BLOCKS, tokens_per_block=TOKENS, heads=(0, 1)
        )
        self.transport = NixlTransport(address, authkey=authkey, src=self.pool, hub=self.hub)
        self.sender = KVSender(self.pool, self.transport, timeout=SLACK)

    def send(self, request_id: int, epoch: int) -> None:
        n = len(SRC_IDS) * TOKENS
        self.sender.add(request_id, n, epoch=epoch)
        self.sender.send_chunks([request_id], [0], [n], SRC_IDS[None, :], DST_IDS[None, :])
        self.sender.flush(timeout=SLACK)

    def close(self) -> None:
        self.sender.close()  # closes its transport


def test_eight_prefill_ranks_share_one_receiving_agent_registration_and_poller(nixl_hub: Any) -> None:
    from kvferry.layout import paged_kv_from_views
    from kvferry.transports.nixl import NixlEndpoint

    views = head_views(RANKS, float("nan"))
    pool = paged_kv_from_views(views, num_blocks=BLOCKS, tokens_per_block=TOKENS)
    receivers = [KVReceiver(pool.heads(r, r + 1)) for r in range(RANKS)]
    hub = nixl_hub.ReceiverHub()
    authkey = secrets.token_bytes(32)
    endpoints = [NixlEndpoint(receiver, authkey=authkey, hub=hub) for receiver in receivers]
    ranks: list[Rank] = []
    try:
        ranks.append(Rank(nixl_hub, 0, endpoints[0].address, authkey))
        one_peer = nixl_threads()
        ranks += [Rank(nixl_hub, r, endpoints[r].address, authkey) for r in range(1, RANKS)]
        rx = endpoints[0].agent.name
        assert {e.agent.name for e in endpoints} == {rx}
        assert hub.agents() == 1 and hub.agents_made == 1
        # One allocation, one registration, whatever the number of slices and peers.
        assert hub.registrations() == 1 and nixl_hub.registered_by_agent[rx] == 1
        assert all(r.hub.agents() == 1 and nixl_hub.registered_by_agent[r.transport.agent.name] == 1 for r in ranks)
        assert [t.name for t in threading.enumerate()].count("kvferry-nixl-notifs") == 1
        assert nixl_threads() == one_peer

        epochs = [receiver.expect(7, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS) for receiver in receivers]
        late = [receiver.expect(8, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS) for receiver in receivers]
        for rank, epoch in zip(ranks, epochs):
            rank.send(7, epoch)
        # Rank 0 gives request 8 up: its fence travels as a notification of rank 0's agent.
        ranks[0].sender.add(8, len(DST_IDS) * TOKENS, epoch=late[0])
        ranks[0].sender.cancel(8)
        assert until(lambda: receivers[0].revoked_by_sender(8))
        ranks[1].send(8, late[1])  # the same request id and epoch at another receiver
        with pytest.raises(TransferError, match=f"request 8: revoked by NIXL agent {ranks[0].transport.agent.name}"):
            receivers[0].wait(8, timeout=SLACK)
        receivers[1].wait(8, timeout=SLACK)
        for receiver in receivers:
            receiver.wait(7, timeout=SLACK)
        assert not any(receiver.revoked_by_sender(8) for receiver in receivers[1:])
        assert receivers[1].release(8).is_complete
        for r, receiver in enumerate(receivers):
            assert receiver.release(7).is_complete
            assert receiver.refused_count == 0 and receiver.duplicate_count == 0
        for r in range(RANKS):  # each head holds its rank's blocks, bit for bit
            landed = torch.stack([view[:, r : r + 1] for view in views])  # [L, B, 1, N, C]
            assert torch.equal(landed[:, DST_IDS], ranks[r].kv[:, SRC_IDS])
            untouched = np.setdiff1d(np.arange(BLOCKS), DST_IDS)
            assert bool(torch.isnan(landed[:, untouched]).all())

        # A peer replaced: its agent removed, a new one added, nothing registered again.
        ranks[3].close()
        ranks[3] = Rank(nixl_hub, 30, endpoints[3].address, authkey)
        epoch = receivers[3].expect(9, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS)
        ranks[3].send(9, epoch)
        receivers[3].wait(9, timeout=SLACK)
        assert receivers[3].release(9).is_complete
        assert nixl_hub.registered_by_agent[rx] == 1 and hub.registrations() == 1 and hub.agents_made == 1
        assert all(not endpoint.errors for endpoint in endpoints)
    finally:
        for rank in ranks:
            rank.close()
        for endpoint in endpoints:
            endpoint.close()
    assert hub.agents() == 0 and hub.registrations() == 0 and all(r.hub.agents() == 0 for r in ranks)
    assert "kvferry-nixl-notifs" not in [t.name for t in threading.enumerate()]


def test_an_agent_bound_at_one_endpoint_cannot_be_claimed_at_another_of_the_hub(nixl_hub: Any) -> None:
    """The hub routes a notification by its agent's name alone, so a name is bound to one
    open connection in the whole process: a connection to another endpoint naming it is
    ended, saying where it is held; once the holder's connection ended, it may be claimed."""
    from helpers import POOLS
    from kvferry.transports.control import PeerConnection
    from kvferry.transports.frames import Agent
    from kvferry.transports.nixl import NixlEndpoint

    hub = nixl_hub.ReceiverHub()
    authkey = secrets.token_bytes(32)
    here, there = (NixlEndpoint(KVReceiver(POOLS.zeros()), authkey=authkey, hub=hub) for _ in range(2))
    conns: list[PeerConnection] = []
    try:
        holder = PeerConnection(here.address, authkey)
        conns.append(holder)
        holder.send(Agent("kvferry-tx-holder"))
        assert until(lambda: _bound(here, "kvferry-tx-holder"))
        thief = PeerConnection(there.address, authkey)
        conns.append(thief)
        thief.send(Agent("kvferry-tx-holder"))
        pattern = f"claims NIXL agent kvferry-tx-holder, which a connection to the endpoint at {here.address} holds"
        assert until(lambda: _ended_with(thief, pattern))
        holder.close()
        mover = PeerConnection(there.address, authkey)
        conns.append(mover)
        assert until(lambda: not here.connected())  # the holder's end was handled
        mover.send(Agent("kvferry-tx-holder"))
        assert until(lambda: _bound(there, "kvferry-tx-holder"))
        mover.check()  # still connected
        assert here.error_count == 0 and there.error_count == 1
    finally:
        for conn in conns:
            conn.close()
        here.close()
        there.close()
    assert hub.agents() == 0


def _bound(endpoint: Any, agent: str) -> bool:
    """Whether a connection to ``endpoint`` is bound to ``agent`` (its frame handled)."""
    with endpoint._lock:
        return any(p.source == f"NIXL agent {agent}" for p in endpoint._peers)


def _ended_with(conn: Any, pattern: str) -> bool:
    try:
        conn.check()
    except TransferError as err:
        assert pattern in str(err), str(err)
        return True
    return False


class _Endpoint:
    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []

    def on_notification(self, agent: str, message: bytes) -> None:
        self.got.append((agent, message))


def test_notifications_wait_for_their_agents_binding_and_stop_at_its_endpoints_close() -> None:
    """A write's notification can overtake the agent frame that binds its connection: it
    is held (in order) until the binding, then handed to that endpoint; another agent's
    never reaches it; once the endpoint closed, its agents' notifications are dropped."""
    from kvferry.transports.nixl_hub import ReceiverHub

    hub = ReceiverHub()  # no endpoint attached: no agent, no poller; routing alone
    a, b = _Endpoint(), _Endpoint()
    assert hub._route({"x": [b"1", b"2"], "y": [b"y1"]}) == []
    assert hub.bind("x", a) is None
    assert hub.bind("y", b) is None
    batches = hub._route({"x": [b"3"]})
    assert batches == [(a, "x", [b"1", b"2"]), (b, "y", [b"y1"]), (a, "x", [b"3"])]
    assert hub.bind("x", b) is a  # held by a's open connection
    hub.unbind("x", a)  # a's connection ended: late notifications still go to a
    assert hub._route({"x": [b"4"]}) == [(a, "x", [b"4"])]
    hub._endpoints.update({id(a), id(b)})
    hub.detach(a)
    assert hub._route({"x": [b"5"], "y": [b"y2"]}) == [(b, "y", [b"y2"])]
    assert hub.dropped == 1


@pytest.mark.cuda
def test_cuda_head_slices_share_one_registration_and_land_bit_exact(nixl_hub: Any) -> None:
    """VRAM: two prefill ranks (hubs of their own) write the two head slices of one CUDA
    pool, poisoned with NaN, through endpoints of one receiver hub: the pool's allocation is
    registered once, each head holds its rank's blocks bit for bit, the rest stays NaN."""
    from kvferry.layout import paged_kv_from_views
    from kvferry.transports.nixl import NixlEndpoint

    views = head_views(2, float("nan"), "cuda")
    pool = paged_kv_from_views(views, num_blocks=BLOCKS, tokens_per_block=TOKENS)
    receivers = [KVReceiver(pool.heads(r, r + 1)) for r in range(2)]
    hub = nixl_hub.ReceiverHub()
    authkey = secrets.token_bytes(32)
    endpoints = [NixlEndpoint(receiver, authkey=authkey, hub=hub) for receiver in receivers]
    ranks: list[Rank] = []
    try:
        ranks = [Rank(nixl_hub, r, endpoints[r].address, authkey, "cuda") for r in range(2)]
        assert hub.registrations() == 1 and nixl_hub.registered_by_agent[endpoints[0].agent.name] == 1
        for rank, receiver in zip(ranks, receivers):
            rank.send(7, receiver.expect(7, len(DST_IDS) * TOKENS, dst_blocks=DST_IDS))
        for receiver in receivers:
            receiver.wait(7, timeout=SLACK)
            assert receiver.release(7).is_complete
        torch.cuda.synchronize()
        untouched = np.setdiff1d(np.arange(BLOCKS), DST_IDS)
        for r in range(2):
            landed = torch.stack([view[:, r : r + 1] for view in views])
            assert torch.equal(landed[:, DST_IDS], ranks[r].kv[:, SRC_IDS])
            assert bool(torch.isnan(landed[:, untouched]).all())
    finally:
        for rank in ranks:
            rank.close()
        for endpoint in endpoints:
            endpoint.close()
    assert hub.agents() == 0 and hub.registrations() == 0


def test_a_write_is_asked_about_soon_after_it_starts_then_less_and_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NIXL write's state is asked of NIXL first 50 us after the previous look, then at
    twice the interval each time up to `CHECK_SECONDS`, however often the announcer looks: a
    small write UCX finished early is found done within a few hundred microseconds, a long
    one is asked at most every millisecond (asking takes the UCX worker the transfer needs).
    Time is the test's own clock, advanced by hand."""
    pytest.importorskip("nixl")
    import types

    from kvferry.transports import nixl as nixl_mod

    clock = [1000.0]
    monkeypatch.setattr(nixl_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: None))
    asked: list[float] = []
    state = ["PROC"]

    class Agent:
        def transfer(self, handle: object) -> str:
            return "PROC"

        def check_xfer_state(self, handle: object) -> str:
            asked.append(round((clock[0] - 1000.0) * 1e6))
            return state[0]

        def release_xfer_handle(self, handle: object) -> None:
            pass

    pending = nixl_mod._XferPending(Agent(), ["h"], [], "receiver", None)
    for us in (0, 10, 60, 110, 250, 320, 730, 1540, 2400, 2550, 3400, 3560):
        clock[0] = 1000.0 + us * 1e-6
        assert not pending.done()
    assert asked == [0, 110, 320, 730, 1540, 2550, 3560]
    state[0] = "DONE"
    clock[0] = 1000.0 + 4000e-6
    assert not pending.done()  # 440 us since the last look: not asked yet
    clock[0] = 1000.0 + 4570e-6
    assert pending.done()
    assert asked[-1] == 4570
