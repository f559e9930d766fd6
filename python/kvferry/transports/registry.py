"""The one table of kvferry's transports: which exist, where each runs, and how to build a
receiver's endpoint and a sender's transport from a name or URL.

```
receiver process                                    sender process
pool = receiver_pool("shm", ...)   (shared memory where the transport needs it)
served = serve("shm", receiver, authkey=k, shared=pool.shared)
served.url  "shm+unix:///tmp/kvferry-.../notices.sock"  --->  connect(url, authkey=k, src=...)
served = serve("nixl", receiver, authkey=k, address="tcp://10.0.0.1:0")
served.url  "nixl+tcp://10.0.0.1:41234"                   --->  (from another host)
```
A URL is ``<transport>+<control address>``: the transport names how bytes move, the address
where the receiver takes notices. The in-process transport has no endpoint: the sender is
handed the receiver itself (``connect("in-process", receiver=r)``).

Everything that picks a transport by name (CLI flags, benches, the reference engine, the
soak driver, tests) asks this module: `names`, `spec`, `check` (may it run with these pools,
this far apart?), `receiver_pool`, `serve`, `connect`. No other table of names or
capabilities exists.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvferry.errors import InvalidArgumentError

# A staging ring's size where its user does not choose one, by the pools' device
# (`staging.default_ring_bytes`; the vLLM connector's `staging_bytes`). A write is at most half
# the ring, and the sender can have only the ring's slots in flight until the receiver frees
# them, so a small ring turns the link into a round trip per half ring. Measured on one H100
# (`kvferry bench copy --device cuda --transport staging --ring-mib M`, 4 MiB blocks,
# docs/benchmarks.md): a 64 MiB ring moved 10.6-13.5 GB/s, a 1 GiB ring 37.6-40.1 GB/s (83-88%
# of the link's both-ways rate), as much as a ring of the receiver's whole pool. CPU pools
# copy at memory speed with little latency per round trip: 64 MiB is enough there.
STAGING_RING_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}

if TYPE_CHECKING:  # the table itself imports nothing heavy: the CLI reads it to parse flags
    import torch

    from kvferry.layout import PagedKV
    from kvferry.receiver import KVReceiver
    from kvferry.transports.base import Transport

__all__ = [
    "Reach",
    "ReceiverPool",
    "Served",
    "TransportSpec",
    "check",
    "connect",
    "names",
    "STAGING_RING_BYTES",
    "parse_url",
    "receiver_pool",
    "serve",
    "spec",
]


class Reach(enum.IntEnum):
    """How far apart a transport's two sides may be; each reach includes the nearer ones."""

    PROCESS = 1  # sender and receiver in one process
    HOST = 2  # processes on one host
    NETWORK = 3  # processes on different hosts

    @property
    def words(self) -> str:
        return {Reach.PROCESS: "in one process", Reach.HOST: "on one host", Reach.NETWORK: "across hosts"}[self]


@dataclass(frozen=True)
class TransportSpec:
    """One transport: where it runs and how its two sides are built."""

    name: str
    devices: tuple[str, ...]  # devices of the pools it serves (both sides alike)
    reach: Reach  # the farthest apart its sides may be
    # The sender's copy engine writes straight into the receiver's pool, so an engine that
    # paces its copies (ThreadCopyEngine(link_gbps)) emulates the link; the others move bytes
    # through their own agent or a staging ring.
    direct_copy: bool
    # The receiver's pool must live in a shared-memory segment (`receiver_pool` makes one).
    shared_pool: bool
    summary: str
    # Capabilities an engine adapter asks about instead of naming transports (kvferry.vllm):
    # ``ring_option``: the `serve` option that sizes the endpoint's staging ring (None: no
    # ring); ``refuses_late_writes``: the endpoint applies a write only for a request its
    # receiver still admits, so a request may be released without its sender's fence (a
    # one-sided write, as NIXL's, lands whatever the receiver decided).
    ring_option: Optional[str] = None
    refuses_late_writes: bool = False
    # ``peer_gpu``: the receiver's CUDA pool may be on another GPU of the host than the
    # sender's (staging: each leg crosses its own GPU's link; cuda-ipc: the sender's copy
    # kernel writes into the peer GPU).
    peer_gpu: bool = False
    # Builders (see `serve` and `connect`): the receiver's endpoint (None: the transport has
    # none) and the sender's transport.
    _serve: Optional[Callable[..., Any]] = field(default=None, repr=False, compare=False)
    _connect: Optional[Callable[..., Transport]] = field(default=None, repr=False, compare=False)

    @property
    def has_endpoint(self) -> bool:
        """Whether the receiver serves an endpoint (every transport but the in-process one)."""
        return self._serve is not None


def names(*, device: Optional[str] = None, reach: Optional[Reach] = None) -> tuple[str, ...]:
    """Every transport's name, in the table's order; only those serving ``device`` pools and
    reaching at least ``reach`` when given."""
    return tuple(
        s.name
        for s in _SPECS.values()
        if (device is None or device in s.devices) and (reach is None or s.reach >= reach)
    )


def spec(name: str, *, argument: str = "transport") -> TransportSpec:
    """The transport called ``name``; `InvalidArgumentError` naming ``argument`` otherwise."""
    found = _SPECS.get(name) if isinstance(name, str) else None
    if found is None:
        raise InvalidArgumentError(f"invalid {argument}={name!r}: unknown transport; choose from {', '.join(_SPECS)}")
    return found


def check(
    name: str,
    *,
    device: Optional[str] = None,
    reach: Optional[Reach] = None,
    argument: str = "transport",
    device_argument: str = "device",
) -> TransportSpec:
    """The transport called ``name``, refused with `InvalidArgumentError` (naming the
    arguments and their values, and what would do) when it cannot serve ``device`` pools or
    cannot run with its sides ``reach`` apart."""
    s = spec(name, argument=argument)
    if device is not None and device not in s.devices:
        fits = names(device=device, reach=reach)
        raise InvalidArgumentError(
            (
                f"invalid {argument}={name!r} for {device_argument}={device!r}: {name} serves "
                f"{' and '.join(s.devices)} pools"
            )
            + (f"; for {device} pools choose from {', '.join(fits)}" if fits else "")
        )
    if reach is not None and s.reach < reach:
        fits = names(device=device, reach=reach)
        raise InvalidArgumentError(
            f"invalid {argument}={name!r} {reach.words}: {name} runs only {s.reach.words}"
            + (f"; {reach.words} choose from {', '.join(fits)}" if fits else "")
        )
    return s


def parse_url(url: str) -> tuple[str, Optional[str]]:
    """``"<transport>+<address>"`` -> (transport, address); a bare name -> (name, None).

    >>> parse_url("shm+unix:///tmp/x/notices.sock")
    ('shm', 'unix:///tmp/x/notices.sock')
    """
    if not isinstance(url, str):
        raise InvalidArgumentError(f"invalid url={url!r}: must be a transport name or '<transport>+<address>'")
    head, plus, address = url.partition("+")
    if plus and head not in _SPECS:
        raise InvalidArgumentError(f"invalid url={url!r}: unknown transport {head!r}; choose from {', '.join(_SPECS)}")
    spec(head)
    if plus and not address:
        raise InvalidArgumentError(f"invalid url={url!r}: no address after '{head}+'")
    return head, (address if plus else None)


class ReceiverPool:
    """A zeroed receiver pool of the kind a transport serves: in a shared-memory segment
    (``shared``, a `SharedPool`) where the transport maps it from another process, else plain
    tensors on ``device``. `close` drops it (and removes the segment)."""

    def __init__(self, pool: PagedKV, shared: Any = None) -> None:
        self.pool = pool
        self.shared = shared

    @property
    def serve_options(self) -> dict[str, Any]:
        """What `serve` needs to know of this pool: ``shared`` where it lives in shared memory
        (``serve(name, receiver, authkey=k, **pool.serve_options)`` serves any transport's)."""
        return {} if self.shared is None else {"shared": self.shared}

    def close(self) -> None:
        self.pool = None  # type: ignore[assignment]
        if self.shared is not None:
            self.shared.close()
            self.shared = None


def receiver_pool(
    name: str,
    *,
    num_layers: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    tokens_per_block: int,
    device: str = "cpu",
) -> ReceiverPool:
    """``num_layers`` zeroed tensors of ``shape`` (blocks first), served by transport
    ``name`` (checked against ``device``)."""
    import torch

    from kvferry.layout import PagedKV

    s = check(name, device=torch.device(device).type)
    if s.shared_pool:
        from kvferry.transports.shm import SharedPool

        shared = SharedPool.create(num_layers=num_layers, shape=shape, dtype=dtype, tokens_per_block=tokens_per_block)
        assert shared.pool is not None
        return ReceiverPool(shared.pool, shared)
    return ReceiverPool(
        PagedKV(tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)), tokens_per_block)
    )


@dataclass
class Served:
    """A receiver's endpoint and the URL senders connect to."""

    name: str
    endpoint: Any  # a LocalEndpoint (or subclass): errors, peer_count, close
    url: str

    def close(self) -> None:
        self.endpoint.close()


def _url_of(name: str, address: str) -> str:
    return f"{name}+{address}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may name another host
        return False


def _check_reach(name: str, address: str, argument: str, shown: Optional[str] = None) -> None:
    """A ``tcp://`` address off loopback may join two hosts: refused for a transport that
    runs only on one (its pool is mapped, not sent: shared memory, CUDA IPC, a host ring)."""
    from kvferry.transports import wire

    shown = address if shown is None else shown
    where = wire.parse_address(address, argument)
    s = _SPECS[name]
    if where.scheme == "tcp" and not _loopback(where.host) and s.reach < Reach.NETWORK:
        raise InvalidArgumentError(
            f"invalid {argument}={shown!r} for transport {name!r}: a tcp:// address off loopback reaches across hosts, "
            f"and {name} runs only {s.reach.words}; across hosts choose from {', '.join(names(reach=Reach.NETWORK))}"
        )


# What every endpoint and every transport with one takes (kvferry.transports.control): where
# to listen (``address``: unix://, unix:///path, tcp://host:port), the host peers reach a
# wildcard bind by (``advertise``), and how long a peer has for the handshake.
ENDPOINT_OPTIONS = ("address", "advertise", "handshake_timeout")
TRANSPORT_OPTIONS = ("handshake_timeout",)


def _options(name: str, options: dict[str, Any], side: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """``options`` with every key in ``allowed``; else `InvalidArgumentError` naming the first other."""
    for key in sorted(options):
        if key not in allowed:
            raise InvalidArgumentError(
                f"invalid option {key}={options[key]!r}: the {name} {side} takes {', '.join(allowed) or 'no options'}"
            )
    return options


def _serve_shm(receiver: KVReceiver, authkey: bytes, shared: Any = None, **options: Any) -> Any:
    from kvferry.transports.shm import ShmEndpoint

    if shared is None or shared.pool is not receiver.pool:
        raise InvalidArgumentError(
            (
                f"invalid shared={shared!r}: the shm endpoint serves the receiver's pool from shared memory; make "
                "it with receiver_pool('shm', ...) and pass its .shared"
            )
        )
    return ShmEndpoint(
        receiver, shared, authkey=authkey, **_options("shm", options, "endpoint", ENDPOINT_OPTIONS + ("shared",))
    )


def _serve_cuda_ipc(receiver: KVReceiver, authkey: bytes, **options: Any) -> Any:
    from kvferry.transports.cuda_ipc import CudaIpcEndpoint

    return CudaIpcEndpoint(receiver, authkey=authkey, **_options("cuda-ipc", options, "endpoint", ENDPOINT_OPTIONS))


def _serve_staging(receiver: KVReceiver, authkey: bytes, capacity_blocks: Optional[int] = None, **options: Any) -> Any:
    from kvferry.transports.staging import StagingEndpoint

    capacity = receiver.pool.num_blocks if capacity_blocks is None else capacity_blocks
    return StagingEndpoint(
        receiver,
        authkey=authkey,
        capacity_blocks=capacity,
        **_options("staging", options, "endpoint", ENDPOINT_OPTIONS + ("capacity_blocks",)),
    )


def _serve_nixl(receiver: KVReceiver, authkey: bytes, **options: Any) -> Any:
    from kvferry.transports.nixl import NixlEndpoint

    return NixlEndpoint(receiver, authkey=authkey, **_options("nixl", options, "endpoint", ENDPOINT_OPTIONS))


def serve(name: str, receiver: KVReceiver, *, authkey: bytes, **options: Any) -> Served:
    """The endpoint of transport ``name`` serving ``receiver``. Options: ``address`` (where
    to listen: ``unix://``, the default, a fresh private socket; ``unix:///path``;
    ``tcp://host:port``, port 0 for any, off loopback only for a transport that runs across
    hosts), ``advertise`` (the host a wildcard bind is reached by), ``handshake_timeout``;
    ``shared`` (shm: the `SharedPool` holding the receiver's pool), ``capacity_blocks``
    (staging: ring size, default the pool's size)."""
    s = check(name, device=receiver.pool.device.type, device_argument="receiver.pool.device")
    if not s.has_endpoint:
        raise InvalidArgumentError(
            (
                f"invalid transport={name!r} for serve: {name} has no endpoint; hand the sender the receiver "
                f"itself, connect({name!r}, receiver=...)"
            )
        )
    if "address" in options:
        _check_reach(name, options["address"], "address")
    assert s._serve is not None
    endpoint = s._serve(receiver, authkey, **options)
    return Served(name, endpoint, _url_of(name, endpoint.address))


def connect(
    url: str,
    *,
    authkey: Optional[bytes] = None,
    receiver: Optional[KVReceiver] = None,
    src: Optional[PagedKV] = None,
    host_src: Optional[PagedKV] = None,
    **options: Any,
) -> Transport:
    """The sender's transport to the receiver at ``url`` (``"<transport>+<address>"`` from
    `Served.url`), or to ``receiver`` itself for ``"in-process"``. ``src`` and ``host_src``
    are the sender's pool and host tier (NIXL registers them; the others read any pool).
    Options: ``handshake_timeout`` (seconds for the handshake), ``write_bytes`` (staging:
    the most bytes one write carries). A ``tcp://`` address off loopback is refused for a
    transport that runs only on one host."""
    name, address = parse_url(url)
    s = spec(name)
    if not s.has_endpoint:
        _options(name, options, "transport", ())
        if receiver is None or address is not None:
            raise InvalidArgumentError(
                f"invalid url={url!r}: the in-process transport takes no address; pass receiver="
            )
        from kvferry.transports.inprocess import InProcessTransport

        return InProcessTransport(receiver)
    if address is None:
        raise InvalidArgumentError(
            f"invalid url={url!r}: {name} needs the endpoint's address, '{name}+<address>' (Served.url)"
        )
    if receiver is not None:
        raise InvalidArgumentError(
            f"invalid receiver={receiver!r}: {name} reaches its receiver at {address}, not in this process"
        )
    if authkey is None:
        raise InvalidArgumentError(f"invalid authkey=None: {name} authenticates both sides with the session key")
    _check_reach(name, address, "url", url)
    assert s._connect is not None
    return s._connect(address, authkey, src, host_src, **options)


def _connect_shm(
    address: str, authkey: bytes, src: Optional[PagedKV], host_src: Optional[PagedKV], **options: Any
) -> Transport:
    from kvferry.transports.shm import ShmTransport

    return ShmTransport(address, authkey=authkey, **_options("shm", options, "transport", TRANSPORT_OPTIONS))


def _connect_cuda_ipc(
    address: str, authkey: bytes, src: Optional[PagedKV], host_src: Optional[PagedKV], **options: Any
) -> Transport:
    from kvferry.transports.cuda_ipc import CudaIpcTransport

    # The handles are mapped on the GPU the sender's pool (so its copies) lives on (a CUDA
    # tensor's device always names its index).
    device = src.device.index if src is not None and src.device.type == "cuda" else None
    return CudaIpcTransport(
        address,
        authkey=authkey,
        device=device,
        **_options("cuda-ipc", options, "transport", TRANSPORT_OPTIONS),
    )


def _connect_staging(
    address: str,
    authkey: bytes,
    src: Optional[PagedKV],
    host_src: Optional[PagedKV],
    write_bytes: Optional[int] = None,
    **options: Any,
) -> Transport:
    from kvferry.transports.staging import StagingTransport

    return StagingTransport(
        address,
        authkey=authkey,
        write_bytes=write_bytes,
        **_options("staging", options, "transport", TRANSPORT_OPTIONS),
    )


def _connect_nixl(
    address: str, authkey: bytes, src: Optional[PagedKV], host_src: Optional[PagedKV], **options: Any
) -> Transport:
    from kvferry.transports.nixl import NixlTransport

    if src is None:
        raise InvalidArgumentError("invalid src=None: a NIXL transport registers the sender's pool; pass src=")
    return NixlTransport(
        address,
        authkey=authkey,
        src=src,
        host_src=host_src,
        **_options("nixl", options, "transport", TRANSPORT_OPTIONS),
    )


# The table: every transport, where it runs, its builders. The one place that lists them.
_SPECS: dict[str, TransportSpec] = {
    s.name: s
    for s in (
        TransportSpec(
            "in-process",
            ("cpu", "cuda"),
            Reach.PROCESS,
            True,
            False,
            "both pools in one process; writes are direct copies",
        ),
        TransportSpec(
            "shm",
            ("cpu",),
            Reach.HOST,
            True,
            True,
            "the receiver's CPU pool in POSIX shared memory, mapped by the sender",
            _serve=_serve_shm,
            _connect=_connect_shm,
        ),
        TransportSpec(
            "cuda-ipc",
            ("cuda",),
            Reach.HOST,
            True,
            False,
            "the receiver's CUDA pool mapped by the sender through CUDA IPC handles",
            peer_gpu=True,
            _serve=_serve_cuda_ipc,
            _connect=_connect_cuda_ipc,
        ),
        TransportSpec(
            "staging",
            ("cpu", "cuda"),
            Reach.HOST,
            False,
            False,
            "through a pinned shared host ring (a machine without GPUDirect)",
            ring_option="capacity_blocks",
            refuses_late_writes=True,
            peer_gpu=True,
            _serve=_serve_staging,
            _connect=_connect_staging,
        ),
        TransportSpec(
            "nixl",
            ("cpu", "cuda"),
            Reach.NETWORK,
            False,
            False,
            "one-sided NIXL writes; notices ride on the writes",
            _serve=_serve_nixl,
            _connect=_connect_nixl,
        ),
    )
}
