"""A prefill and a decode vLLM server on one box, and the kvferry proxy in front: what the vLLM
tests and ``kvferry bench vllm`` share.

Nothing here reaches a model hub: :func:`build_tiny_llama` writes a small random Llama and a
byte-level BPE tokenizer trained in-process. :class:`Testbed` starts the servers as
subprocesses on free loopback ports, waits for their ``/health`` (bounded; the server's log is
in the error), starts the proxy, reads used KV blocks from ``/metrics`` for leak checks and tears
everything down, also on failure.

Run as ``python -m kvferry.vllm.testbed serve CORES -- API_SERVER_ARGS...`` it is the launcher of
one server: it pins the process to CORES and turns off vLLM's NIXL worker pin (which puts every
engine's compute thread on the last core of each NUMA node, so two engines on one box would
share one core), then runs vLLM's OpenAI server.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from kvferry.geometry import VLLM_TEST_MODEL, Geometry

# Token ids of a tiny model's prompts stay below this (random weights emit any id of the
# vocabulary, so prompts are token ids, not text).
VOCAB = VLLM_TEST_MODEL.vocab


@dataclass(frozen=True)
class RandomLlama:
    """The random test model written as a Hugging Face folder (fp32): its geometry and what a
    Hugging Face config adds. head_dim 32 or 64: the CPU attention kernel refuses 16."""

    geometry: Geometry = VLLM_TEST_MODEL
    max_positions: int = 8192
    # Wide enough that greedy decoding wanders over the vocabulary with clear top-1 margins
    # (the default 0.02 repeats one token, which would make output comparisons vacuous).
    init_range: float = 0.3

    def kv_bytes_per_token(self) -> int:
        return self.geometry.kv_bytes_per_token(4)  # fp32


def build_tiny_llama(root: Path, spec: RandomLlama = RandomLlama()) -> Path:
    """Writes (once per geometry: the folder name is a hash of it) a random LlamaForCausalLM and
    a PreTrainedTokenizerFast under ``root``; returns the model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(tmp: Path) -> None:
        g = spec.geometry
        _save_random(tmp, LlamaConfig, LlamaForCausalLM, g.seed, g.vocab, spec.max_positions, spec.init_range,
                     hidden_size=g.hidden, intermediate_size=g.ffn, num_hidden_layers=g.layers,
                     num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim)  # fmt: skip

    return _build_once(Path(root), "tiny-llama", asdict(spec), build)


def _save_random(
    tmp: Path,
    config_cls: Any,
    model_cls: Any,
    seed: int,
    vocab: int,
    max_positions: int,
    init_range: float,
    **fields: Any,
) -> None:
    """A random fp32 model of ``model_cls`` (its ``config_cls`` with ``fields`` and what every
    testbed model shares: token ids 1 and 2 for bos and eos, untied embeddings) and the
    testbed's tokenizer, saved in ``tmp``."""
    import torch

    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=init_range,
        torch_dtype="float32",
        **fields,
    )
    model_cls(config).to(torch.float32).save_pretrained(tmp, safe_serialization=True)
    _save_tokenizer(tmp, vocab)


@dataclass(frozen=True)
class RandomDeepseekV2:
    """A random DeepSeek-V2 (MLA) model, fp32: vLLM caches one latent head per token and layer,
    ``kv_lora_rank + qk_rope_head_dim`` wide. vLLM 0.32's CPU MLA backend (CPU_MLA) runs only
    576 = 512 + 64 (its decode kernel) with 16-token blocks; the rest is small. Dense MLPs
    (``first_k_dense_replace`` = every layer): no MoE to build. 4 attention heads: tensor
    parallelism of 2 or 4 splits them (MLA's latent head is whole on every rank)."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    ffn: int = 512
    vocab: int = VOCAB
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_positions: int = 4096
    init_range: float = 0.3  # as RandomLlama's: greedy output that wanders
    seed: int = 0

    def kv_bytes_per_token(self) -> int:
        return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * 4  # one latent head, fp32


def build_tiny_deepseek_v2(root: Path, spec: RandomDeepseekV2 = RandomDeepseekV2()) -> Path:
    """Writes (once per spec) a random DeepseekV2ForCausalLM (vLLM maps that architecture to
    its MLA model) and the same tokenizer as `build_tiny_llama` under ``root``; returns the
    model folder."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    def build(tmp: Path) -> None:
        _save_random(
            tmp,
            DeepseekV2Config,
            DeepseekV2ForCausalLM,
            spec.seed,
            spec.vocab,
            spec.max_positions,
            spec.init_range,
            hidden_size=spec.hidden,
            intermediate_size=spec.ffn,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads,
            kv_lora_rank=spec.kv_lora_rank,
            q_lora_rank=None,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
            first_k_dense_replace=spec.layers,
            n_routed_experts=1,
            num_experts_per_tok=1,
            n_shared_experts=1,
            moe_intermediate_size=spec.ffn,
        )

    return _build_once(Path(root), "tiny-deepseek-v2", asdict(spec), build)


def _build_once(root: Path, name: str, spec: dict[str, Any], build: Any) -> Path:
    """``root/<name>-<hash of spec>``, built by ``build(tmp)`` in a temporary folder and renamed
    into place once complete (a concurrent builder's finished copy wins)."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = root / f"{name}-{key}"
    if (path / "done").exists():
        return path
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    build(tmp)
    if path.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp)
        return path
    (tmp / "done").write_text(key)
    tmp.rename(path)
    return path


def _save_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer trained in-process, saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"turn {i}: the agent reads tool output {i * 7} and answers the user." for i in range(2000)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # A chat template lets /v1/chat/completions run; the model is random, so any will do.
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(folder)


@dataclass
class Answer:
    """One completion as the client saw it."""

    token_ids: list[int]
    text: str
    ttft_s: float  # request sent to first token (streaming) or to the whole answer
    total_s: float
    status: int
    body: Any  # the JSON answer, or the list of SSE events of a stream
    finish_reason: Optional[str] = None
    timing: dict[str, float] = field(default_factory=dict)  # the proxy's Server-Timing, ms


def _server_timing(header: Optional[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";dur=")
        with contextlib.suppress(ValueError):
            out[name] = float(rest)
    return out


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


def call(
    base: str, path: str, body: dict[str, Any], headers: Optional[dict[str, str]] = None, timeout_s: float = 600.0
) -> Answer:
    """POSTs an OpenAI request (``body["stream"]`` picks the mode) with ``return_token_ids``
    on; a non-200 answer comes back with its status and JSON body, not raised."""
    body = dict(body, return_token_ids=True)
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    t0 = time.perf_counter()
    try:
        r = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as err:
        raw = err.read().decode(errors="replace")
        with contextlib.suppress(ValueError):
            raw = json.loads(raw)
        return Answer([], "", 0.0, time.perf_counter() - t0, err.code, raw)
    with r:
        if not body.get("stream"):
            answer = json.loads(r.read())
            t = time.perf_counter() - t0
            choice = answer["choices"][0]
            timing = _server_timing(r.headers.get("Server-Timing"))
            return Answer(
                list(choice.get("token_ids") or []),
                _choice_text(choice),
                t,
                t,
                r.status,
                answer,
                choice.get("finish_reason"),
                timing,
            )
        ids: list[int] = []
        text, events, ttft, finish = "", [], 0.0, None
        for event in sse_events(r):
            events.append(event)
            for choice in event.get("choices") or ():
                got = list(choice.get("token_ids") or [])
                if got and not ids:
                    ttft = time.perf_counter() - t0
                ids += got
                text += _choice_text(choice)
                finish = choice.get("finish_reason") or finish
        return Answer(
            ids,
            text,
            ttft,
            time.perf_counter() - t0,
            r.status,
            events,
            finish,
            _server_timing(r.headers.get("Server-Timing")),
        )


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI server's stream (server-sent events), up to its ``[DONE]``,
    each as soon as its line arrives."""
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags every server of a run shares (docs/vllm.md explains each)."""

    block_size: int = 32
    kv_cache_memory_bytes: int = 64 << 20
    max_num_batched_tokens: int = 256
    max_model_len: int = 8192
    max_num_seqs: int = 8
    prefix_caching: bool = True
    # False: vLLM admits a request once its first chunk fits, not its whole prompt, so chunked
    # prefills outgrow a small pool and get preempted (the stress bench forces that).
    reserve_full_prompt: bool = True
    # > 0: a prompt longer than this gets at most this many tokens per step, so several
    # prefills advance (and grow) together in one step's budget.
    long_prefill_tokens: int = 0
    # > 1: vLLM's CPU tensor parallelism, one worker process per rank (start_server binds each
    # rank's threads to a core of its own where the server has that many).
    tensor_parallel_size: int = 1

    def args(self) -> list[str]:
        out = [
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--block-size", str(self.block_size),
            "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-chunked-prefill",
        ]  # fmt: skip
        out.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if not self.reserve_full_prompt:
            out.append("--no-scheduler-reserve-full-isl")
        if self.long_prefill_tokens:
            out += ["--long-prefill-token-threshold", str(self.long_prefill_tokens)]
        if self.tensor_parallel_size > 1:
            out += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return out


# vLLM's tensor-parallel workers read each step from a shared-memory queue and, for a second
# after every read, wait for the next one by spinning on sched_yield (shm_broadcast's
# SpinCondition). An engine steps on while a transfer waits, so its workers spin all the time;
# on a 2-core machine with a second server beside them, that starved every other process of
# the machine: a shell loop printing the time each second went 54 to 182 s without running,
# vmstat's 2 s samples came 9 to 53 s apart with 54 to 68 threads runnable, and kvferry's
# handshakes (which wait 120 s for a connected peer) timed out on both servers. The servers a
# test starts with tensor parallelism therefore wait on the queue's notification socket from
# the first idle moment (busy_loop_s 0): the same queue, the same messages, no spinning.
# Every process of the server (API server, engine core, workers) imports this module at
# start-up, before vLLM is imported.
_QUIET_WORKERS = """\
try:
    from vllm.distributed.device_communicators import shm_broadcast as _queue
except ImportError:
    pass
else:
    _made = _queue.SpinCondition.__init__

    def _no_spin(self, is_reader, context, notify_address, busy_loop_s=1):
        _made(self, is_reader, context, notify_address, busy_loop_s=0)

    _queue.SpinCondition.__init__ = _no_spin
"""


def _quiet_workers_site(where: Path) -> Path:
    """A directory whose ``sitecustomize`` makes vLLM's TP workers wait without spinning
    (`_QUIET_WORKERS`), for a server's PYTHONPATH."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(_QUIET_WORKERS)
    return where


def nixl_config(role: str, lease_s: int = 600, connector: str = "NixlConnector") -> dict[str, Any]:
    """vLLM's own NIXL connectors on CPU: ``NixlConnector`` (pull: the decode server READs) or
    ``NixlPushConnector`` (the prefill server WRITEs; vLLM 0.32), configured alike: host
    buffers, roles producer (prefill) / consumer (decode); a long KV lease since CPU prefill of
    long prompts outlasts the 30 s default. The proxy's ``nixl`` flow serves both."""
    return {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": lease_s},
    }


def kvferry_config(role: str, **extra: Any) -> dict[str, Any]:
    """kvferry's KvferryConnector (docs/vllm.md); ``extra`` goes to kv_connector_extra_config
    (early, layer_groups, ...)."""
    config: dict[str, Any] = {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": role,
    }
    if extra:
        config["kv_connector_extra_config"] = dict(extra)
    return config


# Per connector (the proxy's --connector name): the prefill and decode servers' configs.
CONNECTORS = {
    "nixl": (nixl_config("kv_producer"), nixl_config("kv_consumer")),
    "kvferry": (kvferry_config("kv_producer"), kvferry_config("kv_consumer")),
}


class ServerError(RuntimeError):
    """A server did not come up (its log tail is in the message) or answered out of contract."""


@dataclass
class Server:
    """One vLLM OpenAI server subprocess."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    side_channel_port: int

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"(log unreadable: {err})"

    def pause(self) -> None:
        """Stops every process of the server (SIGSTOP to its process group): an idle NIXL
        engine's progress thread spins (about half a core each, measured), so a bench that
        keeps several servers up pauses those whose turn it is not."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL to every process of the server (its API server and engine core): a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        _stop_group(self.proc, resume=True)  # a paused server must run to end

    def metrics(self, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout_s) as r:
            return str(r.read().decode())

    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV blocks, from vllm:kv_cache_usage_perc and cache_config_info. Blocks
        that only hold prefix-cache entries count as free, as in vLLM's block pool."""
        text = self.metrics()
        usage = _gauge(text, "vllm:kv_cache_usage_perc")
        m = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
        if usage is None or m is None:
            raise ServerError(f"{self.name}: /metrics has no kv_cache_usage_perc or num_gpu_blocks")
        total = int(m.group(1))
        return round(usage * total), total


def _stop_group(proc: subprocess.Popen[bytes], resume: bool = False) -> None:
    """SIGTERM to a process group started with its own session, SIGKILL 20 s later."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if resume:
            os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _gauge(text: str, name: str) -> Optional[float]:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a test run
    killed before its teardown must not leave engines behind). Linux only; elsewhere a no-op."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def start_server(
    name: str,
    model: Path,
    workdir: Path,
    *,
    kv_transfer_config: Optional[dict[str, Any]] = None,
    engine: EngineSettings = EngineSettings(),
    cores: Sequence[int] = (),
    transfer_cores: Sequence[int] = (),
    env: Optional[dict[str, str]] = None,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    netns: Optional[str] = None,
    port: Optional[int] = None,
    kvferry_log: bool = False,
) -> Server:
    """Starts ``python -m kvferry.vllm.testbed serve`` (vLLM's OpenAI server) on a free port of
    ``host`` (loopback by default; NIXL's side channel listens there too); returns at once
    (call :func:`wait_ready`). ``netns``: run it inside that network namespace (``ip netns
    exec``, root), standing for another host; ``host`` is then its address there.
    ``cores``: the CPUs the server computes on; ``transfer_cores``: where its transfer threads
    run instead (kvferry's, `kvferry.affinity`, and every NIXL agent's, vLLM's NixlConnector's
    included), so that every connector's transfer work is placed alike. ``port``: the HTTP
    port (a free one by default), for a config that names it (``http_address``).
    ``kvferry_log``: kvferry's INFO and DEBUG lines go to the server's log too (timestamped,
    with their process and thread), not only its warnings: what a failed test's log tail needs."""
    port, side = port or free_port(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    args = [
        python, "-m", "kvferry.vllm.testbed", "serve", ",".join(map(str, cores)) or "-",
        ",".join(map(str, transfer_cores)) or "-", "--",
        "--model", str(model), "--served-model-name", "tiny", "--host", host, "--port", str(port),
        *engine.args(),
    ]  # fmt: skip
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    full_env = dict(os.environ)
    full_env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # scheduler and worker in one process: up in seconds
        VLLM_NIXL_SIDE_CHANNEL_HOST=host,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # the launcher pins the whole process instead
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
        OMP_NUM_THREADS=str(max(1, len(cores))),
    )
    ranks = engine.tensor_parallel_size
    if ranks > 1:  # one core per rank, the machine's cores in turn
        every = _cores()
        full_env.update(
            VLLM_CPU_OMP_THREADS_BIND="|".join(str(every[r % len(every)]) for r in range(ranks)),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(
                [str(_quiet_workers_site(workdir / f"{name}-site")), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
    if kvferry_log:
        full_env["VLLM_LOGGING_CONFIG_PATH"] = str(_logging_config(workdir / f"{name}-logging.json"))
    full_env.update(env or {})
    log = open(log_path, "wb")
    try:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        log.close()
    return Server(name, f"http://{url_host(host)}:{port}", proc, log_path, side)


def _logging_config(path: Path) -> Path:
    """vLLM's own logging config (every process of a server reads it: the API server, the
    engine core, each worker) plus the ``kvferry`` logger at DEBUG, written to ``path``."""
    import copy

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["formatters"]["kvferry"] = {
        "format": "(%(processName)s pid=%(process)d %(threadName)s) %(levelname)s %(asctime)s.%(msecs)03d %(message)s",
        "datefmt": "%m-%d %H:%M:%S",
    }
    config["handlers"]["kvferry"] = dict(config["handlers"]["vllm"], formatter="kvferry", level="DEBUG")
    config["loggers"]["kvferry"] = {"handlers": ["kvferry"], "level": "DEBUG", "propagate": False}
    # vLLM hands this config to uvicorn too: its access lines (when each answer went) stay.
    for name in ("uvicorn", "uvicorn.access", "uvicorn.error"):
        config["loggers"][name] = {"handlers": ["vllm"], "level": "INFO", "propagate": False}
    path.write_text(json.dumps(config))
    return path


def url_host(host: str) -> str:
    """``host`` as it stands in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def wait_ready(servers: Sequence[Server], timeout_s: float = 240.0) -> None:
    """Polls each server's /health until it answers 200; a server that exits or stays down past
    ``timeout_s`` raises ServerError with its log tail."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            code = s.proc.poll()
            if code is not None:
                raise ServerError(
                    f"{s.name} exited with status {code} before it was ready; log {s.log_path}:\n{s.log_tail()}"
                )
            try:
                with urllib.request.urlopen(s.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(s)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            s = pending[0]
            raise ServerError(f"{s.name} not ready after {timeout_s:.0f} s; log {s.log_path}:\n{s.log_tail()}")
        if pending:
            time.sleep(0.25)  # polling interval of a readiness probe, not synchronisation of a test


@dataclass
class Testbed:
    """A prefill and a decode server (one or more each) with the given kv-transfer-configs, and
    optionally the proxy. Use as a context manager; :meth:`close` stops everything."""

    __test__ = False  # not a pytest test class despite the name

    model: Path
    workdir: Path
    prefill_config: Optional[dict[str, Any]]
    decode_config: Optional[dict[str, Any]]
    prefill_count: int = 1
    decode_count: int = 1
    engine: EngineSettings = field(default_factory=EngineSettings)
    proxy_connector: Optional[str] = "nixl"
    env: dict[str, str] = field(default_factory=dict)
    # Where the servers run: by default all on this host's loopback. Across two hosts: the
    # prefill servers on ``prefill_host`` here, the decode servers in network namespace
    # ``decode_netns`` on ``decode_host`` (the proxy runs here and reaches both).
    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    decode_netns: Optional[str] = None
    decode_engine: Optional[EngineSettings] = None  # the decode servers' own settings (default: engine)
    prefills: list[Server] = field(default_factory=list)
    decodes: list[Server] = field(default_factory=list)
    proxy: Optional[Any] = None

    def __enter__(self) -> Testbed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cores = _cores()
        n = self.prefill_count + self.decode_count
        # One core each where the box has them; otherwise they share what there is.
        assign = [[cores[i % len(cores)]] if len(cores) >= n else cores for i in range(n)]
        for i in range(self.prefill_count):
            self.prefills.append(
                start_server(f"prefill{i}", self.model, self.workdir, kv_transfer_config=self.prefill_config,
                             engine=self.engine, cores=assign[i], env=self.env, host=self.prefill_host)
            )  # fmt: skip
        for i in range(self.decode_count):
            self.decodes.append(
                start_server(f"decode{i}", self.model, self.workdir, kv_transfer_config=self.decode_config,
                             engine=self.decode_engine or self.engine, cores=assign[self.prefill_count + i],
                             env=self.env, host=self.decode_host, netns=self.decode_netns)
            )  # fmt: skip
        wait_ready(self.prefills + self.decodes)
        if self.proxy_connector is not None:
            from kvferry.vllm.proxy import ProxyThread

            self.proxy = ProxyThread(
                [s.url for s in self.prefills], [s.url for s in self.decodes], connector=self.proxy_connector
            )
            self.proxy.start()

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        if self.proxy is None:
            raise ServerError("this testbed runs no proxy")
        return str(self.proxy.url)

    def servers(self) -> list[Server]:
        return self.prefills + self.decodes

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        for s in self.servers():
            s.stop()


# vllm-router's P/D modes (``--kv-connector``) a run can put in front of the servers.
ROUTER_MODES = ("nixl", "mooncake", "moriio")


@dataclass
class Router:
    """vllm-router (the vllm-project router, PyPI ``vllm-router``) in P/D mode, a subprocess."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"(log unreadable: {err})"

    def stop(self) -> None:
        _stop_group(self.proc)


def router_binary() -> Optional[str]:
    """The ``vllm-router`` script beside this Python (``make setup-vllm`` installs it), or on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    if here.exists():
        return str(here)
    import shutil

    return shutil.which("vllm-router")


def start_router(
    prefills: Sequence[str],
    decodes: Sequence[str],
    workdir: Path,
    mode: str = "nixl",
    timeout_s: float = 120.0,
    quiet: bool = False,
    discovery: Optional[str] = None,
) -> Router:
    """Starts vllm-router ``--vllm-pd-disaggregation`` in front of the servers' URLs on a free
    loopback port, with ``--kv-connector mode``, and waits until it answers /health.
    ``quiet``: no circuit breaker and no failed health verdicts (a bench pauses the servers
    whose turn it is not). ``discovery`` (host:port; ``prefills`` and ``decodes`` empty): the
    servers register there instead (``--vllm-discovery-address``, the moriio mode's way)."""
    if mode not in ROUTER_MODES:
        raise ValueError(f"invalid mode={mode!r}: vllm-router's --kv-connector takes {', '.join(ROUTER_MODES)}")
    binary = router_binary()
    if binary is None:
        raise ServerError("vllm-router is not installed (make setup-vllm installs it into .venv-vllm)")
    port = free_port()
    args = [binary, "--vllm-pd-disaggregation", "--kv-connector", mode, "--policy", "round_robin"]
    for url in prefills:
        args += ["--prefill", url]
    for url in decodes:
        args += ["--decode", url]
    if discovery is not None:
        args += ["--vllm-discovery-address", discovery]
    args += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    args += ["--worker-startup-timeout-secs", "600", "--disable-retries"]
    if quiet:
        args += ["--disable-circuit-breaker", "--health-failure-threshold", "1000000000"]
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "vllm-router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
    router = Router(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"vllm-router exited with status {proc.returncode}; log {log_path}:\n{router.log_tail()}")
        try:
            with urllib.request.urlopen(router.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return router
        except urllib.error.HTTPError:
            if discovery is not None:
                return router  # it answers: unhealthy until servers register, which is the caller's to wait for
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            router.stop()
            raise ServerError(f"vllm-router not ready after {timeout_s:.0f} s; log {log_path}:\n{router.log_tail()}")
        time.sleep(0.25)  # polling interval of a readiness probe, not synchronisation of a test


@contextlib.contextmanager
def single_server(model: Path, workdir: Path, engine: EngineSettings = EngineSettings()) -> Iterator[Server]:
    """One plain server (no connector): the reference the disaggregated outputs must equal."""
    s = start_server("plain", model, workdir, engine=engine, cores=_cores()[:1])
    try:
        wait_ready([s])
        yield s
    finally:
        s.stop()


def _serve(argv: list[str]) -> None:
    cores_arg, transfer_arg, rest = argv[0], argv[1], argv[3:] if len(argv) > 2 and argv[2] == "--" else argv[2:]
    if cores_arg != "-":
        os.sched_setaffinity(0, [int(c) for c in cores_arg.split(",")])
    if transfer_arg != "-":
        _transfer_threads_on([int(c) for c in transfer_arg.split(",")])
    # vLLM's NIXL worker pins the calling thread to the last core of each NUMA node
    # (discover_numa_topology); with two engines on one box that is the same core for both.
    from vllm.platforms import cpu

    cpu.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])  # type: ignore[method-assign,assignment]
    import runpy

    sys.argv = ["vllm.entrypoints.openai.api_server", *rest]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def _transfer_threads_on(cores: list[int]) -> None:
    """kvferry's threads, and the threads of every NIXL agent this process makes (vLLM's
    NIXL connectors call ``nixl_agent`` too), start on ``cores``."""
    from kvferry import affinity

    affinity.set_transfer_cores(cores)
    try:
        import nixl._api as api
    except ImportError:
        return
    made = api.nixl_agent

    class _Placed(made):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with affinity.on_transfer_cores():  # the agent's progress thread inherits them
                super().__init__(*args, **kwargs)

    api.nixl_agent = _Placed


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: python -m kvferry.vllm.testbed serve CORES|- TRANSFER_CORES|- -- API_SERVER_ARGS...")
    _serve(sys.argv[2:])
