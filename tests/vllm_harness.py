"""Real vLLM engines for tests/test_vllm_connector.py: a tiny random Llama, and engines that
each run in their own process (vLLM keeps its KV connector in process-wide state), driven
through vLLM's Python API (LLMEngine) over a pipe.

Each engine process steps only while a command runs, so the test decides what happens
between steps: an abort lands at a named point of a request's life, never after a delay.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import urllib.error
import uuid
from typing import Any, Callable, Iterator, Optional

BLOCK = 32


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> None:
    """Waits for a condition the servers or engines report (a metric, a gauge, a log line):
    polls it, bounded; a timeout names the condition. A look that itself timed out (a busy
    server slow to answer /metrics) counts as "not yet": only ``timeout_s`` bounds the wait."""
    deadline = time.monotonic() + timeout_s
    last: Optional[BaseException] = None
    while True:
        try:
            if predicate():
                return
        except (TimeoutError, ConnectionError, urllib.error.URLError) as err:
            last = err
        if time.monotonic() > deadline:
            why = f" (the last look failed: {last!r})" if last is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{why}")
        time.sleep(0.2)  # the polling interval, not a synchronisation: the predicate decides


def hello_of(decode: Engine) -> dict[str, Any]:
    """A decode engine's ``hello`` answer (its rendezvous and their signature), as a prefill
    server's proxy asks it."""
    out = decode.run([(f"hello-{uuid.uuid4().hex[:6]}", [1], 1, {"kvferry": {"op": "hello"}})])["outputs"]
    (answer,) = out.values()
    return answer["kv_transfer_params"]["kvferry"]


def prompt_of(n: int, seed: int) -> list[int]:
    """``n`` random token ids of the tiny models' vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def build_tiny_llama(path: str) -> str:
    """The testbed's random fp32 Llama (4 layers, 2 KV heads of 32) and its tokenizer."""
    from pathlib import Path

    from kvferry.vllm import testbed

    return str(testbed.build_tiny_llama(Path(path)))


def build_tiny_deepseek_v2(path: str) -> str:
    """The testbed's random fp32 DeepSeek-V2 (MLA: one latent head of 576, 2 layers) and its
    tokenizer."""
    from pathlib import Path

    from kvferry.vllm import testbed

    return str(testbed.build_tiny_deepseek_v2(Path(path)))


def model_with_own_key_dir(tmp_path_factory: Any, build: Callable[[str], str] = build_tiny_llama) -> Iterator[str]:
    """A module fixture's body: builds the tiny model (``build``: the Llama unless given) and,
    while the module's tests run, points ``XDG_RUNTIME_DIR`` at a fresh 0700 directory, so
    that the engines (spawned: they inherit this environment) find the per-user default key
    file there with no setting (the first to start makes it, the others re-use it). Yields
    the model's folder."""
    runtime = tmp_path_factory.mktemp("runtime")
    os.chmod(runtime, 0o700)
    saved = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        yield build(str(tmp_path_factory.mktemp("tiny-model")))
    finally:
        if saved is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = saved


def _enter_netns(name: str) -> None:
    """Moves this (still single-threaded) process into network namespace ``name``
    (tests/netns.py made it): every thread it starts later is in it too."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)
    # As `ip netns exec` does: a mount namespace of its own with /sys remounted, so that
    # /sys/class/net (where UCX finds its devices) shows this namespace's interfaces.
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare of the mount namespace failed")
    if libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None) != 0:  # MS_SLAVE | MS_REC: nothing leaks out
        raise OSError(ctypes.get_errno(), "making / a slave mount failed")
    libc.umount2(b"/sys", 2)  # MNT_DETACH
    if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mounting /sys in the network namespace failed")


def _serve(
    conn: Any,
    model: str,
    kv_config: Optional[dict[str, Any]],
    engine_kw: dict[str, Any],
    netns: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
) -> None:
    if netns is not None:
        _enter_netns(netns)
    os.environ.update(env or {})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    kw = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
        seed=0,
    )
    kw.update(engine_kw)
    if kv_config is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**kv_config)
    engine = LLMEngine.from_engine_args(EngineArgs(**kw))
    core = engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    # vLLM's preemptions of this engine, counted where they happen (the in-process engine has
    # no /metrics): a test that needs them checks this count rather than hoping for them.
    preemptions = [0]
    preempt = sched._preempt_request

    def counted_preempt(*args: Any, **kwargs: Any) -> Any:
        preemptions[0] += 1
        return preempt(*args, **kwargs)

    sched._preempt_request = counted_preempt

    def internal(rid: str) -> Any:
        for req in sched.requests.values():
            # vLLM makes its internal id from the caller's: "<id>-<8 hex digits>".
            if req.request_id == rid or req.request_id.rsplit("-", 1)[0] == rid:
                return req
        return None

    def point(rid: str) -> Optional[str]:
        """Where request ``rid`` is: the named points aborts are forced at."""
        req = internal(rid)
        if req is None:
            return None
        side = sched.connector._sched if sched.connector is not None else None
        if side is not None and req.request_id in side._lookups:
            return "waiting_for_destination"
        status = req.status.name
        if status == "WAITING_FOR_REMOTE_KVS":
            return "waiting_for_blocks"
        if status == "RUNNING" and 0 < req.num_computed_tokens < req.num_prompt_tokens:
            return "mid_prefill"
        if status == "RUNNING" and req.num_output_tokens > 0:
            return "decoding"
        return status.lower()

    def run(
        requests: list[tuple], abort: Optional[tuple[str, str]], until: Optional[tuple[str, str]]
    ) -> dict[str, Any]:
        for rid, prompt, max_tokens, params, *more in requests:
            extra = {"kv_transfer_params": params} if params is not None else None
            sampling = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
            sampling.update(more[0] if more else {})  # e.g. {"n": 2, "temperature": 1.0, "seed": 3}
            if sampling.get("n", 1) > 1:  # one output holding every sample, once all finished
                sampling["output_kind"] = RequestOutputKind.FINAL_ONLY
            sp = SamplingParams(**sampling)
            engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
        outs: dict[str, Any] = {}
        while engine.has_unfinished_requests() or sched.has_requests():
            if until is not None and point(until[0]) == until[1]:
                return {"outputs": outs, "stopped_at": until}
            if abort is not None and point(abort[0]) == abort[1]:
                engine.abort_request([abort[0]])
                # vLLM emits no output for a request aborted by its caller: record it here.
                outs[abort[0]] = {"tokens": [], "finish_reason": "abort", "kv_transfer_params": None}
                abort = None
            for out in engine.step():
                if out.finished:
                    o = out.outputs[0]
                    outs[out.request_id] = {
                        "tokens": list(o.token_ids),
                        "finish_reason": o.finish_reason,
                        "kv_transfer_params": out.kv_transfer_params,
                        "samples": [(list(s.token_ids), s.finish_reason) for s in out.outputs],
                    }
        return {"outputs": outs}

    recorded: list[dict[str, Any]] = []
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "run":
                reply: Any = run(*arg)
            elif cmd == "usage":
                reply = {"used": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(), "requests": len(sched.requests)}
            elif cmd == "preemptions":
                reply = preemptions[0]
            elif cmd == "groups":  # vLLM's KV cache groups, and what the connector moves of them
                connector = get_kv_transfer_group() if has_kv_transfer_group() else None
                worker = None if connector is None else connector._worker
                reply = {
                    "hma_disabled": engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
                    "groups": [
                        (type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None))
                        for g in sched.kv_cache_config.kv_cache_groups
                    ],
                    "moved": None if worker is None else worker.groups.describe(),
                    "regions": None if worker is None or worker.pool is None else worker.pool.num_layers,
                    # One region's block as registered: its KV heads (MLA: one latent head) and bytes.
                    "heads": None if worker is None or worker.pool is None else worker.pool.num_heads,
                    "block_bytes": None if worker is None or worker.pool is None else worker.pool.block_bytes,
                    # A decode worker's receivers: (prefill size, prefill rank) of each that writes here.
                    "receivers": None
                    if connector is None or connector._decode is None
                    else sorted(connector._decode.receivers),
                }
            elif cmd == "config":  # what vLLM made of the engine arguments (its platform overrides some)
                config = engine.vllm_config
                layers = config.compilation_config.static_forward_context.values()
                reply = {
                    "use_mla": config.model_config.use_mla,
                    "block_size": config.cache_config.block_size,
                    "prefix_caching": config.cache_config.enable_prefix_caching,
                    "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                    # Empty under tensor parallelism: the layers live in the rank processes.
                    "backends": sorted(
                        {layer.attn_backend.get_name() for layer in layers if hasattr(layer, "attn_backend")}
                    ),
                }
            elif cmd == "kv":  # a live request's KV rows of tokens [0, n), per layer: [layers, n, H * C]
                rid, n = arg
                (ids,) = sched.kv_cache_manager.get_block_ids(internal(rid).request_id)  # one KV cache group
                rows = []
                for layer in engine.vllm_config.compilation_config.static_forward_context.values():
                    kv = getattr(layer, "kv_cache", None)
                    kv = kv[0] if isinstance(kv, list) else kv
                    if isinstance(kv, torch.Tensor) and kv.numel():
                        # The layer's own view: [B, H, N, C], or [B, N, C] (MLA's backends).
                        kv = kv.unsqueeze(1) if kv.dim() == 3 else kv
                        blocks = kv[torch.tensor(ids)].permute(0, 2, 1, 3)  # tokens in block order
                        rows.append(blocks.reshape(-1, blocks.shape[2] * blocks.shape[3])[:n].clone())
                reply = torch.stack(rows)
            elif cmd == "totals":
                connector = get_kv_transfer_group() if has_kv_transfer_group() else None
                worker = None if connector is None else connector._worker
                served = {} if connector is None or connector._decode is None else connector._decode.endpoints
                reply = (
                    {}
                    if worker is None
                    else {
                        "counts": dict(worker.tally.totals),
                        "observed": {k: list(v) for k, v in worker.tally.all_observed.items()},
                        "endpoints": sorted(served),
                        "endpoint_urls": sorted(s.url for s in served.values()),
                    }
                )
            elif cmd == "record":  # from now on, the worker half's calls as JSON-able data (`recorded`)
                record_worker_half(get_kv_transfer_group()._half, recorded)
                reply = True
            elif cmd == "recorded":
                reply = {"calls": list(recorded), "num_blocks": get_kv_transfer_group()._worker.num_blocks}
            elif cmd == "sched_totals":  # the scheduler half's counters (vllm:kvferry_unhonoured_total, ...)
                reply = dict(sched.connector._sched.tally.totals)
            elif cmd == "lookups_done":  # a prefill engine's destination lookups under way, each ended
                side = sched.connector._sched
                reply = all(found.done.wait(arg[0]) for found in list(side._lookups.values()))
            elif cmd == "stop":
                conn.send("bye")
                return
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as err:  # shown to the test, the engine keeps running
            import traceback

            reply = {"error": f"{err!r}\n{traceback.format_exc()}"}
        conn.send(reply)


def record_worker_half(half: Any, log: list[dict[str, Any]]) -> None:
    """Wraps a `WorkerHalf`'s ``bind`` and ``results`` so that each call with something in it
    is appended to ``log``: ``{"t", "call": "bind", "meta": <KvferryMetadata as a dict>}`` or
    ``{"t", "call": "results", "finished", "sending", "recving", "failed"}`` (sorted lists;
    ``t``: time.monotonic, one clock for every process of the machine). The worker replay test
    (tests/test_worker_replay.py) drives a `WorkerHalf` with such a log."""
    import dataclasses

    bind, results = half.bind, half.results

    def recorded_bind(meta: Any) -> None:
        data = dataclasses.asdict(meta)
        if any(data.values()):
            log.append({"t": time.monotonic(), "call": "bind", "meta": data})
        bind(meta)

    def recorded_results(finished: set[str]) -> Any:
        out = results(finished)
        if finished or any(out):
            names = ("sending", "recving", "failed")
            log.append({"t": time.monotonic(), "call": "results", "finished": sorted(finished),
                        **{k: sorted(v) for k, v in zip(names, out)}})  # fmt: skip
        return out

    half.bind, half.results = recorded_bind, recorded_results


class Engine:
    """One engine in its own process. `start` sends a command; `result` waits for its reply."""

    def __init__(
        self,
        model: str,
        role: Optional[str],
        extra: Optional[dict[str, Any]] = None,
        *,
        netns: Optional[str] = None,
        env: Optional[dict[str, str]] = None,
        policy: Optional[str] = None,
        **engine_kw: Any,
    ) -> None:
        """``netns``: run the engine inside that network namespace (tests/netns.py);
        ``env``: variables set in its process before vLLM loads; ``policy``: vLLM's
        ``kv_load_failure_policy`` ("fail" when not given)."""
        kv = None
        if role is not None:
            kv = {
                "kv_connector": "KvferryConnector",
                "kv_connector_module_path": "kvferry.vllm",
                "kv_role": role,
                "kv_connector_extra_config": extra or {},
            }
            if policy is not None:
                kv["kv_load_failure_policy"] = policy
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # A tensor- or pipeline-parallel engine starts one worker process per rank, which a
        # daemonic process may not: that one is not daemonic (`close` still ends it, bounded).
        daemon = engine_kw.get("tensor_parallel_size", 1) * engine_kw.get("pipeline_parallel_size", 1) == 1
        self.process = ctx.Process(target=_serve, args=(child, model, kv, engine_kw, netns, env), daemon=daemon)
        self.process.start()

    def start(self, cmd: str, *arg: Any) -> None:
        self.conn.send((cmd, arg))

    def result(self, timeout: float = 300.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine process {self.process.pid} did not answer within {timeout} s")
        reply = self.conn.recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def call(self, cmd: str, *arg: Any) -> Any:
        self.start(cmd, *arg)
        return self.result()

    def run(
        self, requests: list[tuple], abort: Optional[tuple[str, str]] = None, until: Optional[tuple[str, str]] = None
    ) -> dict[str, Any]:
        return self.call("run", requests, abort, until)

    def close(self) -> None:
        try:
            self.conn.send(("stop", ()))
            self.conn.poll(30)
        except OSError:
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
