"""The connector's path per prefill engine (kvferry.vllm.paths): ``auto`` offers CUDA IPC
over CUDA caches with staging behind it, a transport named explicitly is the only one, and a
prefill rank that cannot open the decode rank's handles falls back to staging for that peer
with one log line, never failing a request.

The two-process data path (`two_servers`) runs a decode server's tensor-parallel ranks in a
spawned process and a prefill server's ranks here, both through the connector's worker half
with vLLM's cache views: on CPU over staging (what ``auto`` picks there), on a GPU (``cuda``
marker) over CUDA IPC, head slices included. No vLLM needed.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers import reply_from, until
from kvferry.errors import InvalidArgumentError
from test_kv_layouts import layer_index, poison, random_bytes, vllm_views

KEY = b"k" * 32
SLACK = 60.0
SENDER = "paths-prefill-engine"
HEADS = 4
CONTENT = 2 * 8  # K|V of head size 8
LAYERS, BLOCKS, TOKENS = 3, 16, 4
# (request, kv id, prompt tokens, decode blocks held, its source blocks, its destination blocks)
REQUESTS = [
    ("r1", 101, 14, 0, [5, 2, 9, 0], [3, 10, 1, 6]),
    ("r2", 103, 20, 2, [7, 11, 4, 13, 15], [8, 12, 14, 2, 5]),
]


# -- the choice (no transfer) ------------------------------------------------------------


def test_auto_offers_cuda_ipc_then_staging_over_cuda_caches_and_staging_alone_over_cpu() -> None:
    from kvferry.vllm import paths

    assert paths.offered("auto", "cuda") == ("cuda-ipc", "staging")
    assert paths.offered("auto", "cpu") == ("staging",)
    assert paths.why_not_direct("cuda") is None
    assert paths.why_not_direct("cpu") == "the KV caches are on cpu; cuda-ipc serves cuda caches"


@pytest.mark.parametrize(("transport", "device"), [("staging", "cuda"), ("nixl", "cuda"), ("nixl", "cpu"),
                                                   ("cuda-ipc", "cuda")])  # fmt: skip
def test_an_explicit_transport_is_the_only_one_offered(transport: str, device: str) -> None:
    from kvferry.vllm import paths

    assert paths.offered(transport, device) == (transport,)


def test_explicit_cuda_ipc_over_cpu_caches_is_refused_by_name_at_registration(tmp_path: Path) -> None:
    """The operator's cuda-ipc over CPU caches: refused when the caches register (startup),
    naming the key, its value and the device, not at the first request."""
    half = _half(tmp_path, "kv_consumer", "cuda-ipc")
    cache = vllm_views("LBNHC", HEADS, CONTENT, torch.float16, "cpu", poison, layers=LAYERS, blocks=BLOCKS,
                       tokens=TOKENS)  # fmt: skip
    with pytest.raises(InvalidArgumentError) as err:
        half.register(_named(cache), layer_index)
    assert str(err.value) == (
        "invalid kv_connector_extra_config transport='cuda-ipc' for vLLM's KV caches on cpu: cuda-ipc serves cuda"
        " caches; for cpu caches choose from auto, staging, nixl"
    )
    assert half.decode.rendezvous is None  # nothing started


def test_config_takes_auto_by_default_and_refuses_it_across_hosts() -> None:
    from kvferry.vllm.config import TRANSPORTS, ConnectorConfig

    assert TRANSPORTS == ("auto", "cuda-ipc", "staging", "nixl")
    assert ConnectorConfig.from_extra({}).transport == "auto"
    assert ConnectorConfig.from_extra({"listen": "tcp://127.0.0.1:0"}).transport == "auto"  # loopback: one host
    assert ConnectorConfig.from_extra({"transport": "cuda-ipc"}).transport == "cuda-ipc"
    with pytest.raises(InvalidArgumentError) as err:
        ConnectorConfig.from_extra({"listen": "tcp://10.1.2.3:7000"})
    assert str(err.value) == (
        "invalid kv_connector_extra_config transport='auto' with listen='tcp://10.1.2.3:7000': auto picks cuda-ipc "
        "or staging, which run only on one host, and a tcp:// listen address off loopback reaches across hosts: set "
        "transport to nixl there"
    )
    with pytest.raises(InvalidArgumentError, match="transport='cuda-ipc' across hosts: cuda-ipc runs only on one"):
        ConnectorConfig.from_extra({"transport": "cuda-ipc", "listen": "tcp://10.1.2.3:7000"})
    with pytest.raises(InvalidArgumentError, match="transport='shm': choose from auto, cuda-ipc, staging, nixl"):
        ConnectorConfig.from_extra({"transport": "shm"})


@pytest.mark.parametrize(
    "urls",
    [
        ["staging+unix:///tmp/a/notices.sock"],
        ["cuda-ipc+unix:///tmp/x,y/notices.sock", "staging+unix:///tmp/100%2C/notices.sock"],
        ["cuda-ipc+unix:///tmp/%,%25,%2C/n.sock", "staging+unix:///tmp/,25%/n.sock"],
        ["cuda-ipc+tcp://127.0.0.1:4100", "staging+tcp://[::1]:4101"],
    ],
)
def test_a_destinations_endpoint_names_its_urls_in_order(urls: list[str]) -> None:
    """One URL stands as itself (what a decode server of one transport answered before);
    several as ``auto+`` and the URLs, a comma or percent sign inside a path escaped."""
    from kvferry.vllm import paths

    named = paths.choice_url(urls)
    assert (named == urls[0]) == (len(urls) == 1)
    assert paths.urls_of(named) == urls


def test_each_server_takes_the_urls_its_own_transport_setting_names() -> None:
    """A prefill server sends over what its own ``transport`` takes of what the decode server
    offers: ``auto`` both, in order; an explicit transport that one alone; nixl none here
    (its scheduler half refuses the destination by name)."""
    from kvferry.vllm import paths

    direct, staged = "cuda-ipc+unix:///a/notices.sock", "staging+unix:///b/notices.sock"
    both = paths.choice_url([direct, staged])
    assert paths.taken(both, "auto") == [direct, staged]
    assert paths.taken(both, "staging") == [staged] and paths.taken(both, "cuda-ipc") == [direct]
    assert paths.taken(both, "nixl") == [] and paths.taken(staged, "auto") == [staged]
    with pytest.raises(InvalidArgumentError, match="none of its URLs is of a transport this server's transport 'nixl'"):
        paths.connect(both, transport="nixl", authkey=KEY, src=None, what="test")


def test_a_decode_rank_that_cannot_export_its_handles_offers_staging_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Serving the direct path failed (torch could not export the caches' handles): the
    prefill engine is offered staging alone, with one WARNING; a staging endpoint that
    cannot be served fails the lookup (nothing behind it), closing what was served."""
    from types import SimpleNamespace

    from kvferry.transports.registry import Served
    from kvferry.vllm import paths

    closed: list[str] = []

    def make(fail: str) -> Any:
        def serve(name: str) -> Served:
            if name == fail:
                raise RuntimeError(f"{name} cannot be served here")
            return Served(name, SimpleNamespace(close=lambda: closed.append(name)), f"{name}+unix:///{name}")

        return serve

    caplog.set_level(logging.WARNING, logger="kvferry.vllm")
    alone = paths.serve(("cuda-ipc", "staging"), make("cuda-ipc"))
    assert isinstance(alone, Served) and alone.name == "staging" and alone.url == "staging+unix:///staging"
    assert [r.getMessage() for r in caplog.records] == [
        "kvferry: cannot serve cuda-ipc (cuda-ipc cannot be served here); staging only"
    ]
    with pytest.raises(RuntimeError, match="staging cannot be served here"):
        paths.serve(("cuda-ipc", "staging"), make("staging"))
    assert closed == ["cuda-ipc"]
    both = paths.serve(("cuda-ipc", "staging"), make(""))
    assert isinstance(both, paths.Choice) and paths.urls_of(both.url) == ["cuda-ipc+unix:///cuda-ipc",
                                                                          "staging+unix:///staging"]  # fmt: skip


@pytest.mark.parametrize(("taken", "kept"), [("cuda-ipc", True), ("staging", False), (None, False)])
def test_blocks_given_up_stay_allocated_only_while_a_direct_writer_is_connected(taken: Any, kept: bool) -> None:
    """A prefill engine offered both paths: its late writes can land only over CUDA IPC (the
    staging endpoint applies writes of requests it still admits), so only then does the
    decode side keep a given-up request's blocks past the fence timeout."""
    from types import SimpleNamespace

    from kvferry.transports.registry import Served
    from kvferry.vllm import paths
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker
    from kvferry.vllm.worker import WorkerCommon

    side = DecodeWorker(WorkerCommon(ConnectorConfig(), block_size=TOKENS, num_blocks=BLOCKS, authkey=KEY))
    side.rendezvous = SimpleNamespace(taker=lambda transfer: "P")  # type: ignore[assignment]
    side.endpoints["P"] = paths.Choice(
        tuple(
            Served(name, SimpleNamespace(connected=lambda name=name: name == taken), f"{name}+unix:///{name}")
            for name in ("cuda-ipc", "staging")
        )
    )
    assert side.endpoints["P"].taken() == taken
    assert side._late_writes_possible("T") is kept


def test_a_sender_maps_the_handles_on_its_own_gpu_not_the_receivers_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers with disjoint ``CUDA_VISIBLE_DEVICES``: the receiver's device index names
    another GPU (or none) in the sender's process, so the handles are opened on the GPU of
    the sender's pool (the registry passes its index); without a pool, on the index named."""
    from types import SimpleNamespace

    import torch.multiprocessing.reductions as reductions
    from kvferry.transports import cuda_ipc, registry

    asked: list[int] = []

    def rebuild(cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any, dtype: Any, device: int,
                *rest: Any) -> torch.Tensor:  # fmt: skip
        asked.append(device)
        return torch.empty(size, dtype=dtype)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    fields = _fake_handles(torch.zeros(4, 2, dtype=torch.float16))
    fields["device"] = 3  # the receiver's own index
    cuda_ipc._open_layer(fields, 1)
    cuda_ipc._open_layer(fields)
    assert asked == [1, 3]
    with pytest.raises(InvalidArgumentError, match=r"invalid device=-1: must be a CUDA device index >= 0 or None"):
        cuda_ipc.CudaIpcTransport("unix:///x/notices.sock", authkey=KEY, device=-1)  # refused before connecting
    made: list[Any] = []
    monkeypatch.setattr(cuda_ipc, "CudaIpcTransport", lambda address, **kw: made.append(kw["device"]))
    on_gpu1 = SimpleNamespace(device=torch.device("cuda", 1))
    registry.connect("cuda-ipc+unix:///x/notices.sock", authkey=KEY, src=on_gpu1)
    registry.connect("cuda-ipc+unix:///x/notices.sock", authkey=KEY)
    assert made == [1, None]


# -- the fallback, forced ----------------------------------------------------------------


def _fake_handles(layer: torch.Tensor) -> dict[str, Any]:
    """What `cuda_ipc._share_layer` sends for a layer, for a CPU tensor (handles that open
    nothing: the test makes opening fail as CUDA does where it cannot map them)."""
    return {
        "device": 0,
        "handle": bytes(64),
        "storage_size": layer.untyped_storage().nbytes(),
        "storage_offset": 0,
        "ref_counter_handle": b"/torch_0_0",
        "ref_counter_offset": 0,
        "event_handle": bytes(64),
        "event_sync_required": False,
        "shape": list(layer.shape),
        "stride": list(layer.stride()),
        "offset": int(layer.storage_offset()),
        "dtype": str(layer.dtype),
    }


@pytest.fixture
def direct_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The direct path offered over CPU caches (the registry's cuda-ipc spec takes them, its
    endpoint sending handles of the pool's layers), and every attempt to open its handles
    failing as CUDA does between two GPUs without peer access. Returns what each open was
    asked to map, in order."""
    from kvferry.transports import cuda_ipc, registry
    from kvferry.transports.control import LocalEndpoint, pool_hello

    def serve(receiver: Any, authkey: bytes, **options: Any) -> LocalEndpoint:
        pool = receiver.pool
        return LocalEndpoint(
            receiver, lambda: pool_hello(pool, "cuda_ipc", layers=[_fake_handles(t) for t in pool.layers]),
            authkey=authkey, **options,
        )  # fmt: skip

    opened: list[str] = []

    def refuse(fields: dict[str, Any], device: Any = None) -> torch.Tensor:
        opened.append(fields["dtype"])
        raise RuntimeError("CUDA error: peer access is not supported between these two devices")

    spec = registry._SPECS["cuda-ipc"]
    monkeypatch.setitem(registry._SPECS, "cuda-ipc", dataclasses.replace(spec, devices=("cuda", "cpu"), _serve=serve))
    monkeypatch.setattr(cuda_ipc, "_open_layer", refuse)
    return opened


def test_a_prefill_rank_that_cannot_open_the_handles_sends_over_staging(
    tmp_path: Path, direct_path_on_cpu: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A real engine's recorded steps (tests/test_worker_replay.py) through ``auto`` with the
    direct path offered and its handles failing to open: every block arrives, bit-exact,
    over staging; the prefill rank logged why once, for its one peer, and counted one
    staging connection and no CUDA IPC one."""
    from test_worker_replay import replay

    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    seen: dict[str, Any] = {}
    replay(tmp_path, "LBNHC", torch.float32, "cpu", "auto", seen=seen)
    assert direct_path_on_cpu, "the prefill rank never tried the direct path"
    fell_back = [r.getMessage() for r in caplog.records if "could not open its KV cache" in r.getMessage()]
    assert len(fell_back) == 1, fell_back
    assert fell_back[0].endswith(
        "staging, as cuda-ipc could not open its KV cache: CUDA error: peer access is not supported between these"
        " two devices"
    )
    offered = [r.getMessage() for r in caplog.records if "decode rendezvous" in r.getMessage()]
    assert offered and offered[0].endswith("(transport auto: cuda-ipc, else staging)"), offered
    totals = seen["prefill"].common.tally.totals
    assert totals.get("connections_staging") == 1 and "connections_cuda_ipc" not in totals, totals
    assert seen["taken"] == {SENDER_REPLAY: "staging"}


SENDER_REPLAY = "replay-prefill-engine"


# -- two servers, two processes --------------------------------------------------------------


def _half(tmp: Path, role: str, transport: str, *, tp_rank: int = 0, tp_size: int = 1, **config: Any) -> Any:
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.worker import WorkerCommon
    from kvferry.vllm.worker_half import WorkerHalf

    settings = ConnectorConfig(rendezvous_dir=str(tmp), transport=transport, transfer_timeout_s=SLACK,
                               destination_timeout_s=SLACK, **config)  # fmt: skip
    common = WorkerCommon(settings, block_size=TOKENS, num_blocks=BLOCKS, authkey=KEY, tp_rank=tp_rank,
                          tp_size=tp_size, num_kv_heads=HEADS)  # fmt: skip
    return WorkerHalf(common, role)


def _named(cache: Any) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn": v for i, v in enumerate(cache.views)}


def _decode_server(conn: Any, tmp: str, device: str, transport: str, layout: str, prefill_tp: int,
                   decode_tp: int) -> None:  # fmt: skip
    """A decode server's ``decode_tp`` ranks in this process, over poisoned caches of their
    heads: sends each rank's rendezvous, binds the requests it is sent, reports once each
    rank's results returned them all, then sends each rank's cache bytes."""
    from kvferry.vllm.metadata import KvferryMetadata, RecvSpec

    halves, caches = [], []
    try:
        for rank in range(decode_tp):
            half = _half(Path(tmp), "kv_consumer", transport, tp_rank=rank, tp_size=decode_tp,
                         prefill_tp_size=prefill_tp)  # fmt: skip
            cache = vllm_views(layout, HEADS // decode_tp, CONTENT, torch.float16, device, poison, layers=LAYERS,
                               blocks=BLOCKS, tokens=TOKENS)  # fmt: skip
            half.register(_named(cache), layer_index)
            halves.append(half)
            caches.append(cache)
        conn.send([h.decode.rendezvous.address for h in halves])
        recvs = [RecvSpec(rid, kv, rid.upper(), n, [dst], held, "d", SLACK) for rid, kv, n, held, _, dst in REQUESTS]
        conn.recv()
        for half in halves:
            half.bind(KvferryMetadata(recvs=copy.deepcopy(recvs)))
        conn.send("bound")
        arrived: list[set[str]] = [set() for _ in halves]

        def landed() -> bool:
            for got, half in zip(arrived, halves):
                sending, recving, failed = half.results(set())
                assert not failed, failed
                got |= recving
            return all(got == {r[0] for r in REQUESTS} for got in arrived)

        if not until(landed, SLACK):
            conn.send(("error", f"arrived {arrived} of {[r[0] for r in REQUESTS]}"))
        else:
            conn.send(("ok", [c.raw.cpu().numpy() for c in caches]))
        conn.recv()
    except Exception as err:  # reported to the test, which fails with it
        conn.send(("error", repr(err)))
    finally:
        for half in halves:
            half.close()


def _send_specs(addresses: list[str], prefill_tp: int, decode_tp: int) -> list[Any]:
    """Each request's `SendSpec`, its destinations looked up as the scheduler half does (one
    per link under tensor parallelism, each prefill rank under its own sender name)."""
    from kvferry import ranks
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import SendLeg, SendSpec, leg_name

    specs = []
    for rid, _, n, _, _, _ in REQUESTS:
        transfer = rid.upper()
        if prefill_tp == decode_tp == 1:
            dest = rendezvous.lookup(addresses[0], KEY, transfer, SLACK, SENDER)
            specs.append(SendSpec(rid, transfer, n, 0, addresses[0], dest, SLACK))
            continue
        legs = []
        for link in ranks.links(prefill_tp, decode_tp, HEADS):
            name = leg_name(transfer, link.prefill_rank, prefill_tp)
            where = addresses[link.decode_rank]
            dest = rendezvous.lookup(where, KEY, name, SLACK, leg_name(SENDER, link.prefill_rank, prefill_tp))
            legs.append(SendLeg(link.prefill_rank, link.decode_rank, link.src_heads, link.dst_heads, link.whole,
                                where, name, dest))  # fmt: skip
        specs.append(SendSpec(rid, transfer, n, 0, addresses[0], legs[0].destination, SLACK, legs=legs))
    return specs


def two_servers(
    tmp_path: Path,
    device: str,
    transport: str,
    layout: str,
    prefill_tp: int,
    decode_tp: int,
    decode_visible: Optional[str] = None,
) -> Any:
    """A prefill server of ``prefill_tp`` ranks (here) sends `REQUESTS` to a decode server of
    ``decode_tp`` ranks (a spawned process, started with ``CUDA_VISIBLE_DEVICES`` set to
    ``decode_visible`` when given) through the connector's worker half; checks that each
    destination block holds its source block's heads, byte for byte in every layer, and
    every other block is still poison. Returns the prefill halves' tallies."""
    from kvferry.vllm.metadata import Chunk, KvferryMetadata

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_server, args=(child, str(tmp_path), device, transport, layout, prefill_tp,
                                                    decode_tp), daemon=True)  # fmt: skip
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if decode_visible is not None:  # the child's environment is this one's at its start
        os.environ["CUDA_VISIBLE_DEVICES"] = decode_visible
    try:
        proc.start()
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    halves, sources = [], []
    try:
        addresses = reply_from(parent, proc, "decode server")
        assert isinstance(addresses, list), addresses
        for rank in range(prefill_tp):
            half = _half(tmp_path, "kv_producer", transport, tp_rank=rank, tp_size=prefill_tp)
            cache = vllm_views(layout, HEADS // prefill_tp, CONTENT, torch.float16, device, random_bytes(40 + rank),
                               layers=LAYERS, blocks=BLOCKS, tokens=TOKENS)  # fmt: skip
            half.register(_named(cache), layer_index)
            halves.append(half)
            sources.append(cache)
        parent.send("bind")
        assert reply_from(parent, proc, "decode server") == "bound"
        specs = _send_specs(addresses, prefill_tp, decode_tp)
        chunks = [Chunk(rid, 0, n, [src]) for rid, _, n, _, src, _ in REQUESTS]
        names = sorted(_named(sources[0]), key=layer_index)
        for half in halves:
            half.bind(KvferryMetadata(sends=copy.deepcopy(specs), chunks=copy.deepcopy(chunks)))
            for name in names:
                half.save_layer(name)
            half.wait_for_save()
        sent: list[set[str]] = [set() for _ in halves]
        rids = {r[0] for r in REQUESTS}
        first = [True] * len(halves)

        def all_sent() -> bool:
            for i, half in enumerate(halves):
                sending, _, failed = half.results(rids if first[i] else set())
                first[i] = False
                assert not failed, failed
                sent[i] |= sending
            return all(s == rids for s in sent)

        assert until(all_sent, SLACK), f"sent {sent}"
        status, got = reply_from(parent, proc, "decode server")
        assert status == "ok", got
        _check(layout, device, sources, got, prefill_tp, decode_tp)
        totals = [h.common.tally.totals for h in halves]
        # The prefill side lets go of the decode caches it mapped before their process ends.
        while halves:
            halves.pop().close()
        parent.send("done")
        proc.join(SLACK)
        return totals
    finally:
        for half in halves:
            half.close()
        if proc.is_alive():
            proc.kill()


def _check(layout: str, device: str, sources: list[Any], got: list[Any], prefill_tp: int, decode_tp: int) -> None:
    """Decode rank d's head h (global ``d * per_rank + h``) of block ``dst[i]`` holds prefill
    rank ``g // per_prefill``'s local head of block ``src[i]`` for each block the request
    did not hold; every other (block, head) is poison."""
    per_d, per_p = HEADS // decode_tp, HEADS // prefill_tp
    written: dict[int, int] = {}  # decode block -> source block
    for _, _, n, held, src, dst in REQUESTS:
        blocks = -(-n // TOKENS)
        written.update({dst[i]: src[i] for i in range(held, blocks)})
    for d, raw in enumerate(got):
        fill = lambda r, raw=raw: r.copy_(torch.from_numpy(raw))  # noqa: E731
        dst = vllm_views(
            layout, per_d, CONTENT, torch.float16, "cpu", fill, layers=LAYERS, blocks=BLOCKS, tokens=TOKENS
        )
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                for h in range(per_d):
                    have = dst.views[layer][b, h].contiguous().view(torch.int8)
                    if b not in written:
                        assert bool((have == -1).all()), f"rank {d} layer {layer} block {b} head {h}: written"
                        continue
                    g = d * per_d + h
                    want = sources[g // per_p].views[layer][written[b], g % per_p].cpu().contiguous().view(torch.int8)
                    assert torch.equal(have, want), f"rank {d} layer {layer} block {b} head {h}: bytes differ"


TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
def test_cpu_two_servers_take_staging_under_auto(tmp_path: Path, prefill_tp: int, decode_tp: int) -> None:
    """Over CPU caches ``auto`` offers staging alone: every connection a prefill rank made is
    a staging one, and every head slice lands where vLLM's decode ranks hold it."""
    tallies = two_servers(tmp_path, "cpu", "auto", "LBNHC", prefill_tp, decode_tp)
    for totals in tallies:
        assert totals.get("connections_staging", 0) >= 1 and "connections_cuda_ipc" not in totals, totals


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_cuda_two_servers_take_cuda_ipc_under_auto(
    tmp_path: Path, prefill_tp: int, decode_tp: int, layout: str
) -> None:
    """Two processes on one GPU, CUDA caches in vLLM's layouts: ``auto`` gives every prefill
    rank the direct path (each of its connections a CUDA IPC one, none staging), and the
    fused copy writes each head slice into the decode ranks' blocks exactly as staging
    does (the same checks as the CPU test)."""
    from kvferry import ranks

    tallies = two_servers(tmp_path, "cuda", "auto", layout, prefill_tp, decode_tp)
    for p, totals in enumerate(tallies):
        links = sum(1 for k in ranks.links(prefill_tp, decode_tp, HEADS) if k.prefill_rank == p)
        assert totals.get("connections_cuda_ipc") == links and "connections_staging" not in totals, totals


@pytest.mark.cuda
def test_cuda_servers_that_see_disjoint_gpus_pair_over_the_peer_path(tmp_path: Path) -> None:
    """Two GPUs, the servers started with disjoint ``CUDA_VISIBLE_DEVICES`` as on one node:
    the decode process sees only the second GPU (its cuda:0), the prefill ranks here write
    from the first. CUDA opens the handles of a GPU this process does not see where the two
    have peer access: every connection then takes CUDA IPC, the copy kernel writing across;
    without peer access opening fails and each falls back to staging. Either way every block
    lands."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    peer = torch.cuda.can_device_access_peer(0, 1)
    tallies = two_servers(tmp_path, "cuda", "auto", "LBNHC", 1, 2, decode_visible="1")
    path, other = (
        ("connections_cuda_ipc", "connections_staging") if peer else ("connections_staging", "connections_cuda_ipc")
    )
    assert tallies[0].get(path) == 2 and other not in tallies[0], (peer, tallies)


@pytest.mark.cuda
def test_cuda_explicit_staging_is_honoured_between_two_servers(tmp_path: Path) -> None:
    """The operator's ``staging`` over CUDA caches: no direct path is offered."""
    (totals,) = two_servers(tmp_path, "cuda", "staging", "LBNHC", 1, 1)
    assert totals.get("connections_staging") == 1 and "connections_cuda_ipc" not in totals, totals


@pytest.mark.cuda
def test_cuda_one_process_cannot_open_its_own_handles_and_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both halves in one process (the replay): CUDA cannot open a process's own IPC handles,
    so the prefill half falls back to staging, with one log line, and every block still
    arrives bit-exact (a real failure to open, not a forced one)."""
    from test_worker_replay import replay

    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    seen: dict[str, Any] = {}
    replay(tmp_path, "LBNHC", torch.bfloat16, "cuda", "auto", seen=seen)
    totals = seen["prefill"].common.tally.totals
    fell_back = [r.getMessage() for r in caplog.records if "could not open its KV cache" in r.getMessage()]
    assert totals.get("connections_staging") == 1 and len(fell_back) == 1, (totals, fell_back)
