"""What the scheduler half's tests stand in for: the parts of vLLM's Request, KV cache manager
and SchedulerOutput the half reads, and a destination published by hand at a real decode
rendezvous (the decode engine's admission is then the test's own). No vLLM needed."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

from kvferry.vllm.config import prompt_digest


class Status:
    def __init__(self, name: str) -> None:
        self.name = name


class Request:
    """What the scheduler half reads of vLLM's Request."""

    def __init__(self, rid: str, prompt: list[int], params: Any) -> None:
        self.request_id, self.prompt_token_ids, self.kv_transfer_params = rid, prompt, params
        self.num_prompt_tokens = self.num_tokens = len(prompt)
        self.status = Status("WAITING")


class Manager:
    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    def get_block_ids(self, rid: str) -> tuple[list[int]]:
        return (self.tables[rid],)


def step(scheduled: dict[str, tuple[int, int]]) -> Any:
    """A SchedulerOutput with ``scheduled`` (req_id -> (computed before, tokens this step))."""
    cached = SimpleNamespace(
        req_ids=list(scheduled), num_computed_tokens=[s for s, _ in scheduled.values()], resumed_req_ids=set()
    )
    return SimpleNamespace(
        preempted_req_ids=(),
        num_scheduled_tokens={r: n for r, (_, n) in scheduled.items()},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
    )


def publish(rdv: Any, transfer: str, prompt: list[int], block_size: int = 4) -> None:
    """Publishes ``transfer``'s destination at decode rendezvous ``rdv``: blocks 100, 101, ..."""
    blocks = -(-len(prompt) // block_size)
    rdv.publish(
        transfer,
        {
            "request_id": 1 << 32,
            "epoch": 1,
            "prompt_len": len(prompt),
            "digest": prompt_digest(prompt),
            "block_size": block_size,
            "dst_blocks": list(range(100, 100 + blocks)),
            "held_blocks": 0,
            "engine": "decode-engine",
        },
    )


@contextlib.contextmanager
def scheduler_pair(rendezvous_dir: str, key: bytes) -> Iterator[tuple[Any, Any, Any, Manager]]:
    """A prefill and a decode scheduler half (blocks of 4 tokens, one fake KV cache manager)
    and the decode server's real rendezvous in ``rendezvous_dir``, destinations published by
    hand (the decode worker's part): ``(prefill, decode, rendezvous, manager)``, closed at exit."""
    from kvferry.vllm import rendezvous
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import Handshake
    from kvferry.vllm.scheduler import SchedulerSide

    rdv = rendezvous.Rendezvous(key, lambda sender: "staging+unix:///nowhere/ring.sock", rendezvous_dir)
    manager = Manager({})
    prefill = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_producer", engine_id="prefill-engine",
                            kv_cache_manager_getter=lambda: manager, authkey=key)  # fmt: skip
    decode = SchedulerSide(ConnectorConfig(), block_size=4, role="kv_consumer", engine_id="decode-engine",
                           kv_cache_manager_getter=lambda: manager, authkey=key)  # fmt: skip
    decode.set_handshakes({0: Handshake("decode-engine", rdv.address)})
    try:
        yield prefill, decode, rdv, manager
    finally:
        prefill.close()
        decode.close()
        rdv.close()
