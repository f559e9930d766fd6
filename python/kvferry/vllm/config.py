"""The connector's settings (``kv_connector_extra_config``) and the per-request parameters
(``kv_transfer_params["kvferry"]``), validated in one place. No vLLM import here: both are
plain data, and the tests check them without an engine.
"""

from __future__ import annotations

import array
import hashlib
import math
import os
import re
import secrets
import stat
import sys
import tempfile
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

from kvferry.errors import InvalidArgumentError
from kvferry.transports import registry

__all__ = [
    "ConnectorConfig",
    "RequestParams",
    "default_authkey_path",
    "load_authkey",
    "parse_params",
    "parse_router_params",
    "prompt_digest",
    "router_key",
]

PARAMS_KEY = "kvferry"
MIN_KEY_BYTES = 32  # the project's rule for every kvferry key (docs/security.md)
MAX_KEY_BYTES = 4096
# A key file's bytes take at least this many values: 32 random bytes take about 30, the hex or
# base64 text of a random key 16 to 64; a file of one repeated byte (or a short pattern) is no key.
MIN_KEY_DISTINCT_BYTES = 8
# A transfer id, as a request names it: what the proxy makes (UUIDs) and what routers send
# (X-Request-Id: ``___prefill_addr_10.0.0.1:8001___decode_addr_..._<hex>``), nothing a log line
# or a status answer could be forged with (a newline, a quote, a control character).
TRANSFER_ALPHABET = "A-Za-z0-9._:-"
MAX_TRANSFER_CHARS = 256
_TRANSFER_ID = re.compile(rf"[{TRANSFER_ALPHABET}]{{1,{MAX_TRANSFER_CHARS}}}")
_NOT_TRANSFER = re.compile(rf"[^{TRANSFER_ALPHABET}]")
# The longest timeout_s a request may name (an operator's bounds cap it further: a request may
# ask to wait less than the server's transfer_timeout_s / destination_timeout_s, never more).
MAX_TIMEOUT_S = 86400.0
OPS = ("hello", "recv", "send", "status")
# How blocks move (kvferry.transports.registry builds both sides): ``auto`` (kvferry.vllm.paths:
# CUDA IPC where both servers' caches are on CUDA and the prefill process can open the decode
# process's handles, else staging), or one of the registry's transports that write another
# process's KV tensors without a shared pool: cuda-ipc (CUDA caches, one host), staging (one
# host), nixl (across hosts too).
TRANSPORTS = ("auto",) + tuple(
    n
    for n in registry.names(reach=registry.Reach.HOST)
    if registry.spec(n).has_endpoint and not registry.spec(n).shared_pool
)


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys, with their defaults (docs/vllm.md lists them)."""

    # "auto": per prefill engine, CUDA IPC where it can work, else staging (kvferry.vllm.paths).
    transport: str = "auto"
    early: bool = True  # send the prefix-cache hit before the first forward
    layer_groups: int = 1  # >1: the last chunk leaves layer group by layer group
    transfer_timeout_s: float = 120.0  # a decode request waits at most this for its blocks
    destination_timeout_s: float = 60.0  # a prefill request waits at most this for its destination
    # How long a prefill request waits for its destination before it computes anyway (its
    # blocks then wait, at most until destination_timeout_s); 0: compute at once.
    admission_wait_s: float = 1.0
    fence_timeout_s: float = 10.0  # after giving up, how long the decode side waits for the fence
    # The staging ring's size; None: 1 GiB for CUDA caches, 64 MiB for CPU caches
    # (kvferry.transports.staging.RING_BYTES says why).
    staging_bytes: Optional[int] = None
    # Prefill side: host memory that prompts computed before their destination park in, so
    # that vLLM's pool frees them at once (kvferry.vllm.park), at most the pool's size; 0
    # (the default): off, they hold their blocks in vLLM's pool until their destination comes.
    late_host_bytes: int = 0
    authkey_file: Optional[str] = None  # a file holding the endpoints' key (else: the per-user default file)
    rendezvous_dir: Optional[str] = None  # where the decode side's sockets live (else: a fresh 0700 dir)
    listen: str = "unix://"  # where the decode side's rendezvous and endpoints listen: unix:// or tcp://host:port
    advertise: Optional[str] = None  # the host a wildcard tcp:// bind is reached by
    trace: Optional[str] = None  # a file each transfer's stages go to, one JSON line each (kvferry.trace); unset: off
    # Decode servers' rendezvous URLs a prefill server connects to without a peer_mac (the
    # decode server's signature of its URL, which its hello answer carries): kvferry.vllm.trust.
    trusted_peers: tuple[str, ...] = ()
    # Decode side: the tensor parallel size of the prefill servers that send here (each of
    # their ranks writes its heads; a request has arrived once every one of them landed;
    # kvferry.ranks), or several sizes (a tuple; from a list): each request is then taken by
    # the first size that looks it up (`prefill_tp_sizes`). Each a power of two that divides,
    # or is divided by, this server's own.
    prefill_tp_size: int | tuple[int, ...] = 1
    # Decode side: the pipeline parallel size of the prefill servers that send here (every
    # size above with it). Each stage's ranks write the layers vLLM's partition gives that
    # stage (``VLLM_PP_LAYER_PARTITION``, the same on both servers, or unset on both).
    prefill_pp_size: int = 1
    # CPU ids kvferry's own threads run on in this server's processes (the sender's announcer,
    # copy threads, the control plane, NIXL's progress thread): keeps the transfer's work off
    # the cores the engine computes on. Empty: they run where the engine runs (kvferry.affinity).
    transfer_cores: tuple[int, ...] = ()
    # vllm-router's moriio mode (kvferry.vllm.moriio): the router's --vllm-discovery-address
    # (host:port) this server registers with, and the host:port the router reaches this
    # server's HTTP API at. Both or neither.
    router_discovery: Optional[str] = None
    http_address: Optional[str] = None
    # Per-block checksums (kvferry.checksum): the prefill side sums every block it writes,
    # the decode side checks each where it landed; a block that differs fails its request
    # (vLLM's kv_load_failure_policy). None: kvferry.checksum.CHECKSUM_DEFAULT, on both sides.
    checksum: Optional[bool] = None

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> ConnectorConfig:
        """Builds the config from ``kv_connector_extra_config``, refusing unknown keys and
        values of the wrong type by name (a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config keys {unknown}: known keys are {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if name == "trusted_peers":
                from kvferry.vllm.trust import check_trusted_peers

                value = check_trusted_peers(value)
            elif name == "prefill_tp_size":
                value = _check_tp_sizes(value)
            elif name == "transfer_cores":
                from kvferry.affinity import check_cores

                value = tuple(sorted(check_cores(value, "kv_connector_extra_config transfer_cores") or ()))
            elif name in ("authkey_file", "rendezvous_dir", "transport", "listen", "advertise", "trace"):
                if value is not None and not isinstance(value, str):
                    raise InvalidArgumentError(f"invalid kv_connector_extra_config {name}={value!r}: must be a string")
            elif name in ("router_discovery", "http_address"):
                value = _check_host_port(name, value)
            elif isinstance(default, bool) or name == "checksum":
                if not isinstance(value, bool) and not (name == "checksum" and value is None):
                    raise InvalidArgumentError(
                        f"invalid kv_connector_extra_config {name}={value!r}: must be true or false"
                    )
            elif name == "late_host_bytes":  # before the int branch: 0 is allowed
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgumentError(
                        f"invalid kv_connector_extra_config {name}={value!r}: must be an integer >= 0 (0: off)"
                    )
            elif isinstance(default, int) or name == "staging_bytes":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise InvalidArgumentError(
                        f"invalid kv_connector_extra_config {name}={value!r}: must be a positive integer"
                    )
            elif name == "admission_wait_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                    raise InvalidArgumentError(
                        f"invalid kv_connector_extra_config {name}={value!r}: must be a number of seconds >= 0"
                    )
                value = float(value)
            elif isinstance(default, float):
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not (value > 0 and math.isfinite(value))
                ):
                    raise InvalidArgumentError(
                        f"invalid kv_connector_extra_config {name}={value!r}: must be a positive number of seconds"
                    )
                value = float(value)
            values[name] = value
        config = cls(**values)
        if config.admission_wait_s >= config.destination_timeout_s:
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config admission_wait_s={config.admission_wait_s!r}: must be less than"
                f" destination_timeout_s ({config.destination_timeout_s!r}), past which the request fails"
            )
        if (config.router_discovery is None) != (config.http_address is None):
            given, missing = (
                ("router_discovery", "http_address")
                if config.http_address is None
                else ("http_address", "router_discovery")
            )
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config {given}={getattr(config, given)!r} without {missing}: vllm-router's"
                " moriio mode needs both (the router's --vllm-discovery-address, and where it reaches this server)"
            )
        if config.transport not in TRANSPORTS:
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config transport={config.transport!r}: choose from {', '.join(TRANSPORTS)}"
            )
        from kvferry.transports import registry, wire

        where = wire.parse_address(config.listen, "kv_connector_extra_config listen")
        if where.scheme == "unix" and config.advertise is not None:
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config advertise={config.advertise!r}: only for a tcp:// listen address"
            )
        if where.scheme == "tcp" and where.wildcard and config.advertise is None:
            raise InvalidArgumentError(
                f"invalid kv_connector_extra_config listen={config.listen!r}: a wildcard bind needs advertise (the "
                "host name or IP address prefill servers reach it by)"
            )
        if where.scheme == "tcp" and not _loopback(where.host):  # reaches other hosts: only a transport that does
            if config.transport == "auto":
                raise InvalidArgumentError(
                    f"invalid kv_connector_extra_config transport='auto' with listen={config.listen!r}: auto picks"
                    f" cuda-ipc or staging, which run only on one host, and a tcp:// listen address off loopback"
                    f" reaches across hosts: set transport to"
                    f" {' or '.join(registry.names(reach=registry.Reach.NETWORK))} there"
                )
            registry.check(
                config.transport, reach=registry.Reach.NETWORK, argument="kv_connector_extra_config transport"
            )
        return config

    @property
    def prefill_tp_sizes(self) -> tuple[int, ...]:
        """The tensor parallel sizes of the prefill servers this decode server takes, in the
        order given (one int: that size alone)."""
        size = self.prefill_tp_size
        return (size,) if isinstance(size, int) else tuple(size)

    def authkey(self) -> bytes:
        """The key of kvferry's control channel (rendezvous and endpoints): from
        ``authkey_file``, else from the per-user default file (made on first use). The key
        never travels in a request or an answer; both servers read it from here."""
        return load_authkey(self.authkey_file)


def _check_tp_sizes(value: Any) -> int | tuple[int, ...]:
    """``prefill_tp_size``: one size (an int >= 1, kept as is) or a non-empty list of distinct
    ones (a tuple). Whether each pairs with this server's own size and head count is checked
    when the decode worker starts (kvferry.ranks.links): the config does not know them."""

    def size(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if size(value):
        return int(value)
    if not isinstance(value, (list, tuple)) or not value or not all(size(v) for v in value):
        raise InvalidArgumentError(
            f"invalid kv_connector_extra_config prefill_tp_size={value!r}: must be a positive integer or a non-empty "
            "list of positive integers (the tensor parallel sizes of the prefill servers that send here)"
        )
    if len(set(value)) != len(value):
        twice = sorted({v for v in value if list(value).count(v) > 1})
        raise InvalidArgumentError(
            f"invalid kv_connector_extra_config prefill_tp_size={list(value)!r}: lists {twice} more than once"
        )
    return tuple(int(v) for v in value)


def _check_host_port(name: str, value: Any) -> Optional[str]:
    """``router_discovery`` / ``http_address``: ``host:port`` (an IPv6 host in brackets)."""
    if value is None:
        return None
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or any(c.isspace() or c in "/@" for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(
            f"invalid kv_connector_extra_config {name}={value!r}: must be host:port (e.g. 10.0.0.1:30001)"
        )
    return value


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_authkey_path() -> str:
    """``$XDG_RUNTIME_DIR/kvferry/authkey`` when that directory is set, else
    ``~/.cache/kvferry/authkey``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isabs(runtime) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvferry", "authkey")


def _private(st: os.stat_result, what: str, path: str) -> None:
    if st.st_uid != os.geteuid():
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        )
    if st.st_mode & 0o077:
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others in; it must be "
            f"readable by its owner only (chmod {'700' if what.endswith('directory') else '600'})"
        )


def _make_default_key(path: str) -> None:
    """Creates ``path`` (0600, 32 random bytes) atomically in its 0700 directory: the first
    server to start makes it, the next re-uses it; a reader never sees a partial file."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    _private(os.stat(directory), "authkey directory", directory)
    if os.path.exists(path):
        return
    fd, tmp = tempfile.mkstemp(prefix=".authkey-", dir=directory)  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(MIN_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another server made it first: then its key is used
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def load_authkey(authkey_file: Optional[str] = None) -> bytes:
    """Reads the control channel's key: the whole content of ``authkey_file`` (at least 32
    bytes), or of the per-user default file (`default_authkey_path`), created on first use.
    Refuses, naming the path, a file that group or others can read, one this user does not
    own, and a key shorter than 32 bytes."""
    if authkey_file is None:
        path = default_authkey_path()
        _make_default_key(path)
        what = "default authkey file"
    else:
        path = os.path.expanduser(authkey_file)
        what = "kv_connector_extra_config authkey_file"
    try:
        # O_NONBLOCK: opening a FIFO (or a device) named here must not hang the server; the
        # type is checked on the opened file itself below, so nothing can swap it in between.
        # Symbolic links are followed (a Kubernetes secret volume is one); their target is checked.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise InvalidArgumentError(f"invalid {what} {path!r}: cannot open it: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO, a device: checked before any read
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidArgumentError(f"invalid {what} {path!r}: {kind}, not a regular file")
        _private(st, what, path)
        key = b""
        while len(key) <= MAX_KEY_BYTES and (chunk := os.read(fd, MAX_KEY_BYTES + 1 - len(key))):
            key += chunk
    finally:
        os.close(fd)
    if st.st_size != len(key) and len(key) <= MAX_KEY_BYTES:
        # /proc and /sys files say they are regular files of 0 (or 4096) bytes whatever they
        # hold: a link to /proc/self/environ would make the process's environment the key.
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: it reads {len(key)} bytes but says it holds {st.st_size}: a file of the"
            " kernel's (/proc, /sys), not a key file"
        )
    if len(key) < MIN_KEY_BYTES:
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: holds {len(key)} bytes, need at least {MIN_KEY_BYTES} (e.g. head -c 32 "
            "/dev/urandom > FILE)"
        )
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: holds more than {MAX_KEY_BYTES} bytes; a key is 32 to {MAX_KEY_BYTES} bytes"
        )
    if len(set(key)) < MIN_KEY_DISTINCT_BYTES:
        raise InvalidArgumentError(
            f"invalid {what} {path!r}: its {len(key)} bytes take only {len(set(key))} distinct values, not a random"
            f" key (at least {MIN_KEY_DISTINCT_BYTES}; e.g. head -c 32 /dev/urandom > FILE)"
        )
    return key


@dataclass(frozen=True)
class RequestParams:
    """One request's ``kv_transfer_params["kvferry"]``, checked, or its NixlConnector-protocol
    parameters (``router`` true: `parse_router_params`)."""

    op: str
    transfer: Optional[str] = None
    peer: Optional[str] = None
    timeout_s: Optional[float] = None
    peer_mac: Optional[str] = None  # the decode server's signature of ``peer`` (kvferry.vllm.trust)
    # A router's request (NixlConnector's protocol): a send learns its decode server from
    # the decode server's offer, a recv makes that offer to ``offer_to`` (the prefill
    # server's rendezvous, signed by ``offer_mac``), whose tensor parallel size is ``prefill_tp``.
    router: bool = False
    offer_to: Optional[str] = None
    offer_mac: Optional[str] = None
    prefill_tp: Optional[int] = None
    # Keys of the request's kv_transfer_params that kvferry does not read (served anyway).
    ignored: tuple[str, ...] = ()


def parse_params(params: Any) -> Optional[RequestParams]:
    """The request's kvferry parameters, ``None`` when it has none (a plain request), or
    `InvalidArgumentError` naming the field and value that is wrong."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"invalid kv_transfer_params={params!r}: must be an object")
    if PARAMS_KEY not in params:
        return None
    ours = params[PARAMS_KEY]
    if not isinstance(ours, Mapping):
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry={ours!r}: must be an object")
    if "authkey" in ours:
        raise InvalidArgumentError(
            "invalid kv_transfer_params.kvferry key 'authkey': the key never travels in a request; both servers read "
            "it from kv_connector_extra_config.authkey_file (or the per-user default file)"
        )
    unknown = sorted(set(ours) - {"op", "transfer", "peer", "peer_mac", "timeout_s", "prefill_tp"})
    if unknown:
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry keys {unknown}: known keys are op, transfer, peer, peer_mac,"
            " timeout_s, prefill_tp"
        )
    op = ours.get("op")
    if op not in OPS:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.op={op!r}: must be one of {list(OPS)}")
    if op == "hello":
        return RequestParams("hello")
    transfer = ours.get("transfer")
    if not isinstance(transfer, str) or not _TRANSFER_ID.fullmatch(transfer):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry.transfer={_shown(transfer)}: must be 1 to {MAX_TRANSFER_CHARS}"
            f" characters of [{TRANSFER_ALPHABET}]"
        )
    if "prefill_tp" in ours and op != "recv":
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry keys ['prefill_tp'] for op {op!r}: only a recv names its prefill size"
        )
    if op == "status":
        extra = sorted(set(ours) - {"op", "transfer"})
        if extra:
            raise InvalidArgumentError(
                f"invalid kv_transfer_params.kvferry keys {extra} for op 'status': it takes op and transfer only"
            )
        return RequestParams("status", transfer)
    timeout = ours.get("timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (0 < timeout <= MAX_TIMEOUT_S and math.isfinite(timeout))
    ):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry.timeout_s={_shown(timeout)}: must be a positive number of seconds,"
            f" at most {MAX_TIMEOUT_S:g} (the server's own bounds cap it further)"
        )
    if op == "recv":
        if "peer_mac" in ours:
            raise InvalidArgumentError(
                "invalid kv_transfer_params.kvferry keys ['peer_mac'] for op 'recv': only a send names a peer"
            )
        tp = ours.get("prefill_tp")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= 1024):
            raise InvalidArgumentError(
                f"invalid kv_transfer_params.kvferry.prefill_tp={tp!r}: must be the prefill server's tensor parallel"
                " size (its hello answer's tp_size), an integer in [1, 1024]"
            )
        return RequestParams("recv", transfer, timeout_s=None if timeout is None else float(timeout), prefill_tp=tp)
    peer = ours.get("peer")
    if not isinstance(peer, str) or not 0 < len(peer) <= 4096:
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry.peer={peer!r}: must be the decode server's address from its hello "
            "answer"
        )
    mac = ours.get("peer_mac")
    hexdigits = "0123456789abcdef"
    if mac is not None and (not isinstance(mac, str) or len(mac) != 64 or any(c not in hexdigits for c in mac)):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.kvferry.peer_mac={str(mac)[:80]!r}:"
            " must be the 64 hex digits of the decode server's hello answer"
        )
    return RequestParams("send", transfer, peer, None if timeout is None else float(timeout), mac)


def _shown(value: Any) -> str:
    """A client's value inside an error message: its repr (which escapes every control
    character), cut to 300 characters."""
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A digest of the prompt's token ids: both halves of a transfer must carry the same
    prompt (a proxy bug must fail the request, not feed the decode side another prompt's KV).

    SHA-256 of the ids as little-endian int64, in one C-speed pass: both schedulers run it for
    each new request on their own thread, where a loop over a 128k-token prompt in Python took
    ~19 ms and stalled every running decode. `InvalidArgumentError` for an id that
    is not an int64."""
    try:
        ids = array.array("q", token_ids)
    except (TypeError, OverflowError) as err:
        raise InvalidArgumentError(
            f"invalid token_ids=<{len(token_ids)} ids>: each must be an integer in [-2**63, 2**63) ({err})"
        ) from None
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(ids).hexdigest()[:32]


# NixlConnector's kv_transfer_params (what vLLM's toy proxy, vllm-router's nixl mode and
# llm-d's nixlv2 sidecar send and pass on), and the keys a prefill answer adds that vLLM or a
# router may put back into the decode request.
ROUTER_KEYS = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    }
)
# vLLM 0.32's request ids: ``cmpl-<X-Request-Id>-<prompt index>-<8 hex>`` for completions,
# ``chatcmpl-<X-Request-Id>-<8 hex>`` for chat, a sample of ``n > 1`` prefixed ``<index>_``.
# A router sends both legs the same X-Request-Id.
_VLLM_REQUEST_ID = re.compile(r"^(?:[0-9]+_)?(?:chatcmpl-(?P<chat>.+)|cmpl-(?P<key>.+)-[0-9]+)-[0-9a-f]{8}$")


def router_key(request_id: str) -> str:
    """The transfer id of a router's prefill request: the X-Request-Id vLLM made its request
    id from (both legs of a vllm-router request carry the same one), else the id itself; each
    character outside the transfer ids' alphabet (`TRANSFER_ALPHABET`) made ``_``, so a client's
    X-Request-Id cannot forge a log line."""
    found = _VLLM_REQUEST_ID.match(request_id)
    key = (found.group("chat") or found.group("key")) if found else request_id
    return _NOT_TRANSFER.sub("_", key[:MAX_TRANSFER_CHARS]) or "_"


def parse_router_params(params: Any, request_id: str) -> Optional[RequestParams]:
    """A request in NixlConnector's protocol (``do_remote_decode`` or ``do_remote_prefill``
    true), checked: a send for the first, a recv for the second; ``None`` for any other.
    `InvalidArgumentError` names the field that is missing or wrong."""
    if not isinstance(params, Mapping):
        return None
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, value in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"invalid kv_transfer_params.{name}={value!r}: must be true or false")
    if not decode and not prefill:
        return None
    if decode and prefill:
        raise InvalidArgumentError(
            "invalid kv_transfer_params: do_remote_decode and do_remote_prefill are both true; a request is one"
            " leg of a transfer"
        )
    ignored = tuple(sorted(str(k) for k in params if k not in ROUTER_KEYS))
    if decode:
        return RequestParams("send", router_key(request_id), router=True, ignored=ignored)
    host, port, transfer = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    hint = (
        " (a KvferryConnector prefill server answers it; is the prefill server running KvferryConnector, and does"
        " the router pass its kv_transfer_params on?)"
    )
    if not isinstance(host, str) or not 0 < len(host) <= 255 or any(c.isspace() or c in "/@[]" for c in host):
        raise InvalidArgumentError(f"invalid kv_transfer_params.remote_host={host!r}: must be a host name or IP{hint}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.remote_port={port!r}: must be a port in [1, 65535]{hint}"
        )
    if not isinstance(transfer, str) or not _TRANSFER_ID.fullmatch(transfer):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.remote_request_id={_shown(transfer)}: must be 1 to {MAX_TRANSFER_CHARS}"
            f" characters of [{TRANSFER_ALPHABET}], as a KvferryConnector prefill server answers it{hint}"
        )
    engine = params.get("remote_engine_id")
    mac = engine.rpartition(".")[2] if isinstance(engine, str) else None
    if mac is None or len(mac) != 64 or any(c not in "0123456789abcdef" for c in mac):
        raise InvalidArgumentError(
            f"invalid kv_transfer_params.remote_engine_id={str(engine)[:200]!r}: must be the one a KvferryConnector"
            f" prefill server answered (<engine>.<64 hex digits>){hint}"
        )
    tp = params.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= 1024:
        raise InvalidArgumentError(f"invalid kv_transfer_params.tp_size={tp!r}: must be a positive integer")
    where = f"[{host}]" if ":" in host else host
    return RequestParams(
        "recv",
        transfer,
        router=True,
        offer_to=f"tcp://{where}:{port}",
        offer_mac=mac,
        prefill_tp=tp,
        ignored=ignored,
    )
