"""docs/quickstart.md runs as written.

Without vLLM: every ``kvferry ...`` command of its bash blocks parses with the CLI's own
parser; every ``--kv-transfer-config`` is one KvferryConnector takes (its
``kv_connector_extra_config`` through the connector's own config check); the CPU blocks are the
GPU commands plus vLLM's CPU flags and the trace files (the same servers, proxy and request), and
the A/B block is the same in both.

With vLLM (``.venv-vllm``; skipped elsewhere): the CPU blocks (tagged ``test:servers``,
``test:turns``, ``test:verify``, ``test:ab``) run in bash, one after another in one folder,
against the testbed's tiny random Llama. The test replaces only the model name ``M`` (by the
model's folder) and the ports (by free ones), and puts a ``kvferry`` command on PATH (this
venv runs kvferry from the tree, with no console script). Then: the servers and the proxy come
up; both turns are answered; the prefill server counted two transfers and blocks the decode
server held, the decode server counted prompt tokens that came through the connector;
``kvferry doctor`` exits 0; ``kvferry trace`` shows both transfers arriving and draws the
timeline; ``kvferry proxy --connector nixl`` in front of the same KvferryConnector servers gives
the first turn's answer token for token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from kvferry.cli import build_parser
from kvferry.vllm.config import ConnectorConfig

sys.path.insert(0, os.path.dirname(__file__))
from helpers import metric_total  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "quickstart.md"
TAGS = ("servers", "turns", "verify", "ab")
PORTS = ("8000", "8001", "8100", "8200")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def bash_blocks() -> list[tuple[str, str]]:
    """Every bash block of the page: (its tag, or "" for an untagged one; its text)."""
    text = DOC.read_text()
    return [
        (m.group(1) or "", m.group(2)) for m in re.finditer(r"^```bash(?: test:(\w+))?\n(.*?)^```$", text, re.M | re.S)
    ]


def tagged(tag: str) -> str:
    found = [text for name, text in bash_blocks() if name == tag]
    assert len(found) == 1, f"docs/quickstart.md has {len(found)} blocks tagged test:{tag}"
    return found[0]


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and a trailing ``&`` dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line[:-1].strip() if line.endswith("&") else line)
    return out


def gpu_block(marker: str) -> str:
    """The untagged block holding ``marker`` (the GPU section's)."""
    found = [text for name, text in bash_blocks() if not name and marker in text]
    assert len(found) == 1, marker
    return found[0]


def test_the_page_has_the_blocks_the_run_needs() -> None:
    tags = [name for name, _ in bash_blocks() if name]
    assert sorted(tags) == sorted(TAGS)
    assert len(bash_blocks()) >= 10  # the GPU section's blocks besides


def test_every_kvferry_command_parses() -> None:
    seen = set()
    for _, block in bash_blocks():
        for command in commands(block):
            words = shlex.split(command)
            if words[0] == "kvferry":
                args = build_parser().parse_args(words[1:])  # exits 2, naming the flag, on a bad one
                assert args.func, command
                seen.add(words[1])
    assert seen == {"proxy", "doctor", "trace"}


def test_every_kv_transfer_config_is_one_the_connector_takes() -> None:
    configs = [
        json.loads(m.group(1))
        for _, block in bash_blocks()
        for m in re.finditer(r"--kv-transfer-config '([^']*)'", block)
    ]
    assert len(configs) == 6
    for config in configs:
        assert config["kv_connector"] == "KvferryConnector"
        assert config["kv_connector_module_path"] == "kvferry.vllm"
        assert config["kv_role"] in ("kv_producer", "kv_consumer")
        ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))


def _as_on_gpu(command: str) -> str:
    """A CPU command as the GPU section writes it: without the CPU flags and the trace files."""
    command = command.replace(" $CPU", "")
    return re.sub(r',"kv_connector_extra_config":\{"trace":"\w+\.trace"\}', "", command)


def test_the_cpu_blocks_are_the_gpu_commands() -> None:
    one_host = commands(gpu_block("CUDA_VISIBLE_DEVICES=0"))
    cpu = [_as_on_gpu(c) for c in commands(tagged("servers")) + commands(tagged("turns"))]
    servers = [re.sub(r"^CUDA_VISIBLE_DEVICES=\d+ ", "", c) for c in one_host]
    # The GPU block: two servers, the proxy, the wait, the first turn; the CPU blocks add the
    # environment and the flags' variable before them and a second turn after.
    assert cpu[2 : 2 + len(servers)] == servers
    assert cpu[0].startswith("export ") and cpu[1].startswith("CPU=")
    assert gpu_block("--connector nixl") == tagged("ab")
    assert commands(gpu_block("curl -s localhost:8100/metrics")) == commands(tagged("verify"))[1:3]


# --- the CPU blocks, run -------------------------------------------------------------------


def _adapt(block: str, model: Path, ports: dict[str, int]) -> str:
    block = re.sub(r"(?<=--model )M\b", str(model), block)
    block = block.replace('"model":"M"', json.dumps({"model": str(model)})[1:-1])
    return re.sub(r"\b(%s)\b" % "|".join(PORTS), lambda m: str(ports[m.group(1)]), block)


class Shell:
    """Runs blocks in bash (``-e``: a failing command fails the block) in one folder; a block
    that leaves processes in the background runs in a session of its own, ended at close."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.groups: list[int] = []

    def run(self, block: str, name: str, timeout_s: float) -> str:
        """A block with nothing in the background: its output."""
        done = subprocess.run(
            ["bash", "-e", "-c", block], cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        assert done.returncode == 0, f"test:{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, block: str, name: str, timeout_s: float) -> str:
        """A block that starts processes in the background and returns once they serve: its
        output (a file, not a pipe: what stays in the background keeps writing to it)."""
        log = self.work / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "-e", "-c", block], cwd=self.work, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.groups.append(proc.pid)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"test:{name} did not finish within {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-6000:]}"
            )
        text = log.read_text(errors="replace")
        assert code == 0, f"test:{name} exited {code}:\n{text[-6000:]}"
        return text

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for group in self.groups:
            while _alive(group) and time.monotonic() < deadline:
                time.sleep(0.2)  # polling a process group's end: no event to wait on for non-children
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _answers(text: str) -> list[dict[str, Any]]:
    """The JSON objects curl printed one after another (no newline between them)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        i = text.find('{"id"', i)
        if i < 0:
            return out
        answer, i = decoder.raw_decode(text, i)
        out.append(answer)


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kvferry"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m kvferry.cli "$@"\n')
    shim.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    work = tmp_path / "work"
    work.mkdir()
    s = Shell(work, dict(os.environ, PATH=path))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this venv (make setup-vllm; make test-vllm runs it)")
def test_the_cpu_quickstart_serves_and_checks_out(shell: Shell, tmp_path: Path) -> None:
    from kvferry.vllm import testbed

    (tmp_path / "model").mkdir()
    model = testbed.build_tiny_llama(tmp_path / "model")
    ports = {p: testbed.free_port() for p in PORTS}

    def block(tag: str) -> str:
        return _adapt(tagged(tag), model, ports)

    shell.start(block("servers"), "servers", timeout_s=480)
    turns = _answers(shell.run(block("turns"), "turns", timeout_s=300))
    assert len(turns) == 2 and all(t["choices"][0]["text"] for t in turns), turns

    verify = shell.run(block("verify"), "verify", timeout_s=120)
    assert metric_total(verify, "vllm:kvferry_transfers_total") == 2, verify
    assert metric_total(verify, "vllm:kvferry_held_blocks_total") > 0, verify  # turn 2: turn 1's blocks stayed
    assert metric_total(verify, "vllm:kvferry_failures_total") == 0, verify
    assert metric_total(verify, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0, verify
    assert "session key" in verify, verify  # kvferry doctor's report (it exited 0)
    assert verify.count("decode   tail_landed   every block arrived") == 2, verify
    assert (shell.work / "kvferry-trace.png").stat().st_size > 0

    ab = _answers(shell.start(block("ab"), "ab", timeout_s=120))
    assert len(ab) == 1 and ab[0]["choices"][0]["text"] == turns[0]["choices"][0]["text"], (ab, turns)
