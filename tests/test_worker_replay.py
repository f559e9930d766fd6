"""KvferryConnector's worker half (kvferry.vllm.worker_half, the code vLLM's worker-side hooks
forward to) driven with what real vLLM 0.32 engines handed it: tests/fixtures/worker_steps.json,
recorded by tests/fixtures/record_worker_steps.py from a prefill and a decode engine (the
tiny Llama, 32-token blocks, chunked prefill of 64 tokens, ``layer_groups`` 2; a turn whose
prefill hit leaves before the first forward, and a turn whose prefix the decode engine holds).

No vLLM here: this runs where vLLM cannot (the GPU machine, with CUDA caches: the ``cuda``
variant) and on CPU. Each recorded call is replayed in the order the two engines made them
(one clock for both processes): the decode half's binds (expect, publish) and results, the
prefill half's binds (the early send), each bind followed by the layers' ``save_kv_layer`` and
``wait_for_save`` of its forward, and its results with the requests vLLM finished. The one
thing not replayed as recorded is each send's destination: the live decode half publishes its
own (endpoint, epoch), which the replay looks up as the scheduler half does.

Afterwards: every decode request arrived and every prefill request finished sending, once;
each destination block equals its source block byte for byte (the caches filled with random
bytes, the decode cache poisoned first), every block no request names is still poison, the
early bytes are the first turn's hit (3 blocks of every layer) and nothing else, and the
second turn's 5 held blocks were not sent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers import SLACK, until
from test_kv_layouts import layer_index, poison, random_bytes, vllm_views

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "worker_steps.json").read_text())
KEY = b"k" * 32
SENDER = "replay-prefill-engine"


def metadata(data: dict[str, Any]) -> Any:
    """A recorded `KvferryMetadata` (``dataclasses.asdict``) back as the dataclasses."""
    from kvferry.vllm.metadata import Chunk, KvferryMetadata, RecvSpec, SendLeg, SendSpec

    def send(s: dict[str, Any]) -> SendSpec:
        legs = None
        if s["legs"] is not None:
            legs = [
                SendLeg(**{**leg, "src_heads": tuple(leg["src_heads"]), "dst_heads": tuple(leg["dst_heads"])})
                for leg in s["legs"]
            ]
        return SendSpec(**{**s, "legs": legs})

    return KvferryMetadata(
        recvs=[RecvSpec(**r) for r in data["recvs"]],
        sends=[send(s) for s in data["sends"]],
        chunks=[Chunk(**c) for c in data["chunks"]],
        fails=[tuple(f) for f in data["fails"]],
        preempted=list(data["preempted"]),
        releases=[tuple(r) for r in data["releases"]],
    )


def half(tmp_path: Path, role: str, num_blocks: int, transport: str, **config: Any) -> Any:
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.worker import WorkerCommon
    from kvferry.vllm.worker_half import WorkerHalf

    settings = ConnectorConfig(
        rendezvous_dir=str(tmp_path), transport=transport, transfer_timeout_s=SLACK, destination_timeout_s=SLACK,
        **config,
    )  # fmt: skip
    common = WorkerCommon(
        settings,
        block_size=FIXTURE["model"]["block_size"],
        num_blocks=num_blocks,
        authkey=KEY,
        num_kv_heads=FIXTURE["model"]["kv_heads"],
    )
    return WorkerHalf(common, role)


def replay(
    tmp_path: Path, layout: str, dtype: torch.dtype, device: str, transport: str, seen: Optional[dict] = None
) -> None:
    """``seen``, when given, gets the prefill half (``"prefill"``) and the transport each
    prefill engine was connected over at the end (``"taken"``, by sender)."""
    from kvferry.vllm import paths, rendezvous

    model = FIXTURE["model"]
    shape = dict(layers=model["layers"], tokens=model["block_size"])
    content = 2 * model["head_dim"]  # K|V of one head and token
    src = vllm_views(layout, model["kv_heads"], content, dtype, device, random_bytes(21),
                     blocks=FIXTURE["prefill"]["num_blocks"], **shape)  # fmt: skip
    dst = vllm_views(layout, model["kv_heads"], content, dtype, device, poison,
                     blocks=FIXTURE["decode"]["num_blocks"], **shape)  # fmt: skip
    decode = half(tmp_path, "kv_consumer", FIXTURE["decode"]["num_blocks"], transport)
    prefill = half(tmp_path, "kv_producer", FIXTURE["prefill"]["num_blocks"], transport, layer_groups=2)
    names = sorted(src.as_dict(), key=layer_index)  # the forward's order
    try:
        decode.register(dst.as_dict(), layer_index)
        prefill.register(src.as_dict(), layer_index)
        address = decode.decode.rendezvous.address
        calls = [("decode", c) for c in FIXTURE["decode"]["calls"]] + [
            ("prefill", c) for c in FIXTURE["prefill"]["calls"]
        ]
        recvs: dict[str, Any] = {}  # transfer -> RecvSpec
        last_table: dict[str, list[list[int]]] = {}  # prefill request -> its table at its last chunk
        transfer_of: dict[str, str] = {}  # prefill request -> transfer
        arrived: list[str] = []
        sent: list[str] = []

        def step() -> None:
            """An engine step with nothing scheduled, on both: the halves' results (a prefill
            half also takes in its new connections and starts what waited for them)."""
            for side, into in ((prefill, sent), (decode, arrived)):
                sending, recving, failed = side.results(set())
                assert not failed, failed
                into += sending | recving

        for side, call in sorted(calls, key=lambda sc: sc[1]["t"]):
            if call["call"] == "results":
                finished = set(call["finished"])
                if side == "decode":  # vLLM finishes a decode request only after its KV arrived
                    expecting = {r.req_id for r in recvs.values()}

                    def landed(wanted: set[str] = finished & expecting) -> bool:
                        step()  # both engines keep stepping meanwhile
                        return wanted <= set(arrived)

                    assert until(landed), f"{sorted(finished & expecting)} never arrived (arrived: {arrived})"
                sending, recving, failed = (prefill if side == "prefill" else decode).results(finished)
                assert not failed, (side, call, failed)
                sent += sending
                arrived += recving
                continue
            meta = metadata(call["meta"])
            if side == "decode":
                recvs.update({r.transfer: r for r in meta.recvs})
                decode.bind(meta)
                continue
            for spec in meta.sends:  # the live destination, looked up as the scheduler half does
                spec.destination = rendezvous.lookup(address, KEY, spec.transfer, SLACK, SENDER)
                transfer_of[spec.req_id] = spec.transfer
            for chunk in meta.chunks:
                last_table[chunk.req_id] = chunk.src_blocks
            prefill.bind(meta)
            for name in names:  # the forward: each layer saved in turn
                prefill.save_layer(name)
            prefill.wait_for_save()

        def settled() -> bool:
            step()
            return len(sent) == len(transfer_of) and len(arrived) == len(recvs)

        assert until(settled), f"sent {sent} of {sorted(transfer_of)}, arrived {arrived} of {sorted(recvs)}"
        assert len(set(sent)) == len(sent) and len(set(arrived)) == len(arrived)  # each reported once
        check_blocks(src, dst, recvs, transfer_of, last_table)
        check_figures(prefill, decode, src)
        if seen is not None:
            seen["prefill"] = prefill
            seen["taken"] = {
                sender: served.taken() if isinstance(served, paths.Choice) else served.name
                for sender, served in decode.decode.endpoints.items()
            }
    finally:
        prefill.close()
        decode.close()


def check_blocks(src: Any, dst: Any, recvs: dict[str, Any], transfer_of: dict[str, str], tables: dict) -> None:
    """Each decode block holds what the last transfer that wrote it sent (a block vLLM freed
    and gave to a later request is written again), byte for byte in every layer; a held
    block holds what the request's own source block holds (the decode side's prefix is the
    prefill side's); every block no request names is still poison."""

    def block(views: Any, b: int) -> list[torch.Tensor]:
        return [v[b].reshape(-1).view(torch.int8).cpu() for v in views]

    expected: dict[int, int] = {}  # decode block -> the source block last sent into it
    for rid, transfer in transfer_of.items():  # in the replay's order
        spec = recvs[transfer]
        (src_table,), (dst_table,) = tables[rid], spec.dst_blocks  # one KV cache group
        blocks = math.ceil(spec.prompt_len / FIXTURE["model"]["block_size"])
        for i in range(spec.held_blocks):
            assert dst_table[i] in expected, f"request {rid}: held block {i} never arrived"
            same = all(torch.equal(a, b) for a, b in zip(block(src.views, expected[dst_table[i]]),
                                                          block(src.views, src_table[i])))  # fmt: skip
            assert same, f"request {rid}: held block {i} is not its prefix's"
        expected.update({dst_table[i]: src_table[i] for i in range(spec.held_blocks, blocks)})
    for b in range(FIXTURE["decode"]["num_blocks"]):
        got = block(dst.views, b)
        if b in expected:
            for layer, (g, w) in enumerate(zip(got, block(src.views, expected[b]))):
                assert torch.equal(g, w), f"decode block {b} layer {layer}: bytes differ from source {expected[b]}"
        else:
            assert all(bool((g == -1).all()) for g in got), f"decode block {b}: written, though no request names it"


def check_figures(prefill: Any, decode: Any, src: Any) -> None:
    """The early bytes are the first turn's hit (3 blocks of every layer); the second turn's
    hit (5 blocks) was held by the decode side, so not sent; each turn's last chunk left
    layer group by layer group; every other block once; no notice refused."""
    item = src.views[0].element_size()
    per_block = sum(v[0].numel() for v in src.views) * item
    sent, got = prefill.common.tally.totals, decode.common.tally.totals
    assert sent.get("early_issued_bytes", 0) == 3 * per_block, sent
    assert sent.get("held_blocks", 0) == 5, sent
    assert got.get("duplicates_refused", 0) == 0 and got.get("notices_refused", 0) == 0, got
    assert sent.get("layer_bytes", 0) > 0, sent  # each last chunk left layer group by layer group
    moved = sum(sent.get(k, 0) for k in ("early_issued_bytes", "chunk_bytes", "layer_bytes"))
    # Turn 1: 6 blocks of 176 tokens; turn 2: 8 blocks of 242, of which 5 held.
    assert moved == (6 + 3) * per_block, sent


def test_the_recording_is_what_the_replay_checks() -> None:
    """The fixture holds the turns the checks count on: turn 1 a 3-block hit sent early into
    a cold decode request, turn 2 a 5-block hit the decode side holds (turn 1's first 5
    blocks; its partial sixth was freed and is written again by turn 2)."""
    sends = [s for c in FIXTURE["prefill"]["calls"] if c["call"] == "bind" for s in c["meta"]["sends"]]
    recvs = [r for c in FIXTURE["decode"]["calls"] if c["call"] == "bind" for r in c["meta"]["recvs"]]
    assert [(s["reused_len"], s["early"]) for s in sends] == [(96, True), (160, True)]
    assert [r["held_blocks"] for r in recvs] == [0, 5]
    first, second = (r["dst_blocks"][0] for r in recvs)
    assert second[:5] == first[:5]  # held blocks: turn 1's


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_cpu_worker_half_replays_a_real_engines_steps(tmp_path: Path, layout: str) -> None:
    replay(tmp_path, layout, torch.float32, "cpu", "staging")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_cuda_worker_half_replays_a_real_engines_steps(tmp_path: Path, layout: str, dtype: torch.dtype) -> None:
    """The same steps over CUDA caches in vLLM's GPU layouts (head-major, FlashAttention's
    token-major NHD, block-outer) through the pinned staging ring."""
    replay(tmp_path, layout, dtype, "cuda", "staging")
