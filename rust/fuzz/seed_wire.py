"""Writes the `wire` fuzz target's seeds for the rendezvous's frames (its own set of frames:
kvferry._core.rendezvous_encode; one valid frame of each type, and a few edge values) and for
the NIXL hello (kvferry._core.wire_encode: a packed pool and a strided one, wire version 3's
strides and regions; version 4's notices and staging batches with checksums) into rust/fuzz/corpus/wire, named by their SHA-1 as libFuzzer names its inputs. Run from the
repository root: .venv/bin/python rust/fuzz/seed_wire.py"""

from __future__ import annotations

import hashlib
import os

from kvferry import _core

DESTINATION = {
    "call": 3,
    "request_id": 7,
    "epoch": 2,
    "prompt_len": 40,
    "digest": "0123456789abcdef0123456789abcdef",
    "block_size": 16,
    "dst_blocks": [7, 3, 9],
    "held_blocks": 1,
    "engine": "3f2a9c01d4e5b6a7",
    "endpoint": "staging+unix:///tmp/kvferry-x/notices.sock",
}
FRAMES = [
    ("lookup", {"call": 1, "transfer": "T", "wait_ms": 60000, "sender": "prefill-0"}),
    ("lookup", {"call": 4294967295, "transfer": "turn-1 ⟂", "wait_ms": 3600000, "sender": "P"}),
    ("destination", DESTINATION),
    ("destination", dict(DESTINATION, dst_blocks=[], held_blocks=0, endpoint="nixl+tcp://[::1]:5000")),
    ("refused", {"call": 1, "error": "transfer 'T' was abandoned: prefill aborted"}),
    ("abandon", {"call": 2, "transfer": "T", "reason": "prefill request refused the destination", "epoch": 3}),
    ("abandon", {"call": 0, "transfer": "T", "reason": "", "epoch": 0}),
    ("abandoned", {"call": 2}),
    ("offer", {"call": 5, "transfer": "T", "peer": "unix:///tmp/kvferry-x/rendezvous.sock", "peer_mac": "0f" * 32}),
    ("offer", {"call": 6, "transfer": "K", "peer": "tcp://10.0.0.2:7001 tcp://10.0.0.2:7002", "peer_mac": "ab" * 32}),
    ("accepted", {"call": 5}),
]

NIXL_HELLO = {
    "geometry": {
        "num_layers": 2,
        "tokens_per_block": 16,
        "dtype": "torch.bfloat16",
        "segments": 2,
        "segment_bytes": 64,
        "block_layout": "H2.N16.C16",
    },
    "num_blocks": 8,
    "block_dim": 1,
    "kind": "nixl",
    "agent_name": "kvferry-rx-0",
    "agent_metadata": b"opaque agent metadata",
    "mem_type": "DRAM",
    "device": 0,
    "bases": [0x10000, 0x20000],
    "segment_stride": 512,
    "block_stride": 64,
    "regions": [{"start": 0x10000, "length": 1024}, {"start": 0x20000, "length": 1024}],
}
NOTICES = [(7, 0, 0, 2, False, 3, 0, 1), (7, 1, 2, 3, True, 3, 1, 2)]
TRANSPORT_FRAMES = [
    # wire version 4's checksums: one per block the notices cover, after the destination ids
    ("notices", {"notices": NOTICES, "dst_ids": [9, 4, 7], "checksums": [0, 2**64 - 1, 0x9E3779B97F4A7C15]}),
    ("notices", {"notices": NOTICES, "dst_ids": None, "checksums": None}),
    (
        "staged",
        {"notices": NOTICES, "lo": 4, "freed": 3, "picked": None, "dst_ids": [1, 2, 3], "checksums": [1, 2, 3]},
    ),
    ("hello", NIXL_HELLO),
    # block-outer: the layers interleave in one registered region, blocks 256 bytes apart
    (
        "hello",
        dict(
            NIXL_HELLO,
            mem_type="VRAM",
            bases=[0x10000, 0x10080],
            segment_stride=64,
            block_stride=256,
            regions=[{"start": 0x10000, "length": 2048}],
        ),
    ),
]


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "wire")
    for kind, fields in FRAMES:
        data = bytes(_core.rendezvous_encode(kind, fields))
        assert _core.rendezvous_decode(data, _core.WIRE_MAX_FRAME_BYTES)[0] == kind
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
    for kind, fields in TRANSPORT_FRAMES:
        data = bytes(_core.wire_encode(kind, fields))
        assert _core.wire_decode(data, _core.WIRE_MAX_FRAME_BYTES)[0] == kind
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
