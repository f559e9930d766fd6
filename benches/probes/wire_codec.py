"""Cost of one control-plane frame through the Rust codec (kvferry._core.wire_*) against the
pickles it replaced, per batch size: encode + decode of a notices frame carrying the
destination ids of its blocks (4 per notice), as the transports send them.

    .venv/bin/python benches/probes/wire_codec.py

Prints microseconds per frame (median of 7 repeats) and the ratio to pickle (protocol 5, the
tuples and an int64 array, as multiprocessing.connection sent them)."""

from __future__ import annotations

import pickle
import statistics
import timeit

import numpy as np
from kvferry import _core
from kvferry.notice import Notice

LIMIT = _core.WIRE_MAX_FRAME_BYTES


def main() -> None:
    print(f"{'notices':>8} {'codec us':>9} {'pickle us':>10} {'ratio':>6} {'bytes':>7} {'+Notice objs us':>16}")
    for n in (1, 16, 256):
        notices = [Notice(i, 0, 4 * i, 4 * i + 4, False, 7, 0, 1).as_tuple() for i in range(n)]
        dst = np.arange(4 * n, dtype=np.int64)
        value = {"notices": notices, "dst_ids": dst}

        def codec() -> None:
            _core.wire_decode(_core.wire_encode("notices", value), LIMIT)

        def objects() -> None:
            _, fields = _core.wire_decode(_core.wire_encode("notices", value), LIMIT)
            [Notice(*t) for t in fields["notices"]]

        def pickled() -> None:
            pickle.loads(pickle.dumps(value, protocol=5))

        runs = max(1, 20000 // n)
        row = []
        for fn in (codec, pickled, objects):
            times = timeit.repeat(fn, number=runs, repeat=7)
            row.append(statistics.median(times) / runs * 1e6)
        size = len(_core.wire_encode("notices", value))
        print(f"{n:>8} {row[0]:>9.2f} {row[1]:>10.2f} {row[0] / row[1]:>6.2f} {size:>7} {row[2]:>16.2f}")


if __name__ == "__main__":
    main()
