"""Figures of the control plane under attack (docs/security.md, docs/benchmarks.md):

- connect: a staging sender's connect (handshake + hello + ring mapped) to an endpoint with
  a free ring (the baseline), against one whose 16 rings are all held by silent senders, so
  the newcomer first reclaims the one silent longest (``idle_reclaim_s=0``): the time to
  reclaim an idle slot is the difference;
- flood: the same baseline connect while 1,000 connections sit in their handshake, and the
  endpoint's threads and descriptors then (the bound holds them to 64).

    .venv/bin/python benches/python/security.py

Medians of 7 repeats; the endpoint and senders in this process (CPU pools)."""

from __future__ import annotations

import logging
import os
import resource
import secrets
import socket
import statistics
import threading
import time

import torch
from kvferry.layout import PagedKV
from kvferry.receiver import KVReceiver
from kvferry.transports.staging import StagingEndpoint, StagingTransport

REPEATS = 7
SENDERS = 16
FLOOD = 1000


def _pool() -> PagedKV:
    return PagedKV(tuple(torch.zeros(64, 2, 16, 64) for _ in range(4)), 16)


def _connect_ms(address: str, key: bytes) -> tuple[float, StagingTransport]:
    t0 = time.perf_counter()
    transport = StagingTransport(address, authkey=key)
    return (time.perf_counter() - t0) * 1e3, transport


def connect_figures() -> tuple[float, float]:
    free, reclaim = [], []
    for _ in range(REPEATS):
        key = secrets.token_bytes(32)
        receiver = KVReceiver(_pool())
        endpoint = StagingEndpoint(receiver, authkey=key, capacity_blocks=8, max_senders=SENDERS, idle_reclaim_s=0)
        try:
            held = []
            for i in range(SENDERS):
                ms, t = _connect_ms(endpoint.address, key)
                held.append(t)
                if i == SENDERS - 1:  # the last free ring (warm: the first connect pays for imports)
                    free.append(ms)
            ms, t = _connect_ms(endpoint.address, key)  # every ring taken: reclaims the oldest
            assert endpoint.reclaimed_count == 1
            reclaim.append(ms)
            for t2 in held + [t]:
                t2.close()
        finally:
            endpoint.close()
    return statistics.median(free), statistics.median(reclaim)


def flood_figures() -> tuple[float, float, int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * FLOOD)), hard))
    key = secrets.token_bytes(32)
    endpoint = StagingEndpoint(KVReceiver(_pool()), authkey=key, capacity_blocks=8)
    threads0, fds0 = threading.active_count(), len(os.listdir("/proc/self/fd"))
    held = []
    try:
        before = []
        for _ in range(REPEATS):  # the baseline: this endpoint, no flood
            ms, t = _connect_ms(endpoint.address, key)
            before.append(ms)
            t.close()
        path = endpoint.address[len("unix://") :]
        for _ in range(FLOOD):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            held.append(s)
        while endpoint._admission.evicted < FLOOD - 64:  # noqa: SLF001  (every one accepted)
            time.sleep(0.01)
        threads = threading.active_count() - threads0
        server_fds = len(os.listdir("/proc/self/fd")) - fds0 - FLOOD  # the clients' own are ours
        times = []
        for _ in range(REPEATS):
            ms, t = _connect_ms(endpoint.address, key)
            times.append(ms)
            t.close()
        return statistics.median(before), statistics.median(times), threads, server_fds
    finally:
        for s in held:
            s.close()
        endpoint.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def main() -> None:
    logging.getLogger("kvferry").setLevel(logging.ERROR)  # the flood's refusals are expected
    free, reclaim = connect_figures()
    print(f"connect, a free ring:          {free:8.2f} ms (median of {REPEATS})")
    print(
        f"connect, reclaiming an idle one: {reclaim:6.2f} ms  ratio {reclaim / free:.2f}"
        f"  (time to reclaim ~ {reclaim - free:.2f} ms)"
    )
    calm, flooded, threads, fds = flood_figures()
    print(f"connect, no flood (same endpoint): {calm:5.2f} ms")
    print(
        f"connect, {FLOOD} handshakes held: {flooded:7.2f} ms  ratio {flooded / calm:.2f};"
        f" endpoint threads +{threads}, descriptors +{fds}"
    )


if __name__ == "__main__":
    main()
