"""The transport registry: its table (names, devices, reach), its refusals (each naming the
argument and its value), and each transport built from it end to end, bit exact; and that no
module outside the registry keeps a table of transport names."""

from __future__ import annotations

import ast
import pathlib
import secrets
from typing import Any

import pytest
import torch
from helpers import TRANSFER_POOLS as POOLS
from kvferry.cli import build_parser
from kvferry.errors import InvalidArgumentError
from kvferry.receiver import KVReceiver
from kvferry.sender import KVSender
from kvferry.transports import registry
from kvferry.transports.base import Transport
from kvferry.transports.registry import Reach
from test_transfer import LAYERS, REQUESTS, SHAPE, TPB, block_tables, digest, drive, run_with_receiver, serve_requests

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_table_lists_every_transport_once_with_where_it_runs() -> None:
    assert registry.names() == ("in-process", "shm", "cuda-ipc", "staging", "nixl")
    assert registry.names(device="cpu") == ("in-process", "shm", "staging", "nixl")
    assert registry.names(device="cuda") == ("in-process", "cuda-ipc", "staging", "nixl")
    assert registry.names(reach=Reach.HOST) == ("shm", "cuda-ipc", "staging", "nixl")
    assert registry.names(device="cpu", reach=Reach.NETWORK) == ("nixl",)
    for name in registry.names():
        s = registry.spec(name)
        assert s.name == name and s.devices and s.summary
        # The in-process transport alone has no endpoint: its receiver is in this process.
        assert s.has_endpoint == (s.reach > Reach.PROCESS)
    assert registry.spec("shm").shared_pool and not registry.spec("nixl").shared_pool
    assert registry.spec("shm").direct_copy and not registry.spec("staging").direct_copy


def test_unknown_names_are_refused_naming_the_argument_and_value() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"invalid transport='pigeon': unknown transport; choose from in-process, shm"
    ):
        registry.spec("pigeon")
    with pytest.raises(
        InvalidArgumentError,
        match=r"invalid url='pigeon\+unix:///x': unknown transport 'pigeon'; choose from in-process, shm",
    ):
        registry.parse_url("pigeon+unix:///x")
    with pytest.raises(InvalidArgumentError, match=r"invalid url='nixl\+': no address"):
        registry.parse_url("nixl+")
    with pytest.raises(InvalidArgumentError, match=r"invalid --transport=None"):
        registry.check(None, argument="--transport")  # type: ignore[arg-type]


def test_a_transport_asked_to_run_where_it_cannot_is_refused() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=(
            r"invalid transport='shm' for device='cuda': shm serves cpu pools; for cuda pools choose from "
            r"in-process, cuda-ipc, staging, nixl"
        ),
    ):
        registry.check("shm", device="cuda")
    with pytest.raises(
        InvalidArgumentError, match=r"invalid transport='cuda-ipc' for device='cpu': cuda-ipc serves cuda pools"
    ):
        registry.check("cuda-ipc", device="cpu")
    with pytest.raises(
        InvalidArgumentError,
        match=r"invalid transport='staging' across hosts: staging runs only on one host; across hosts choose from nixl",
    ):
        registry.check("staging", reach=Reach.NETWORK)
    with pytest.raises(
        InvalidArgumentError, match=r"invalid transport='in-process' on one host: in-process runs only in one process"
    ):
        registry.check("in-process", reach=Reach.HOST)
    assert registry.check("nixl", device="cpu", reach=Reach.NETWORK).name == "nixl"
    with pytest.raises(InvalidArgumentError, match=r"invalid transport='shm' for device='cuda'"):
        registry.receiver_pool(
            "shm", num_layers=1, shape=(4, 8), dtype=torch.float32, tokens_per_block=TPB, device="cuda"
        )


def test_bad_builder_arguments_are_refused_before_anything_opens() -> None:
    receiver = KVReceiver(POOLS.nan())
    with pytest.raises(
        InvalidArgumentError, match=r"invalid transport='in-process' for serve: in-process has no endpoint"
    ):
        registry.serve("in-process", receiver, authkey=secrets.token_bytes(32))
    with pytest.raises(
        InvalidArgumentError,
        match=r"invalid shared=None: the shm endpoint serves the receiver's pool from shared memory",
    ):
        registry.serve("shm", receiver, authkey=secrets.token_bytes(32))
    with pytest.raises(
        InvalidArgumentError,
        match=(
            r"invalid option ring=3: the staging endpoint takes address, advertise, handshake_timeout, "
            r"capacity_blocks"
        ),
    ):
        registry.serve("staging", receiver, authkey=secrets.token_bytes(32), ring=3)
    with pytest.raises(
        InvalidArgumentError, match=r"invalid url='in-process\+unix:///x': the in-process transport takes no address"
    ):
        registry.connect("in-process+unix:///x", receiver=receiver)
    with pytest.raises(InvalidArgumentError, match=r"invalid url='shm': shm needs the endpoint's address"):
        registry.connect("shm", authkey=secrets.token_bytes(32))
    with pytest.raises(InvalidArgumentError, match=r"invalid authkey=None: shm authenticates"):
        registry.connect("shm+unix:///nowhere")
    with pytest.raises(InvalidArgumentError, match=r"invalid src=None: a NIXL transport registers the sender's pool"):
        registry.connect("nixl+unix:///nowhere", authkey=secrets.token_bytes(32))
    with pytest.raises(
        InvalidArgumentError, match=r"invalid option write_bytes=8: the shm transport takes handshake_timeout"
    ):
        registry.connect("shm+unix:///nowhere", authkey=secrets.token_bytes(32), write_bytes=8)


def test_a_tcp_address_off_loopback_is_refused_for_a_one_host_transport() -> None:
    receiver = KVReceiver(POOLS.nan())
    key = secrets.token_bytes(32)
    for name in ("shm", "staging"):
        with pytest.raises(
            InvalidArgumentError,
            match=(
                rf"invalid url='{name}\+tcp://10.9.8.1:5000' for transport '{name}': a tcp:// address off loopback "
                rf"reaches across hosts, and {name} runs only on one host; across hosts choose from nixl"
            ),
        ):
            registry.connect(f"{name}+tcp://10.9.8.1:5000", authkey=key)
    with pytest.raises(InvalidArgumentError, match=r"invalid address='tcp://0.0.0.0:0' for transport 'staging'"):
        registry.serve("staging", receiver, authkey=key, address="tcp://0.0.0.0:0")
    with pytest.raises(InvalidArgumentError, match=r"invalid url='ftp://x': expected unix:///path or tcp://host:port"):
        registry.connect("shm+ftp://x", authkey=key)


def test_a_one_host_transport_over_loopback_tcp_is_bit_exact() -> None:
    """The control address is the endpoint's choice: staging over tcp://127.0.0.1."""
    pool = registry.receiver_pool("staging", num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB)
    receiver = KVReceiver(pool.pool)
    key = secrets.token_bytes(32)
    served = registry.serve("staging", receiver, authkey=key, address="tcp://127.0.0.1:0")
    try:
        assert served.url.startswith("staging+tcp://127.0.0.1:") and not served.url.endswith(":0")
        for rid, prompt, _ in REQUESTS:
            receiver.expect(rid, prompt)
        src = POOLS.random(9)
        src_table, dst_table = block_tables(10)
        sender = KVSender(src, registry.connect(served.url, authkey=key, handshake_timeout=5.0), progress=True)
        drive(sender, src_table, dst_table)
        sender.flush(timeout=60)
        for rid, _, _ in REQUESTS:
            receiver.wait(rid, timeout=60)
        assert digest(receiver.pool, dst_table) == digest(src, src_table)
        sender.close()
    finally:
        served.close()
        receiver = None  # type: ignore[assignment]
        pool.close()


def test_in_process_from_the_registry_is_bit_exact() -> None:
    dst = POOLS.nan()
    receiver = KVReceiver(dst)
    for rid, prompt, _ in REQUESTS:
        receiver.expect(rid, prompt)
    src = POOLS.random(5)
    src_table, dst_table = block_tables(6)
    sender = KVSender(src, registry.connect("in-process", receiver=receiver))
    drive(sender, src_table, dst_table)
    sender.flush(timeout=60)
    for rid, _, _ in REQUESTS:
        receiver.wait(rid, timeout=60)
    assert digest(dst, dst_table) == digest(src, src_table)
    sender.close()


def _registry_receiver(conn: Any, authkey: bytes, kind: str, device: str) -> None:
    """A receiver process built only from the registry: its pool, its endpoint, its URL."""
    pool = registry.receiver_pool(
        kind, num_layers=LAYERS, shape=SHAPE, dtype=torch.float32, tokens_per_block=TPB, device=device
    )
    receiver = KVReceiver(pool.pool)
    served = registry.serve(kind, receiver, authkey=authkey, **pool.serve_options)
    serve_requests(conn, receiver, served.url)
    served.close()
    receiver = None  # type: ignore[assignment]
    pool.close()


def _cross_process(kind: str, device: str) -> None:
    src = POOLS.random(8, device)
    src_table, dst_table = block_tables(7)

    def connect(url: str, authkey: bytes) -> tuple[KVSender, str]:
        assert url.startswith(f"{kind}+unix:///")
        transport: Transport = registry.connect(url, authkey=authkey, src=src)
        return KVSender(src, transport), digest(src, src_table)

    run_with_receiver(kind, (src_table, dst_table), connect, False, _registry_receiver, device)


@pytest.mark.parametrize("kind", [n for n in registry.names(device="cpu") if registry.spec(n).has_endpoint])
def test_every_cpu_transport_built_from_the_registry_is_bit_exact(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "nixl":
        pytest.importorskip("nixl")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # inherited by the spawned receiver
    _cross_process(kind, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", [n for n in registry.names(device="cuda") if registry.spec(n).has_endpoint])
def test_every_cuda_transport_built_from_the_registry_is_bit_exact(kind: str) -> None:
    if kind == "nixl":
        pytest.importorskip("nixl")
    _cross_process(kind, "cuda")


def test_cli_transport_flags_offer_the_registry_names() -> None:
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions if a.dest == "bench")  # type: ignore[union-attr]
    for command in ("agentic", "fanout", "tiers"):
        flag = next(a for a in bench.choices[command]._actions if a.dest == "transport")
        assert tuple(flag.choices) == registry.names(), command


def _name_tables(path: pathlib.Path) -> list[str]:
    """Literal tuples, lists, sets or dict keys holding two or more transport names."""
    known = set(registry.names())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        items = (
            node.keys
            if isinstance(node, ast.Dict)
            else node.elts
            if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            else []
        )
        names = [i.value for i in items if isinstance(i, ast.Constant) and i.value in known]
        if len(names) >= 2:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {names}")
    return found


def test_no_module_but_the_registry_keeps_a_table_of_transport_names() -> None:
    sources = [*ROOT.joinpath("python", "kvferry").rglob("*.py"), *ROOT.joinpath("benches", "python").rglob("*.py")]
    tables = [t for p in sources if p.name != "registry.py" for t in _name_tables(p)]
    assert not tables, "transport names listed outside kvferry.transports.registry:\n" + "\n".join(tables)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["copy", "--transport", "shm", "--listen", "tcp://10.9.8.2:0"],
            "invalid --transport='shm' across hosts: shm runs only on one host; across hosts choose from nixl",
        ),
        (
            ["agentic", "--transport", "staging", "--receiver-netns", "x", "--listen", "tcp://10.9.8.2:0"],
            "invalid --transport='staging' across hosts",
        ),
        (
            ["agentic", "--transport", "in-process", "--listen", "tcp://10.9.8.2:0"],
            "--transport in-process keeps the generation worker in this process",
        ),
        (
            ["copy", "--transport", "nixl", "--receiver-netns", "x"],
            "invalid --listen='unix://' with --receiver-netns x: another namespace is reached over tcp://",
        ),
    ],
)
def test_cli_refuses_a_placement_the_transport_cannot_run_in(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    from kvferry.cli import main

    assert main(["bench", *argv]) == 2
    assert needle in capsys.readouterr().err
