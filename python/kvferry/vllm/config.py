"""The connector's settings (``kv_connector_extra_config``) and the per-request parameters
(``kv_transfer_params["kvferry"]``), validated in one place. No vLLM import here: both are
plain data, and the tests check them without an engine.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

from kvferry.errors import InvalidArgumentError

__all__ = ["ConnectorConfig", "RequestParams", "prompt_digest", "parse_params"]

PARAMS_KEY = "kvferry"
OPS = ("hello", "recv", "send")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys, with their defaults (docs/vllm.md lists them)."""

    transport: str = "staging"  # the only same-host transport that writes into plain CPU tensors
    early: bool = True  # send the prefix-cache hit before the first forward
    layer_groups: int = 1  # >1: the last chunk leaves layer group by layer group
    transfer_timeout_s: float = 120.0  # a decode request waits at most this for its blocks
    destination_timeout_s: float = 60.0  # a prefill request waits at most this for its destination
    fence_timeout_s: float = 10.0  # after giving up, how long the decode side waits for the fence
    staging_bytes: int = 64 << 20  # the staging ring's size
    authkey_file: Optional[str] = None  # a file holding the endpoints' key (else: random per process)
    rendezvous_dir: Optional[str] = None  # where the decode side's sockets live (else: a fresh 0700 dir)

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> ConnectorConfig:
        """Builds the config from ``kv_connector_extra_config``, refusing unknown keys and
        values of the wrong type by name (a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgumentError(f"invalid kv_connector_extra_config keys {unknown}: known keys are {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if name in ("authkey_file", "rendezvous_dir", "transport"):
                if value is not None and not isinstance(value, str):
                    raise InvalidArgumentError(f"invalid kv_connector_extra_config {name}={value!r}: must be a string")
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"invalid kv_connector_extra_config {name}={value!r}: must be true or false")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise InvalidArgumentError(f"invalid kv_connector_extra_config {name}={value!r}: must be a positive integer")
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                    raise InvalidArgumentError(f"invalid kv_connector_extra_config {name}={value!r}: must be a positive number of seconds")
                value = float(value)
            values[name] = value
        config = cls(**values)
        if config.transport != "staging":
            raise InvalidArgumentError(f"invalid kv_connector_extra_config transport={config.transport!r}: this version supports 'staging' (same host)")
        return config

    def authkey(self) -> bytes:
        """The key both endpoints of a decode server require: read from ``authkey_file``, or
        random for this process (it then travels to the proxy in the ``hello`` answer)."""
        if self.authkey_file is None:
            return secrets.token_bytes(32)
        with open(os.path.expanduser(self.authkey_file), "rb") as f:
            key = f.read().strip()
        if len(key) < 16:
            raise InvalidArgumentError(f"invalid authkey_file={self.authkey_file!r}: holds {len(key)} bytes, need at least 16")
        return key


@dataclass(frozen=True)
class RequestParams:
    """One request's ``kv_transfer_params["kvferry"]``, checked."""

    op: str
    transfer: Optional[str] = None
    peer: Optional[str] = None
    authkey: Optional[bytes] = None
    timeout_s: Optional[float] = None


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
    unknown = sorted(set(ours) - {"op", "transfer", "peer", "authkey", "timeout_s"})
    if unknown:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry keys {unknown}: known keys are op, transfer, peer, authkey, timeout_s")
    op = ours.get("op")
    if op not in OPS:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.op={op!r}: must be one of {list(OPS)}")
    if op == "hello":
        return RequestParams("hello")
    transfer = ours.get("transfer")
    if not isinstance(transfer, str) or not 0 < len(transfer) <= 256:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.transfer={transfer!r}: must be a non-empty string of at most 256 characters")
    timeout = ours.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (timeout > 0 and math.isfinite(timeout))):
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.timeout_s={timeout!r}: must be a positive number of seconds")
    if op == "recv":
        return RequestParams("recv", transfer, timeout_s=None if timeout is None else float(timeout))
    peer, key = ours.get("peer"), ours.get("authkey")
    if not isinstance(peer, str) or not peer:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.peer={peer!r}: must be the decode server's address from its hello answer")
    try:
        authkey = bytes.fromhex(key) if isinstance(key, str) else None
    except ValueError:
        authkey = None
    if authkey is None or len(authkey) < 16:
        raise InvalidArgumentError(f"invalid kv_transfer_params.kvferry.authkey={key!r}: must be the hex key from the decode server's hello answer")
    return RequestParams("send", transfer, peer, authkey, None if timeout is None else float(timeout))


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A digest of the prompt's token ids: both halves of a transfer must carry the same
    prompt (a proxy bug must fail the request, not feed the decode side another prompt's KV)."""
    h = hashlib.sha256()
    for t in token_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:32]
