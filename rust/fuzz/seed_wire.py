"""Writes the `wire` fuzz target's seeds for the rendezvous's frames (its own set of frames:
kvferry._core.rendezvous_encode; one valid frame of each type, and a few edge values) into
rust/fuzz/corpus/wire, named by their SHA-1 as libFuzzer names its inputs. Run from the
repository root: .venv/bin/python rust/fuzz/seed_wire.py"""

from __future__ import annotations

import hashlib
import os

from kvferry import _core

DESTINATION = {
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
    ("lookup", {"transfer": "T", "wait_ms": 60000, "sender": "prefill-0"}),
    ("lookup", {"transfer": "turn-1 ⟂", "wait_ms": 3600000, "sender": "P"}),
    ("destination", DESTINATION),
    ("destination", dict(DESTINATION, dst_blocks=[], held_blocks=0, endpoint="nixl+tcp://[::1]:5000")),
    ("refused", {"error": "transfer 'T' was abandoned: prefill aborted"}),
    ("abandon", {"transfer": "T", "reason": "prefill request refused the destination"}),
    ("abandon", {"transfer": "T", "reason": ""}),
    ("abandoned", {}),
]


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "wire")
    for kind, fields in FRAMES:
        data = bytes(_core.rendezvous_encode(kind, fields))
        assert _core.rendezvous_decode(data, _core.WIRE_MAX_FRAME_BYTES)[0] == kind
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
