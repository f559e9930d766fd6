"""One NIXL agent per process and role, shared by every NIXL endpoint or transport of it.

```
decode process                                  prefill process (one per engine rank)
  RECEIVERS hub: one agent, progress thread       SENDERS hub: one agent, no progress thread
    pool registered once (refcounted)               src / host_src registered once each
    one poller: notification from agent A  <------  every NixlTransport of the process
      -> the endpoint whose connection A is bound to  (one remote agent added per receiver hub)
  NixlEndpoint x N (one per prefill engine rank)
```
A hub makes its agent on first use and drops it when its last user leaves (its progress
thread ends with it, and a later user gets a fresh agent of a new name). Memory is
registered by the allocations the pool's tensors view (their storages), memoised and
reference-counted, so the head or layer slices of one pool that several receivers serve
share one registration, and the last user's release deregisters it.

A receiver hub routes each notification by the name of the agent that sent it to the one
endpoint holding a connection bound to that agent (`NixlEndpoint._on_agent`): a name is bound
to at most one live connection in the whole hub, so a sender's notices and fences reach its
own connection's receiver and no other. A notification that arrives before its agent's
connection was bound waits (bounded) for the binding; one from an agent whose endpoint closed
is dropped. A sender hub opens a second agent (a lane) only for a transport to a receiver
hub one of its agents already writes to (two endpoints of one process fed from one process,
as in-process tests do): that receiver could not tell the two connections' notifications
apart otherwise. One prefill process writing to one endpoint per decode process never
needs it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Optional, Protocol

import numpy as np

from kvferry import affinity
from kvferry.layout import PagedKV
from kvferry.transports import wire

__all__ = ["AgentHub", "Lane", "ReceiverHub", "receivers", "senders", "storage_spans"]

_log = logging.getLogger("kvferry")

POLL_SECONDS = 100e-6

# Notifications held for agents not bound to a connection yet (a write's notification can
# overtake the control frame that binds its agent): at most this many, over all agents.
MAX_PENDING = 4096


def _agent(role: str, progress_thread: bool = True) -> Any:
    """A NIXL agent on UCX. Its progress thread (``progress_thread``) polls without pause
    (about half a core) until the agent is destroyed, which happens only when the last
    object holding it goes: so every holder drops it as soon as it is done, rather than
    leave that to the garbage collector. Its calls take the agent's own lock
    (``NIXL_THREAD_SYNC_STRICT``): the transports and endpoints of a hub call it from their
    own threads."""
    from kvferry._optional import require

    require("nixl")
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    config = nixl_agent_config(
        enable_prog_thread=progress_thread, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    with affinity.on_transfer_cores():  # its progress thread starts here and inherits the cores
        return nixl_agent(f"kvferry-{role}-{secrets.token_hex(16)}", config)


def _mem_type(pool: PagedKV) -> str:
    return "VRAM" if pool.device.type == "cuda" else "DRAM"


def storage_spans(pool: PagedKV) -> list[tuple[int, int]]:
    """``(address, length)`` of each allocation the pool's layers view, overlapping ones
    merged: what a hub registers, whole, for the pool (and for every slice of it)."""
    spans = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in pool.layers if t.numel()})
    merged: list[list[int]] = []
    for start, length in spans:
        if merged and start < merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][0] + merged[-1][1], start + length) - merged[-1][0]
        else:
            merged.append([start, length])
    return [(a, n) for a, n in merged]


Key = tuple[int, int, int, str]  # (address, length, device, memory type)


class Lane:
    """One agent of a hub: what it registered (by `Key`, with its users) and the remote
    agents it writes to, one transport each."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.users = 0
        self._lock = threading.Lock()
        self._registered: dict[Key, list[Any]] = {}  # key -> [NIXL handle, users]
        self._peers: set[str] = set()  # remote agents a transport of this lane writes to

    def register(self, pool: PagedKV) -> list[Key]:
        """Registers the pool's allocations not registered yet; returns the keys to give
        back to `deregister`."""
        mem, device = _mem_type(pool), pool.device.index or 0
        keys = [(a, n, device, mem) for a, n in storage_spans(pool)]
        with self._lock:
            done: list[Key] = []
            try:
                for key in keys:
                    entry = self._registered.get(key)
                    if entry is None:
                        rows = np.array([key[:3]], dtype=np.uint64)
                        entry = self._registered[key] = [self.agent.register_memory(rows, mem), 0]
                    entry[1] += 1
                    done.append(key)
            except BaseException:
                self._drop(done)
                raise
        return keys

    def deregister(self, keys: list[Key]) -> None:
        with self._lock:
            self._drop(keys)

    def _drop(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self._registered[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._registered[key]
                self.agent.deregister_memory(entry[0])

    def live_registrations(self) -> int:
        with self._lock:
            return len(self._registered)

    def add_peer(self, metadata: bytes, name: str) -> None:
        """Adds the remote agent ``name`` the lane was acquired for (`AgentHub.acquire`)."""
        made = self.agent.add_remote_agent(metadata)
        added = made.decode(errors="replace") if isinstance(made, bytes) else str(made)
        if added != name:  # metadata of another agent than the hello named
            self.agent.remove_remote_agent(made)
            raise wire.ProtocolError(f"invalid NIXL hello: agent_metadata of agent {added!r}, not {name!r}")

    def remove_peer(self, name: str, *, added: bool = True) -> None:
        """Removes the remote agent (``added``: it was added) and frees the lane for
        another transport to it."""
        try:
            if added:
                self.agent.remove_remote_agent(name)
        finally:
            with self._lock:
                self._peers.discard(name)


class AgentHub:
    """The agents of one role in this process, made on first use and dropped when their
    last user leaves. `acquire` gives a `Lane`: the first agent not yet writing to ``peer``
    (see the module doc), a new one if every agent is."""

    def __init__(self, role: str, *, progress_thread: bool) -> None:
        self.role = role
        self.progress_thread = progress_thread
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []
        self.agents_made = 0  # over the hub's life

    def acquire(self, peer: Optional[str] = None) -> Lane:
        """A lane, claimed for a transport to remote agent ``peer`` when given (the
        transport adds it with `Lane.add_peer` and gives it back with `Lane.remove_peer`)."""
        with self._lock:
            lane = next((x for x in self._lanes if peer is None or peer not in x._peers), None)
            if lane is None:
                lane = Lane(_agent(self.role, progress_thread=self.progress_thread))
                self._lanes.append(lane)
                self.agents_made += 1
            lane.users += 1
            if peer is not None:
                with lane._lock:
                    lane._peers.add(peer)
            return lane

    def release(self, lane: Lane) -> None:
        """The lane's user is done (having deregistered what it registered); the last
        user's release drops the agent, and with it its progress thread."""
        with self._lock:
            lane.users -= 1
            if lane.users:
                return
            self._lanes.remove(lane)
        lane.agent = None  # see _agent

    def agents(self) -> int:
        """Agents alive now."""
        with self._lock:
            return len(self._lanes)

    def registrations(self) -> int:
        """Memory registrations alive now, over every agent."""
        with self._lock:
            lanes = list(self._lanes)
        return sum(lane.live_registrations() for lane in lanes)


class Endpoint(Protocol):
    """What a receiver hub needs of an endpoint: take one notification of an agent bound
    to one of its connections."""

    def on_notification(self, agent: str, message: bytes) -> None: ...


class ReceiverHub(AgentHub):
    """The receivers' hub: one agent (it is the target of writes: nothing needs a second)
    with its progress thread, and one poller thread (``kvferry-nixl-notifs``) for every
    endpoint, running while any endpoint is attached."""

    def __init__(self) -> None:
        super().__init__("rx", progress_thread=True)
        self._routes: dict[str, Optional[Endpoint]] = {}  # agent -> its endpoint; None: its endpoint closed
        self._live: dict[str, Endpoint] = {}  # agents bound to a connection open now
        self._pending: dict[str, deque[bytes]] = {}
        self._held = 0
        self._endpoints: set[int] = set()
        self._dispatching = threading.Lock()  # held by the poller while it hands a batch over
        self._stop = threading.Event()
        self._poller: Optional[threading.Thread] = None
        self.dropped = 0  # notifications no endpoint took (closed, or over MAX_PENDING)

    def attach(self, endpoint: Endpoint) -> Lane:
        """The endpoint's lane; starts the poller with the first endpoint."""
        lane = self.acquire()
        with self._lock:
            self._endpoints.add(id(endpoint))
            if self._poller is None:
                self._stop = threading.Event()
                self._poller = affinity.Thread(
                    target=self._poll, args=(lane, self._stop), name="kvferry-nixl-notifs", daemon=True
                )
                self._poller.start()
        return lane

    def detach(self, endpoint: Endpoint) -> None:
        """The endpoint is closing: once this returns, no notification reaches it (later
        ones of its agents are dropped). The last endpoint's detach stops the poller; the
        endpoint then deregisters its pool and releases its lane."""
        poller = None
        with self._lock:
            self._endpoints.discard(id(endpoint))
            for name, routed in list(self._routes.items()):
                if routed is endpoint:
                    self._routes[name] = None
                    self._live.pop(name, None)
            if not self._endpoints:
                poller, self._poller = self._poller, None
                self._stop.set()
                self._routes.clear()
                self._pending.clear()
                self._held = 0
        if poller is not None:
            poller.join(timeout=5)
        elif threading.current_thread() is not self._poller:
            with self._dispatching:  # a batch routed before the lines above has been handed over
                pass

    def bind(self, agent: str, endpoint: Endpoint) -> Optional[Endpoint]:
        """Routes ``agent``'s notifications to ``endpoint``, unless a connection open now at
        another endpoint holds it: returns that endpoint then (and binds nothing)."""
        with self._lock:
            holder = self._live.get(agent)
            if holder is not None and holder is not endpoint:
                return holder
            self._live[agent] = self._routes[agent] = endpoint
            return None

    def unbind(self, agent: str, endpoint: Endpoint) -> None:
        """``agent``'s connection to ``endpoint`` ended: another connection may claim it
        now; until one does, its notifications still go to ``endpoint`` (writes that
        finished before the end, whose requests the end fenced)."""
        with self._lock:
            if self._live.get(agent) is endpoint:
                del self._live[agent]

    def _poll(self, lane: Lane, stop: threading.Event) -> None:
        agent = lane.agent
        while not stop.is_set():
            got = agent.get_new_notifs()
            with self._dispatching:
                batches = self._route(got)
                for endpoint, name, messages in batches:
                    for message in messages:
                        endpoint.on_notification(name, message)
            if not batches and not got:
                time.sleep(POLL_SECONDS)

    def _route(self, got: dict[str, list[bytes]]) -> list[tuple[Endpoint, str, list[bytes]]]:
        """Each agent's messages with the endpoint they go to, those held for it first
        (in arrival order); holds those of agents not bound yet."""
        batches = []
        with self._lock:
            for name in [n for n in self._pending if self._routes.get(n) is not None]:
                held = self._pending.pop(name)
                self._held -= len(held)
                endpoint = self._routes[name]
                assert endpoint is not None
                batches.append((endpoint, name, list(held)))
            for name, messages in got.items():
                if name not in self._routes:
                    self._hold(name, messages)
                    continue
                endpoint = self._routes[name]
                if endpoint is None:
                    self.dropped += len(messages)
                    continue
                batches.append((endpoint, name, [bytes(m) for m in messages]))
        return batches

    def _hold(self, name: str, messages: list[bytes]) -> None:
        room = MAX_PENDING - self._held
        if len(messages) > room:
            self.dropped += len(messages) - room
            _log.warning(
                "kvferry: dropped %d NIXL notifications of agent %s, which no connection named (%d held already)",
                len(messages) - room,
                name,
                MAX_PENDING,
            )
            messages = messages[:room]
        if messages:
            self._pending.setdefault(name, deque()).extend(bytes(m) for m in messages)
            self._held += len(messages)


_hubs_lock = threading.Lock()
_receivers: Optional[ReceiverHub] = None
_senders: dict[bool, AgentHub] = {}


def receivers() -> ReceiverHub:
    """This process's receiver hub."""
    global _receivers
    with _hubs_lock:
        if _receivers is None:
            _receivers = ReceiverHub()
        return _receivers


def senders(progress_thread: bool) -> AgentHub:
    """This process's sender hub (one per progress-thread setting)."""
    with _hubs_lock:
        hub = _senders.get(progress_thread)
        if hub is None:
            hub = _senders[progress_thread] = AgentHub("tx", progress_thread=progress_thread)
        return hub
