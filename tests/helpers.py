"""What the data-plane tests build and check again and again, in one place (vLLM's
tests/v1/kv_connector/unit/utils.py is the model): pools of one geometry (`Pools`), a sender
and a receiver in one process (`in_process_pair`), a receiver behind an endpoint of any
cross-process transport (`serve`, `shm_endpoint`), the waits and counts a fault test needs
(`until`, `no_new_threads`, `open_fds`), and the leak check every transfer can end with
(`assert_nothing_leased`: no request held, no source block leased, no staging slot or ring,
no connection, thread, descriptor or shared-memory segment left).

The leak check reads a few private fields of the library (a receiver's records, a sender's
queues, a staging ring's slot count): tests may, and this is the one place that does, so a
change of those fields is one edit here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import secrets
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from kvferry.engine import CopyEngine, Pending
from kvferry.errors import TransferError
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports.control import LocalEndpoint
from kvferry.transports.inprocess import InProcessTransport
from kvferry.transports.shm import SharedPool, ShmEndpoint

# Upper bounds only: how long a failure or a wind-down may take on a loaded 2-core machine.
SLACK = 20.0


@dataclasses.dataclass(frozen=True)
class Pools:
    """One pool geometry and the pools of it a test needs: ``layers`` tensors of ``shape``
    (the block dimension ``block_dim``), ``tpb`` tokens per block."""

    shape: tuple[int, ...]
    layers: int
    tpb: int
    block_dim: int = 0
    dtype: torch.dtype = torch.float32

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @classmethod
    def like(cls, pool: PagedKV, **changes: Any) -> Pools:
        """The geometry of ``pool``, with some fields changed (``num_blocks=...`` too)."""
        shape = list(pool.shape)
        shape[pool.block_dim] = changes.pop("num_blocks", shape[pool.block_dim])
        geometry = cls(tuple(shape), pool.num_layers, pool.tokens_per_block, pool.block_dim, pool.dtype)
        return geometry.but(**changes)

    def but(self, **changes: Any) -> Pools:
        """The same geometry with some fields changed (``shape=..., dtype=...``)."""
        return dataclasses.replace(self, **changes)

    def random(self, seed: int, device: str = "cpu", scale: float = 1.0) -> PagedKV:
        """Random values from ``seed``: the same pool in every process that asks for it."""
        gen = torch.Generator().manual_seed(seed)
        layers = []
        for _ in range(self.layers):
            t = torch.randn(self.shape, generator=gen)
            layers.append((t * scale if scale != 1.0 else t).to(device=device, dtype=self.dtype))
        return self.of(layers)

    def random_bytes(self, seed: int, device: str = "cpu") -> PagedKV:
        """Every byte random (NaN and infinity patterns too): for copies checked bit for bit."""
        gen = torch.Generator().manual_seed(seed)
        nbytes = math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()
        return self.of(
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            .view(self.dtype)
            .view(self.shape)
            .to(device)
            for _ in range(self.layers)
        )

    def filled_bytes(self, byte: int, device: Any = "cpu") -> PagedKV:
        """Every byte ``byte``: a poison no copy writes by chance."""
        nbytes = math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()
        return self.of(
            torch.full((nbytes,), byte, dtype=torch.uint8, device=device).view(self.dtype).view(self.shape)
            for _ in range(self.layers)
        )

    def full(self, value: float, device: str = "cpu") -> PagedKV:
        return self.of(torch.full(self.shape, value, dtype=self.dtype, device=device) for _ in range(self.layers))

    def zeros(self, device: str = "cpu") -> PagedKV:
        return self.full(0.0, device)

    def nan(self, device: str = "cpu") -> PagedKV:
        """Poisoned with NaN: a block no write reached never passes for one."""
        return self.full(float("nan"), device)

    def of(self, layers: Iterable[torch.Tensor]) -> PagedKV:
        """A pool of this block size over ``layers`` (tensors the test made)."""
        return PagedKV(tuple(layers), self.tpb, self.block_dim)

    def shared(self) -> SharedPool:
        """A zero-filled pool in a new shared-memory segment (the caller closes it)."""
        return SharedPool.create(
            num_layers=self.layers,
            shape=self.shape,
            dtype=self.dtype,
            tokens_per_block=self.tpb,
            block_dim=self.block_dim,
        )


# The geometry of the fault, fencing, attack and wire tests: 64 blocks of 2 x 4 tokens x 16
# floats per layer, 2 layers.
POOLS = Pools(shape=(64, 2, 4, 16), layers=2, tpb=4)
# The geometry of the end-to-end transfer tests (test_transfer's `REQUESTS` and the modules
# that drive them): 96 blocks of 2 x 4 tokens x 8 floats per layer, 3 layers (so 2 layer
# groups are of uneven size).
TRANSFER_POOLS = Pools(shape=(96, 2, 4, 8), layers=3, tpb=4)


class _Gate(Pending):
    """A copy that finishes when the test says so (its work runs once, on whichever thread
    asks first: the executor or the sender's announcer)."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.opened = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            if self.opened and self.work is not None:
                self.work(), setattr(self, "work", None)
            return self.opened

    def wait(self, timeout: Any) -> bool:
        return self.done()


class ManualEngine(CopyEngine):
    """A copy engine whose copies run when the test opens their gate
    (``engine.gates[i].opened = True``), in any order: every interleaving of copies,
    notices and cancels is forced, not hoped for."""

    def __init__(self) -> None:
        self.gates: list[_Gate] = []

    def submit_call(self, work: Any, *, after: Any = (), nbytes: int = 0) -> Pending:
        gate = _Gate(work)
        self.gates.append(gate)
        return gate


def in_process_pair(
    src: Optional[PagedKV] = None, dst: Optional[PagedKV] = None, **sender_options: Any
) -> tuple[KVSender, KVReceiver]:
    """A sender over an in-process transport to a receiver (random pools of `POOLS` unless
    given: seeds 0 and 1); ``sender_options`` go to `KVSender` (``engine``, ``timeout``...)."""
    receiver = KVReceiver(dst if dst is not None else POOLS.random(1))
    sender = KVSender(src if src is not None else POOLS.random(0), InProcessTransport(receiver), **sender_options)
    return sender, receiver


@dataclasses.dataclass
class Served:
    """A receiver behind an endpoint, and the shared pool it owns (shm only)."""

    receiver: KVReceiver
    endpoint: LocalEndpoint
    authkey: bytes
    shared: Optional[SharedPool] = None

    @property
    def segment(self) -> Optional[str]:
        """The shared-memory segment a killed process would leave behind (shm only)."""
        return None if self.shared is None else str(self.shared.descriptor["name"])

    def close(self) -> None:
        """The endpoint (its threads joined), then the shared pool."""
        self.endpoint.close()
        if self.shared is not None:
            self.shared.close()


def serve(
    transport: str,
    pool: Optional[PagedKV] = None,
    *,
    authkey: Optional[bytes] = None,
    pools: Pools = POOLS,
    capacity_blocks: int = 12,
    **options: Any,
) -> Served:
    """A receiver of ``pool`` behind an endpoint of ``transport`` (``shm``, ``staging``,
    ``nixl`` or ``cuda-ipc``), with a fresh key unless given. ``shm`` makes its own pool
    (shared memory of ``pools``' geometry, zero-filled); the others take ``pool`` (default:
    zeros of ``pools``). A staging ring holds ``capacity_blocks`` blocks (small: batches wrap
    around it and wait for frees). ``options`` go to the endpoint (``address``...)."""
    authkey = authkey if authkey is not None else secrets.token_bytes(32)
    if transport == "shm":
        assert pool is None, "an shm receiver's pool is the shared one it makes"
        shared = pools.shared()
        assert shared.pool is not None
        receiver = KVReceiver(shared.pool)
        try:
            return Served(receiver, ShmEndpoint(receiver, shared, authkey=authkey, **options), authkey, shared)
        except BaseException:
            shared.close()
            raise
    receiver = KVReceiver(pool if pool is not None else pools.zeros())
    endpoint: LocalEndpoint
    if transport == "staging":
        from kvferry.transports.staging import StagingEndpoint

        endpoint = StagingEndpoint(receiver, authkey=authkey, capacity_blocks=capacity_blocks, **options)
    elif transport == "nixl":
        from kvferry.transports.nixl import NixlEndpoint

        endpoint = NixlEndpoint(receiver, authkey=authkey, **options)
    elif transport == "cuda-ipc":
        from kvferry.transports.cuda_ipc import CudaIpcEndpoint

        endpoint = CudaIpcEndpoint(receiver, authkey=authkey, **options)
    else:
        raise ValueError(f"invalid transport={transport!r}: shm, staging, nixl or cuda-ipc")
    return Served(receiver, endpoint, authkey)


@contextlib.contextmanager
def shm_endpoint(
    address: str = "unix://", pools: Pools = POOLS, **options: Any
) -> Iterator[tuple[KVReceiver, ShmEndpoint, bytes]]:
    """A receiver with a shared pool and its endpoint in this process, listening on
    ``address``: notices from the test's transports still cross a real socket and the
    endpoint's connection threads. Yields ``(receiver, endpoint, authkey)``."""
    served = serve("shm", pools=pools, address=address, **options)
    try:
        assert isinstance(served.endpoint, ShmEndpoint)
        yield served.receiver, served.endpoint, served.authkey
    finally:
        served.close()


def digest(pool: PagedKV, blocks: Iterable[int]) -> str:
    """The bytes of ``blocks`` (in that order) over every layer."""
    h = hashlib.sha256()
    ids = torch.tensor(list(blocks), dtype=torch.int64)
    for layer in pool.layers:
        h.update(layer.index_select(0, ids.to(layer.device)).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def tables(*rows: Sequence[int]) -> np.ndarray:
    """A block table: one row per request, padded with -1."""
    width = max(len(r) for r in rows)
    table = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


class Blocks:
    """A pool's free list, as an engine keeps one: a block handed out twice or freed twice is
    a bug the test should see, and ``free == total`` at the end means nothing leaked."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = list(range(total - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), f"pool exhausted: {n} wanted, {len(self._free)} free"
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert b not in self._free, f"block {b} freed twice"
            self._free.append(b)

    @property
    def free(self) -> int:
        return len(self._free)


# --- the command line ---------------------------------------------------------------------------

# The smallest reference model the benches run (1 layer of 32 hidden units, 64 tokens).
TINY_MODEL: dict[str, Any] = {
    "tokens_per_block": 16,
    "layers": 1,
    "hidden": 32,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 16,
    "ffn": 32,
    "vocab": 64,
}


def cli_argv(*command: str, **options: Any) -> list[str]:
    """``kvferry`` arguments: the subcommand words, then one ``--flag value`` per option
    (``kv_heads=2`` is ``--kv-heads 2``; ``True`` is the bare flag), in the order given."""
    argv = list(command)
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


# --- waits and counts ---------------------------------------------------------------------------


def in_thread(call: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
    """Runs ``call`` on a thread: the event is set once it returned or raised, and the list
    then holds what it returned or raised."""
    done, outcome = threading.Event(), []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:  # noqa: BLE001  (the test looks at it)
            outcome.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, outcome


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples in ``text`` (a /metrics page) whose labels
    include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def until(predicate: Callable[[], bool], timeout: float = SLACK) -> bool:
    """Waits for a condition the library reaches on another thread with no event a test can
    wait on (a NIXL notification taken in by UCX's progress): ``timeout`` only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# A bound for a spawned worker that hangs, not a timing expectation: on a loaded 2-core machine a
# spawned process that imports torch may take minutes to answer its first call.
HANG_SECONDS = 900.0


def reply_from(conn: Any, proc: Any, who: str) -> Any:
    """A spawned worker process's next reply on ``conn``, waited for as long as ``proc`` lives
    (its death ends the wait at once, naming it); ``HANG_SECONDS`` only stops a hung test."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + HANG_SECONDS
    while not conn.poll():
        assert proc.exitcode is None, f"the {who} exited (code {proc.exitcode}) without answering"
        assert time.monotonic() < deadline, f"the {who} did not answer within {HANG_SECONDS} s"
        wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
    return conn.recv()


def run_kernel_check(script: str) -> None:
    """Runs ``script`` in a fresh interpreter with Triton's interpreter on (TRITON_INTERPRET=1
    must be set before triton is imported, hence the process) and the tests folder on its
    path; it must exit 0 and print ``kernel ok``."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel ok" in proc.stdout


def kvferry_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvferry"))


def _still_running(pick: Callable[[threading.Thread], bool], timeout: float = SLACK) -> list[threading.Thread]:
    """Joins the live threads ``pick`` selects, looking again after each round (one may start
    after a look: a connection accepted late); returns those still running after ``timeout``
    (a bound on a hang, not an expectation of speed)."""
    deadline = time.monotonic() + timeout
    while (alive := [t for t in threading.enumerate() if pick(t)]) and time.monotonic() < deadline:
        for t in alive:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threading.enumerate() if pick(t)]


def threads_ended(name: str, timeout: float = SLACK) -> bool:
    """Whether every thread called ``name`` has ended (joined, within ``timeout``)."""
    return not _still_running(lambda t: t.name == name, timeout)


def no_new_threads(before: set[threading.Thread], timeout: float = SLACK) -> list[str]:
    """The kvferry threads started since ``before`` that are still alive after a bounded wait
    (threads being joined by a close may take a moment to be gone)."""
    return sorted(t.name for t in _still_running(lambda t: t not in before and t.name.startswith("kvferry"), timeout))


def open_fds() -> int:
    """How many descriptors this process holds open."""
    return len(os.listdir("/proc/self/fd"))


def left_in_shm(names: Iterable[str]) -> set[str]:
    """Which of ``names`` are still in /dev/shm (others' tests share it: only our own count)."""
    return set(names) & set(os.listdir("/dev/shm"))


# --- the leak check -------------------------------------------------------------------------------


def _receiver_leaks(receiver: KVReceiver) -> list[str]:
    with receiver._cond:  # noqa: SLF001
        held = {rid: record.stage.name for rid, record in receiver._requests.items()}  # noqa: SLF001
        awaited = {owner: sorted(deps) for owner, deps in receiver._dependents.items() if deps}  # noqa: SLF001
    leaks = [f"the receiver still holds requests {held} (id: stage): their destination blocks"] if held else []
    if awaited:
        leaks.append(f"the receiver still records requests awaiting others' blocks {awaited}")
    return leaks


def _sender_leaks(sender: KVSender, timeout: float) -> list[str]:
    leaks = []
    with sender._lock:  # noqa: SLF001
        records = {rid: record.stage.name for rid, record in sender._requests.items()}  # noqa: SLF001
        writes = [sorted({n.request_id for n in job.notices}) for job in sender._inflight]  # noqa: SLF001
        fences = sorted(sender._fences)  # noqa: SLF001
        booked = len(sender.book)
    if records:
        leased = sorted(rid for rid in records if sender.leased(rid))
        leaks.append(f"the sender still holds requests {records} (id: stage), their source blocks leased: {leased}")
    if writes:
        leaks.append(f"the sender still queues writes (of requests {writes})")
    if fences:
        leaks.append(f"the sender still owes the fences of requests {fences}")
    if booked:
        leaks.append(f"the sender's book still has {booked} entries")
    transport: Any = sender.transport
    # A staging ring's slots come back with the receiver's frees; a ring whose receiver is
    # gone goes with the connection (the sender unmaps it at close): nothing to give back.
    if hasattr(transport, "_used") and sender._lost is None:  # noqa: SLF001
        deadline = time.monotonic() + timeout
        # Under ``_wire``, which whoever reads or writes the connection holds (the announcer
        # posts and collects frees under it): two readers polling at once can both see the
        # one frame waiting, and the loser blocks in its read for good.
        with sender._wire:  # noqa: SLF001
            try:
                transport._collect_frees()  # noqa: SLF001
                while transport._used and transport.wait_for_room(max(0.0, deadline - time.monotonic())):  # noqa: SLF001
                    pass
            except TransferError:  # lost just now
                return leaks
            if transport._used:  # noqa: SLF001
                leaks.append(f"the sender's staging ring still has {transport._used} slots in use")  # noqa: SLF001
    return leaks


def _endpoint_leaks(endpoint: LocalEndpoint, timeout: float) -> list[str]:
    # A connection's thread ends once its sender's socket closed: joined, so what it frees
    # on the way out (its ring, its requests' fences) is freed by now.
    deadline = time.monotonic() + timeout
    for thread in list(endpoint._threads):  # noqa: SLF001
        thread.join(max(0.0, deadline - time.monotonic()))
    leaks = []
    running = [t.name for t in endpoint._threads if t.is_alive()]  # noqa: SLF001
    if running:
        leaks.append(f"the endpoint's connection threads {running} still run (a sender still connected?)")
    if endpoint.connected():
        leaks.append("a sender is still connected to the endpoint")
    rings = getattr(endpoint, "ring_names", None)
    if rings is not None and rings():
        leaks.append(f"the staging endpoint still holds rings {rings()}")
    return leaks


def assert_nothing_leased(
    receiver: Optional[KVReceiver] = None,
    *,
    sender: Optional[KVSender] = None,
    endpoint: Optional[LocalEndpoint] = None,
    threads: Optional[set[threading.Thread]] = None,
    fds: Optional[int] = None,
    segments: Iterable[str] = (),
    timeout: float = SLACK,
) -> None:
    """Fails, naming each leak, unless everything a transfer took was given back:

    - ``receiver``: no request expected any more (no lease, so no destination block held);
    - ``sender`` (before its `close`): no request registered or failed and unacknowledged (no
      source block leased), no queued write, no fence owed, an empty book; over staging,
      every ring slot freed by the receiver (waited for, up to ``timeout``);
    - ``endpoint`` (after its senders closed): no connection, no connection thread (joined,
      up to ``timeout``), no staging ring;
    - ``threads`` (`threading.enumerate()` taken before): no kvferry thread started since
      still runs (joined, up to ``timeout``); ``fds`` (`open_fds()` before): no more
      descriptors open now; ``segments``: none of these shared-memory names is left.

    ``timeout`` only bounds a wind-down that hangs."""
    leaks = []
    if receiver is not None:
        leaks += _receiver_leaks(receiver)
    if sender is not None:
        leaks += _sender_leaks(sender, timeout)
    if endpoint is not None:
        leaks += _endpoint_leaks(endpoint, timeout)
    if threads is not None and (left := no_new_threads(threads, timeout)):
        leaks.append(f"threads still running: {left}")
    if fds is not None and open_fds() > fds:
        leaks.append(f"{open_fds() - fds} descriptors more open than before ({open_fds()}, before {fds})")
    if left := left_in_shm(segments):
        leaks.append(f"shared-memory segments left: {sorted(left)}")
    assert not leaks, "leaked: " + "; ".join(leaks)


__all__ = [
    "POOLS",
    "HANG_SECONDS",
    "SLACK",
    "TRANSFER_POOLS",
    "Blocks",
    "ManualEngine",
    "Pools",
    "Served",
    "TINY_MODEL",
    "assert_nothing_leased",
    "cli_argv",
    "digest",
    "in_process_pair",
    "kvferry_threads",
    "left_in_shm",
    "no_new_threads",
    "open_fds",
    "reply_from",
    "run_kernel_check",
    "serve",
    "shm_endpoint",
    "tables",
    "threads_ended",
    "until",
]


@contextlib.contextmanager
def decode_worker(
    rendezvous_dir: str,
    num_blocks: int,
    block_size: int,
    *,
    pool: Optional[PagedKV] = None,
    config: Optional[dict[str, Any]] = None,
    **worker: Any,
) -> Iterator[Any]:
    """A started KvferryConnector decode-side worker half (kvferry.vllm.decode_worker, no
    engine) over one layer of ``num_blocks`` zeroed blocks registered as vLLM hands them (or
    over ``pool``), its rendezvous in ``rendezvous_dir``; ``config``: more connector settings,
    ``worker``: `WorkerCommon`'s own (``num_kv_heads`` ...); closed at exit. Needs vLLM's venv
    (the worker imports vLLM's types); tests/test_vllm_step.py, tests/test_tp.py and
    benches/python/bench_connector.py use it."""
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    common = WorkerCommon(
        ConnectorConfig(rendezvous_dir=rendezvous_dir, **(config or {})),
        block_size=block_size,
        num_blocks=num_blocks,
        authkey=b"k" * 32,
        **worker,
    )
    if pool is None:
        common.register_kv_caches({"layers.0.attn": torch.zeros(num_blocks, 2, block_size, 16)}, lambda name: 0)
    else:
        common.pool = pool
        common.layer_ids = list(range(pool.num_layers))  # as registered: layers 0, 1, ... in order
    worker = DecodeWorker(common)
    worker.start()
    try:
        yield worker
    finally:
        worker.close()
