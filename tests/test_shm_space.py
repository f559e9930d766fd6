"""A /dev/shm too small for a pool or a staging ring (a container's default is 64 MiB, and the
vLLM connector's ring is 1 GiB on CUDA caches) is refused by name when the segment is made,
instead of the process dying of SIGBUS at the first page past the tmpfs's end. Each case runs
in a private mount namespace whose /dev/shm is a 4 MiB tmpfs (root and `unshare` needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None,
    reason="needs root and unshare(1) for a private /dev/shm",
)

SCRIPT = textwrap.dedent(
    """
    import json, os, secrets, torch
    from kvferry.errors import SharedMemoryError, TransferError
    from kvferry.receiver import KVReceiver
    from kvferry.transports import registry
    from kvferry.transports.shm import SharedPool

    def ours():
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("kvferry-"))

    out = {}
    try:  # 2 layers x 16 blocks x 1 MiB = 32 MiB, in a 4 MiB /dev/shm
        SharedPool.create(num_layers=2, shape=(16, 1 << 18), dtype=torch.float32, tokens_per_block=16)
        out["pool"] = "created"
    except SharedMemoryError as err:
        out["pool"] = str(err)
    out["pool_left"] = ours()
    small = SharedPool.create(num_layers=2, shape=(4, 1 << 10), dtype=torch.float32, tokens_per_block=16)
    out["small_fits"] = small.pool is not None and len(ours()) == 1
    small.close()

    # A staging endpoint whose ring (16 blocks of 2 layers x 1 MiB) cannot fit: made at a
    # sender's handshake, so that sender is refused with the reason; the endpoint serves on.
    pool = registry.receiver_pool("staging", num_layers=2, shape=(16, 1 << 18), dtype=torch.float32,
                                  tokens_per_block=16)
    receiver = KVReceiver(pool.pool)
    key = secrets.token_bytes(32)
    served = registry.serve("staging", receiver, authkey=key, capacity_blocks=16)
    try:
        registry.connect(served.url, authkey=key, handshake_timeout=10.0)
        out["ring"] = "connected"
    except TransferError as err:
        out["ring"] = str(err)
    out["ring_left"] = ours()
    served.close()
    print(json.dumps(out))
    """
)


def test_a_segment_larger_than_dev_shm_is_refused_not_a_sigbus() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    shell = f'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c "$KVFERRY_SCRIPT"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        env=dict(env, KVFERRY_SCRIPT=SCRIPT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 / 135: SIGBUS
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["pool"].startswith("cannot reserve 33554432 bytes of shared memory in /dev/shm (4194304 of its "), out
    assert "--shm-size" in out["pool"] and "staging_bytes" in out["pool"], out
    assert out["pool_left"] == [] and out["small_fits"], out
    assert "cannot reserve 33554432 bytes of shared memory" in out["ring"], out
    assert out["ring_left"] == [], out
