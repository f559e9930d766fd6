"""Parking (kvferry.vllm.park): a prompt computed before its destination is copied into the
prefill worker's host pool, vLLM frees (and reuses) its blocks, and the late send reads the
host copy. Driven through the connector's worker halves (no vLLM) over vLLM's KV cache
layouts, on CPU and, with the ``cuda`` marker, on CUDA caches (a pinned host pool, the copy
on a side stream)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SLACK, until
from kvferry.errors import InvalidArgumentError
from test_kv_layouts import layer_index, poison, random_bytes, vllm_views
from test_worker_replay import FIXTURE, KEY, SENDER, half

LAYERS, HEADS, HEAD_DIM = 3, 2, 8
TOKENS = FIXTURE["model"]["block_size"]  # the worker halves' (test_worker_replay.half)
PREFILL_BLOCKS, DECODE_BLOCKS, PARK_BLOCKS = 12, 10, 6
PROMPT = 3 * TOKENS + 5  # 4 blocks, the last one partial
TABLE, HOST, DST = [9, 2, 7, 4], [1, 0, 3, 2], [5, 6, 1, 8]


def park_and_send(tmp_path: Path, layout: str, dtype: torch.dtype, device: str) -> None:
    from kvferry.vllm import rendezvous
    from kvferry.vllm.metadata import Chunk, KvferryMetadata, RecvSpec, SendSpec

    shape = dict(layers=LAYERS, tokens=TOKENS)
    src = vllm_views(layout, HEADS, 2 * HEAD_DIM, dtype, device, random_bytes(5), blocks=PREFILL_BLOCKS, **shape)
    dst = vllm_views(layout, HEADS, 2 * HEAD_DIM, dtype, device, poison, blocks=DECODE_BLOCKS, **shape)
    decode = half(tmp_path, "kv_consumer", DECODE_BLOCKS, "staging")
    prefill = half(tmp_path, "kv_producer", PREFILL_BLOCKS, "staging")
    prefill.common.park_blocks = PARK_BLOCKS
    try:
        decode.register(dst.as_dict(), layer_index)
        prefill.register(src.as_dict(), layer_index)
        want = [view[TABLE].clone() for view in src.views]  # the prompt's blocks, every layer
        prefill.bind(KvferryMetadata(parks=[("p", TABLE, HOST)]))
        sent: set[str] = set()
        assert until(lambda: sent.update(prefill.results(set())[0]) or "p" in sent), "never reported copied"
        with torch.inference_mode():  # vLLM freed the blocks and another request overwrote them
            for view in src.views:
                view.view(torch.int8)[TABLE] = 7
        transfer = "parked-transfer"
        recv = RecvSpec("d", 1 << 32, transfer, PROMPT, [DST], 0, "ab" * 16, SLACK)
        decode.bind(KvferryMetadata(recvs=[recv]))
        destination = rendezvous.lookup(decode.decode.rendezvous.address, KEY, transfer, SLACK, SENDER)
        spec = SendSpec("p", transfer, PROMPT, 0, "peer", destination, SLACK, finished=True)
        late = [[PREFILL_BLOCKS + h for h in HOST]]  # the host blocks, in the combined id space
        prefill.bind(KvferryMetadata(sends=[spec], chunks=[Chunk("p", 0, PROMPT, late)]))
        arrived: set[str] = set()

        def landed() -> bool:
            sending, recving, failed = prefill.results(set())
            assert not failed and "p" not in sending  # reported once, when it parked
            _, got, lost = decode.results(set())
            assert not lost, lost
            arrived.update(got)
            return "d" in arrived and prefill.common.unparked == ["p"]

        assert until(landed), (arrived, prefill.common.unparked)
        tail = PROMPT % TOKENS  # the prompt's tokens in its last block: only those are sent
        for layer, (view, expected) in enumerate(zip(dst.views, want)):
            got = view[DST].view(torch.int8)
            assert torch.equal(got[:-1], expected.view(torch.int8)[:-1]), f"layer {layer}"
            assert torch.equal(got[-1, :, :tail], expected.view(torch.int8)[-1, :, :tail]), f"layer {layer}"
        assert prefill.common.tally.totals["parked_prompts"] == 1
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_a_parked_prompt_is_sent_from_its_host_copy_after_vllm_reused_its_blocks(tmp_path: Path, layout: str) -> None:
    """The prompt's blocks are copied into host blocks HOST and reported finished_sending (vLLM
    frees them); the pool's blocks are then overwritten, and the late send, naming the host
    blocks, still lands the prompt as computed, byte for byte; the worker reports the
    request unparked once its send ended."""
    park_and_send(tmp_path, layout, torch.float16, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_cuda_a_parked_prompt_is_sent_from_its_pinned_host_copy(tmp_path: Path, layout: str) -> None:
    park_and_send(tmp_path, layout, torch.bfloat16, "cuda")


def test_the_host_pool_is_sized_by_bytes_and_capped_by_the_pool() -> None:
    from types import SimpleNamespace

    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.park import ParkBook, park_blocks

    config = SimpleNamespace(num_blocks=100, kv_cache_tensors=[SimpleNamespace(size=100 * 1024)] * 2)  # 2 KiB a block
    assert park_blocks(1 << 30, config, 1) == 100  # at most the pool's size
    assert park_blocks(10 * 2048 + 5, config, 1) == 10
    assert park_blocks(0, config, 1) == 0  # off
    assert park_blocks(1 << 30, config, 2) == 0  # several KV cache groups: off
    assert ConnectorConfig().late_host_bytes == 0  # off unless asked for
    assert ConnectorConfig.from_extra({"late_host_bytes": 4096}).late_host_bytes == 4096
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(InvalidArgumentError, match=rf"late_host_bytes={bad!r}: must be an integer >= 0"):
            ConnectorConfig.from_extra({"late_host_bytes": bad})
    book = ParkBook(3)
    assert book.take(4) is None and book.free == 3  # all or nothing
    assert book.take(2) == [0, 1] and book.take(2) is None
    book.give([1, 0])
    assert book.take(3) == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match=r"capacity=-1"):
        ParkBook(-1)
