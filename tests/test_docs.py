"""The docs run as written. Every python block of README.md runs on its own (it has none now:
the library's walk-through is docs/integration.md); the python blocks of docs/integration.md
run in order, as one session (a walk-through: later blocks use the objects earlier ones made).
A line ``print(...)  # text`` must print ``text``. A console block's ``$ kvferry ...`` lines
print exactly the output shown under them. In README.md's bash blocks every ``make`` target
exists, every ``kvferry ...`` command parses with the CLI's parser, and every
``--kv-transfer-config`` is one KvferryConnector takes (docs/quickstart.md's blocks are
tests/test_quickstart.py's)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kvferry.cli import build_parser, main
from kvferry.vllm.config import ConnectorConfig

ROOT = Path(__file__).resolve().parent.parent


def blocks(doc: str, lang: str) -> list[tuple[int, str]]:
    """The ``lang`` fenced blocks of ``doc``: (line of the fence, text)."""
    text = (ROOT / doc).read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1))
        for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)
    ]


def expected_prints(code: str) -> list[str]:
    return [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]


def run_block(code: str, name: str, namespace: dict[str, Any]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), namespace)  # our own docs, not input from anywhere
    want = expected_prints(code)
    if want:
        assert out.getvalue().splitlines() == want, name


README_PYTHON = blocks("README.md", "python")
README_BASH = blocks("README.md", "bash")


def test_the_docs_have_the_blocks_these_tests_run() -> None:
    assert len(README_PYTHON) == 0 and len(blocks("docs/integration.md", "python")) >= 10
    assert len(blocks("README.md", "console")) == 1 and len(README_BASH) == 3


def test_readme_python_blocks_run_on_their_own() -> None:
    for line, code in README_PYTHON:
        run_block(code, f"README.md:{line}", {"__name__": "__readme__"})


def test_integration_walkthrough_runs_in_order() -> None:
    namespace: dict[str, Any] = {"__name__": "__integration__"}
    try:
        for line, code in blocks("docs/integration.md", "python"):
            run_block(code, f"docs/integration.md:{line}", namespace)
        assert len(namespace["receiver"]) == 0  # every request it expected was released
    finally:
        # The walk-through's shared segment: unmapped once no tensor views it any more.
        shared = namespace.get("shared")
        namespace.clear()
        gc.collect()
        if shared is not None:
            shared.close()


@pytest.mark.parametrize("doc", ["README.md", "docs/integration.md"])
def test_console_blocks_show_the_cli_s_real_output(doc: str, capsys: pytest.CaptureFixture[str]) -> None:
    for line, text in blocks(doc, "console"):
        commands = re.split(r"^\$ ", text, flags=re.M)[1:]
        assert commands, f"{doc}:{line}: a console block without a command"
        for command in commands:
            argv, _, shown = command.partition("\n")
            words = shlex.split(argv)
            assert words[0] == "kvferry", f"{doc}:{line}: {argv}"
            assert main(words[1:]) == 0
            assert capsys.readouterr().out == shown, f"{doc}:{line}: {argv}"


def bash_commands(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and a trailing ``&`` dropped."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line.removesuffix("&").strip())
    return out


def test_make_targets_named_in_bash_blocks_exist() -> None:
    targets = [
        target
        for _, text in README_BASH
        for command in bash_commands(text)
        if command.startswith("make ")
        for target in command.split()[1:]
    ]
    assert targets == ["wheel", "demo", "test", "test-vllm"]
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_kvferry_commands_in_bash_blocks_parse() -> None:
    named = []
    for line, text in README_BASH:
        for command in bash_commands(text):
            words = shlex.split(command)
            if words[0] == "kvferry":
                assert build_parser().parse_args(words[1:]).func, f"README.md:{line}: {command}"
                named.append(words[1])
    assert named == ["doctor", "proxy"]


def test_kv_transfer_configs_in_bash_blocks_are_ones_the_connector_takes() -> None:
    configs = [json.loads(m) for _, text in README_BASH for m in re.findall(r"--kv-transfer-config '([^']*)'", text)]
    assert [c["kv_role"] for c in configs] == ["kv_producer", "kv_consumer"]
    for config in configs:
        assert (config["kv_connector"], config["kv_connector_module_path"]) == ("KvferryConnector", "kvferry.vllm")
        ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))


def _moriio_commands() -> list[list[str]]:
    """The commands of docs/routers.md's moriio-mode block, split into words."""
    (text,) = [text for _, text in blocks("docs/routers.md", "") if "--kv-connector moriio" in text]
    return [shlex.split(command) for command in bash_commands(text)]


def test_routers_doc_moriio_servers_register_where_the_router_listens() -> None:
    """The servers' configs are ones KvferryConnector takes, each registers at the router's
    --vllm-discovery-address and names its own --port as http_address."""
    router, *servers = _moriio_commands()
    discovery = router[router.index("--vllm-discovery-address") + 1]
    assert [words[words.index("--port") + 1] for words in servers] == ["8100", "8200"]
    for words in servers:
        config = json.loads(words[words.index("--kv-transfer-config") + 1])
        extra = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
        assert (extra.router_discovery, extra.http_address) == (
            discovery,
            f"127.0.0.1:{words[words.index('--port') + 1]}",
        )
    assert [json.loads(w[w.index("--kv-transfer-config") + 1])["kv_role"] for w in servers] == [
        "kv_producer",
        "kv_consumer",
    ]


def test_routers_doc_moriio_router_command_parses() -> None:
    launch = pytest.importorskip("vllm_router.launch_router", reason="vllm-router is installed with make setup-vllm")
    router = _moriio_commands()[0]
    assert router[0] == "vllm-router"
    args = launch.parse_router_args(router[1:])
    assert (args.kv_connector, args.vllm_discovery_address) == ("moriio", "127.0.0.1:30001")
