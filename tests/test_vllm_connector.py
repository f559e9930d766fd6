"""KvferryConnector inside real vLLM engines (tests/vllm_harness.py): a prefill engine
(kv_producer) pushes into a decode engine (kv_consumer), each in its own process, and the
decode engine's greedy output must equal a plain engine's, token for token.

Run in the vLLM venv (docs/vllm.md, "Tests"):
    PYTHONPATH=python /work/venv-vllm/bin/python -m pytest tests/test_vllm_connector.py -q
Without vLLM the engine tests skip; the import test runs everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import socket
import subprocess
import sys
import uuid
from typing import Any, Optional

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM (and transformers) not importable: run in the vLLM venv, see docs/vllm.md"
)

sys.path.insert(0, os.path.dirname(__file__))
from vllm_harness import BLOCK, Engine, hello_of, model_with_own_key_dir, prompt_of, wait_until  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK * 2 * HEAD_DIM * 4  # one block over all layers, fp32
OUT = 6  # tokens decoded per turn


def _without_vllm(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "python"), *sys.path])
    )
    return subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['vllm'] = None; " + code],
        capture_output=True,
        text=True,
        env=env,
    )


def test_the_connector_without_vllm_names_the_extra() -> None:
    for code in ("from kvferry.vllm import KvferryConnector", "import kvferry.vllm; kvferry.vllm.register()"):
        run = _without_vllm(code)
        assert run.returncode != 0
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: kvferry.vllm needs vLLM: pip install 'kvferry[vllm]'"), run.stderr


def test_the_workers_data_path_imports_without_vllm() -> None:
    """The prefill and decode workers, the scheduler half's logic and the rendezvous import
    where vLLM cannot (the GPU machine's tests drive them there); their metadata classes then
    stand on plain bases."""
    code = (
        "import kvferry.vllm.prefill_worker, kvferry.vllm.decode_worker, kvferry.vllm.scheduler, "
        "kvferry.vllm.rendezvous; from kvferry.vllm.metadata import KvferryMetadata; "
        "assert 'vllm' not in {c.__module__.split('.')[0] for c in KvferryMetadata.__mro__}; print('ok')"
    )
    run = _without_vllm(code)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# -- engines -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not HAVE_VLLM:
        pytest.skip("vLLM not importable")
    yield from model_with_own_key_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def engines(model: str) -> Any:
    # A small token budget forces chunked prefill on the prefill engine. ``admission_wait_s``
    # well above the default 1 s: every test here sends the decode half first, and expects the
    # prefill request to start only with its destination in hand (a mismatched prompt then
    # fails both halves before any compute); under load a decode step can take over 1 s, and
    # the prefill request would compute first (the admission path, tested in test_vllm_serving).
    prefill = Engine(
        model,
        "kv_producer",
        {"transfer_timeout_s": 60.0, "destination_timeout_s": 60.0, "admission_wait_s": 30.0},
        max_num_batched_tokens=64,
    )
    decode = Engine(model, "kv_consumer", {"transfer_timeout_s": 60.0})
    plain = Engine(model, None)
    try:
        hello = hello_of(decode)
        assert (
            hello["role"] == "kv_consumer"
            and hello["peer"]
            and set(hello) == {"op", "role", "peer", "peer_mac", "engine", "tp_size", "pp_size"}
        ), hello
        yield prefill, decode, plain, hello
    finally:
        for engine in (prefill, decode, plain):
            engine.close()


class Pair:
    """The test plays the proxy: the decode half and the prefill half of each request."""

    def __init__(self, prefill: Engine, decode: Engine, hello: dict[str, Any]) -> None:
        self.prefill, self.decode, self.hello = prefill, decode, hello

    def send_params(self, transfer: str, **over: Any) -> dict[str, Any]:
        return {
            "kvferry": {
                "op": "send",
                "transfer": transfer,
                "peer": self.hello["peer"],
                "peer_mac": self.hello["peer_mac"],
                **over,
            }
        }

    def turn(
        self, rid: str, prompt: list[int], out: int = OUT, prefill_prompt: Optional[list[int]] = None
    ) -> dict[str, Any]:
        transfer = uuid.uuid4().hex
        self.decode.start(
            "run", [(f"d-{rid}", prompt, out, {"kvferry": {"op": "recv", "transfer": transfer}})], None, None
        )
        p = self.prefill.run([(f"p-{rid}", prefill_prompt or prompt, 1, self.send_params(transfer))])["outputs"][
            f"p-{rid}"
        ]
        d = self.decode.result()["outputs"][f"d-{rid}"]
        return {"prefill": p, "decode": d}


def no_blocks_used(*engines: Engine) -> None:
    for engine in engines:
        usage = engine.call("usage")
        assert usage == {"used": 0, "requests": 0}, usage


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    b, a = before.get("counts", {}), after.get("counts", {})
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def sessions(pair: Pair, plain: Engine, system: list[int], turns: int = 3, tag: str = "") -> int:
    """Two multi-turn sessions sharing a system prompt; each turn's prompt is the last prompt,
    its output and new tokens. Every decode output must equal the plain engine's. Returns
    the prompt blocks of every request (for the exact-once count)."""
    rng = random.Random(7)
    total = 0
    for s in range(2):
        prompt = system + [rng.randrange(1, 500) for _ in range(45 + 20 * s)]
        for t in range(turns):
            got = pair.turn(f"{tag}s{s}t{t}", prompt)
            want = plain.run([(f"r{tag}{s}{t}", prompt, OUT, None)])["outputs"][f"r{tag}{s}{t}"]["tokens"]
            assert got["decode"]["finish_reason"] == "length", got
            assert got["decode"]["tokens"] == want, (s, t, got, want)
            total += blocks(len(prompt))
            prompt = prompt + got["decode"]["tokens"] + [rng.randrange(1, 500) for _ in range(30)]
    return total


def warm_prefill(prefill: Engine, system: list[int]) -> None:
    """A plain request on the prefill engine only: its prefix cache now holds the system
    prompt, the decode engine's does not (the decode-cold case early transfer is for)."""
    prefill.run([(f"warm-{uuid.uuid4().hex[:6]}", system, 1, None)])


# -- output equality, exact once, no leaks --------------------------------------------------


@needs_vllm
def test_sessions_equal_a_single_engine(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    system = [random.Random(1).randrange(1, 500) for _ in range(100)]
    warm_prefill(prefill, system)
    p0, d0 = prefill.call("totals"), decode.call("totals")
    prompt_blocks = sessions(pair, plain, system)
    p, d = delta(p0, prefill.call("totals")), delta(d0, decode.call("totals"))
    assert p.get("early_issued_bytes", 0) > 0, p  # the system prompt's blocks left before the forward
    assert p.get("chunk_bytes", 0) > 0, p
    assert p.get("held_blocks", 0) > 0, p  # later turns: the decode engine held the earlier prompt
    assert d.get("duplicates_refused", 0) == 0 and d.get("notices_refused", 0) == 0, d
    assert p.get("early_landed_bytes", 0) <= p["early_issued_bytes"], (
        p
    )  # landed before the forward ended: of those issued
    assert p.get("failed_transfers", 0) == 0 and p["transfers"] == 6, p
    # Exact once: every prompt block was either held by the decode engine or sent, once.
    sent = p.get("early_issued_bytes", 0) + p.get("chunk_bytes", 0) + p.get("layer_bytes", 0)
    assert sent == (prompt_blocks - p["held_blocks"]) * BLOCK_BYTES, (p, prompt_blocks)
    no_blocks_used(prefill, decode)


@needs_vllm
@pytest.mark.parametrize("extra", [{"early": False}, {"layer_groups": 2}], ids=["early-off", "layer-groups"])
def test_sessions_with_variants(engines: Any, model: str, extra: dict[str, Any]) -> None:
    _, decode, plain, hello = engines
    prefill = Engine(model, "kv_producer", extra, max_num_batched_tokens=64)
    try:
        pair = Pair(prefill, decode, hello)
        # A system prompt of its own: the decode engine must not hold it from another test.
        system = [random.Random(str(extra)).randrange(1, 500) for _ in range(100)]
        warm_prefill(prefill, system)
        d0 = decode.call("totals")
        prompt_blocks = sessions(pair, plain, system, turns=2, tag=str(extra))
        p, d = prefill.call("totals")["counts"], delta(d0, decode.call("totals"))
        sent = p.get("early_issued_bytes", 0) + p.get("chunk_bytes", 0) + p.get("layer_bytes", 0)
        assert sent == (prompt_blocks - p.get("held_blocks", 0)) * BLOCK_BYTES, (p, prompt_blocks)
        assert d.get("duplicates_refused", 0) == 0
        if extra.get("early") is False:
            assert p.get("early_issued_bytes", 0) == 0, p  # the control: nothing before the forward
        else:
            assert p.get("early_issued_bytes", 0) > 0 and p.get("layer_bytes", 0) > 0, p
        no_blocks_used(prefill, decode)
    finally:
        prefill.close()


@needs_vllm
@pytest.mark.parametrize("transport", ["staging", "nixl"])
def test_tcp_control_plane_over_loopback(engines: Any, model: str, transport: str) -> None:
    """The decode side listens on tcp:// (loopback here; across hosts the same settings with
    a routable host), the bytes move by ``transport``: outputs equal a plain engine's and
    every block crosses once."""
    if transport == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl not importable")
    _, _, plain, _ = engines
    prefill = Engine(model, "kv_producer", {"transport": transport}, max_num_batched_tokens=64)
    decode = Engine(model, "kv_consumer", {"transport": transport, "listen": "tcp://127.0.0.1:0"})
    try:
        hello = hello_of(decode)
        assert hello["peer"].startswith("tcp://127.0.0.1:"), hello
        pair = Pair(prefill, decode, hello)
        prompt = prompt_of(150, 70)
        before = prefill.call("totals")
        got = pair.turn(f"tcp-{transport}", prompt)
        assert (
            got["decode"]["tokens"]
            == plain.run([(f"rtcp-{transport}", prompt, OUT, None)])["outputs"][f"rtcp-{transport}"]["tokens"]
        )
        sent = delta(before, prefill.call("totals"))
        assert (
            sent.get("early_issued_bytes", 0) + sent.get("chunk_bytes", 0) + sent.get("layer_bytes", 0)
            == blocks(len(prompt)) * BLOCK_BYTES
        ), sent
        urls = decode.call("totals")["endpoint_urls"]
        assert len(urls) == 1 and urls[0].startswith(f"{transport}+tcp://127.0.0.1:"), urls
        no_blocks_used(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@needs_vllm
def test_nixl_across_two_network_namespaces(engines: Any, model: str, tmp_path: Any) -> None:
    """A prefill engine in one network namespace feeds a decode engine in another over the
    veth between them: the control plane on tcp:// (the decode side binds the wildcard and
    advertises its veth address), the bytes over NIXL with UCX_TLS=tcp, the key from the same
    authkey_file on both "hosts"."""
    import netns

    why = netns.unavailable()
    if why is not None or importlib.util.find_spec("nixl") is None:
        pytest.skip(why or "nixl not importable")
    _, _, plain, _ = engines
    key = tmp_path / "shared.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    hosts = netns.TwoHosts()
    prefill = decode = None
    try:

        def env(side: Any) -> dict[str, str]:  # UCX over TCP on that side's veth end only
            return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": side.device}

        decode = Engine(
            model,
            "kv_consumer",
            {"transport": "nixl", "listen": "tcp://0.0.0.0:0", "advertise": hosts.b.ip, "authkey_file": str(key)},
            netns=hosts.b.namespace,
            env=env(hosts.b),
        )
        prefill = Engine(
            model,
            "kv_producer",
            {"transport": "nixl", "authkey_file": str(key)},
            netns=hosts.a.namespace,
            env=env(hosts.a),
            max_num_batched_tokens=64,
        )
        hello = hello_of(decode)
        assert hello["peer"].startswith(f"tcp://{hosts.b.ip}:"), hello
        veth_before = hosts.tx_bytes(hosts.a)
        prompt = prompt_of(150, 71)
        got = Pair(prefill, decode, hello).turn("netns", prompt)
        assert got["decode"]["tokens"] == plain.run([("rnetns", prompt, OUT, None)])["outputs"]["rnetns"]["tokens"], got
        # The KV bytes crossed the veth (UCX over TCP), not a shared path of the machine.
        assert hosts.tx_bytes(hosts.a) - veth_before >= blocks(len(prompt)) * BLOCK_BYTES
        no_blocks_used(prefill, decode)
    finally:
        for engine in (prefill, decode):
            if engine is not None:
                engine.close()
        hosts.close()


@needs_vllm
def test_kv_both_engine_serves_both_halves(engines: Any, model: str) -> None:
    _, _, plain, _ = engines
    both = Engine(model, "kv_both", max_num_batched_tokens=64)
    try:
        hello = hello_of(both)
        assert hello["role"] == "kv_both"
        prompt, transfer = [random.Random(9).randrange(1, 500) for _ in range(130)], uuid.uuid4().hex
        send = {"kvferry": {"op": "send", "transfer": transfer, "peer": hello["peer"], "peer_mac": hello["peer_mac"]}}
        out = both.run([("d", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}}), ("p", prompt, 1, send)])[
            "outputs"
        ]
        assert out["d"]["tokens"] == plain.run([("rboth", prompt, OUT, None)])["outputs"]["rboth"]["tokens"]
        assert both.call("totals")["counts"]["transfers"] == 1
        no_blocks_used(both)
    finally:
        both.close()


@needs_vllm
def test_two_prefill_engines_feed_one_decode_engine(engines: Any, model: str) -> None:
    prefill, decode, plain, hello = engines
    other = Engine(model, "kv_producer", max_num_batched_tokens=64)
    try:
        before = set(decode.call("totals")["endpoints"])
        prompts = {p: [random.Random(p).randrange(1, 500) for _ in range(170)] for p in ("one", "two")}
        transfers = {p: uuid.uuid4().hex for p in prompts}
        decode.start(
            "run",
            [(f"d-{p}", prompts[p], OUT, {"kvferry": {"op": "recv", "transfer": transfers[p]}}) for p in prompts],
            None,
            None,
        )
        for engine, p in ((prefill, "one"), (other, "two")):  # both prefill at once
            engine.start(
                "run", [(f"p-{p}", prompts[p], 1, Pair(engine, decode, hello).send_params(transfers[p]))], None, None
            )
        for engine in (prefill, other):
            engine.result()
        out = decode.result()["outputs"]
        for p in prompts:
            assert (
                out[f"d-{p}"]["tokens"]
                == plain.run([(f"r2-{p}", prompts[p], OUT, None)])["outputs"][f"r2-{p}"]["tokens"]
            )
        # Each prefill engine writes a staging ring of its own (a ring has one writer): the new
        # engine made one; the shared one made one too unless an earlier test had made it. (An
        # endpoint of an earlier test's engine that no sender holds any more may have been swept
        # meanwhile, DecodeWorker.sweep: so no claim on those.)
        after = set(decode.call("totals")["endpoints"])
        assert 1 <= len(after - before) <= 2 and len(after) >= 2, (before, after)
        no_blocks_used(prefill, other, decode)
    finally:
        other.close()


# -- aborts ---------------------------------------------------------------------------------


def still_serves(pair: Pair, plain: Engine, seed: int) -> None:
    prompt = prompt_of(90, seed)
    got = pair.turn(f"after{seed}", prompt)
    assert (
        got["decode"]["tokens"]
        == plain.run([(f"rafter{seed}", prompt, OUT, None)])["outputs"][f"rafter{seed}"]["tokens"]
    )


@needs_vllm
def test_prefill_aborted_while_waiting_for_its_destination(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, transfer = prompt_of(150, 11), uuid.uuid4().hex
    # The decode half is not sent yet: the prefill request waits, and is aborted there.
    p = prefill.run(
        [("p-before", prompt, 1, pair.send_params(transfer))], abort=("p-before", "waiting_for_destination")
    )
    assert p["outputs"]["p-before"]["finish_reason"] == "abort"
    d = decode.run([("d-before", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})])
    assert d["outputs"]["d-before"]["finish_reason"] == "error"  # the prefill side abandoned it
    no_blocks_used(prefill, decode)
    still_serves(pair, plain, 1)


@needs_vllm
def test_decode_aborted_before_the_prefill_arrives(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, transfer = prompt_of(150, 12), uuid.uuid4().hex
    d = decode.run(
        [("d-gone", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})],
        abort=("d-gone", "waiting_for_blocks"),
    )
    assert d["outputs"]["d-gone"]["finish_reason"] == "abort"
    p = prefill.run([("p-gone", prompt, 1, pair.send_params(transfer))])
    assert p["outputs"]["p-gone"]["finish_reason"] == "error"  # its destination ended
    no_blocks_used(prefill, decode)
    still_serves(pair, plain, 2)


@needs_vllm
def test_prefill_aborted_mid_transfer(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, transfer = prompt_of(200, 13), uuid.uuid4().hex  # 4 chunks of 64 tokens
    decode.start("run", [("d-mid", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})], None, None)
    p = prefill.run([("p-mid", prompt, 1, pair.send_params(transfer))], abort=("p-mid", "mid_prefill"))
    assert p["outputs"]["p-mid"]["finish_reason"] == "abort"
    assert decode.result()["outputs"]["d-mid"]["finish_reason"] == "error"  # revoked by its sender
    no_blocks_used(prefill, decode)
    still_serves(pair, plain, 3)


@needs_vllm
def test_decode_aborted_mid_transfer(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, transfer = prompt_of(200, 14), uuid.uuid4().hex
    recv = {"kvferry": {"op": "recv", "transfer": transfer}}
    assert decode.run([("d-mid2", prompt, OUT, recv)], until=("d-mid2", "waiting_for_blocks"))["stopped_at"]
    # The prefill engine runs its first chunk (and its sends), then stops between steps.
    assert prefill.run([("p-mid2", prompt, 1, pair.send_params(transfer))], until=("p-mid2", "mid_prefill"))[
        "stopped_at"
    ]
    decode.start("run", [], ("d-mid2", "waiting_for_blocks"), None)  # aborted right away
    prefill.run([])
    assert decode.result()["outputs"]["d-mid2"]["finish_reason"] == "abort"
    no_blocks_used(prefill, decode)
    still_serves(pair, plain, 4)


@needs_vllm
def test_decode_aborted_after_the_transfer(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, transfer = prompt_of(120, 15), uuid.uuid4().hex
    decode.start(
        "run",
        [("d-after", prompt, 50, {"kvferry": {"op": "recv", "transfer": transfer}})],
        ("d-after", "decoding"),
        None,
    )
    assert (
        prefill.run([("p-after", prompt, 1, pair.send_params(transfer))])["outputs"]["p-after"]["finish_reason"]
        == "length"
    )
    assert decode.result()["outputs"]["d-after"]["finish_reason"] == "abort"
    no_blocks_used(prefill, decode)


@needs_vllm
def test_decode_request_times_out_without_its_prefill_half(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    recv = {"kvferry": {"op": "recv", "transfer": uuid.uuid4().hex, "timeout_s": 1.0}}
    out = decode.run([("d-lonely", prompt_of(80, 16), OUT, recv)])["outputs"]["d-lonely"]
    assert out["finish_reason"] == "error"  # after its own 1 s bound, no prefill half came
    no_blocks_used(decode)


@needs_vllm
def test_dead_prefill_server_fails_the_decode_request(engines: Any, model: str) -> None:
    _, decode, plain, hello = engines
    doomed = Engine(model, "kv_producer", max_num_batched_tokens=64)
    pair = Pair(doomed, decode, hello)
    prompt, transfer = prompt_of(200, 17), uuid.uuid4().hex
    try:
        assert decode.run(
            [("d-orphan", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})],
            until=("d-orphan", "waiting_for_blocks"),
        )["stopped_at"]
        assert doomed.run([("p-orphan", prompt, 1, pair.send_params(transfer))], until=("p-orphan", "mid_prefill"))[
            "stopped_at"
        ]
    finally:
        doomed.process.kill()  # mid-transfer: its staging connection ends with it
        doomed.process.join(30)
    assert decode.run([])["outputs"]["d-orphan"]["finish_reason"] == "error"
    no_blocks_used(decode)


@needs_vllm
def test_dead_decode_server_frees_the_prefill_blocks(engines: Any, model: str) -> None:
    prefill, decode, plain, hello = engines
    doomed = Engine(model, "kv_consumer")
    try:
        theirs = hello_of(doomed)
        pair = Pair(prefill, doomed, theirs)
        prompt, transfer = prompt_of(200, 18), uuid.uuid4().hex
        assert doomed.run(
            [("d-dies", prompt, OUT, {"kvferry": {"op": "recv", "transfer": transfer}})],
            until=("d-dies", "waiting_for_blocks"),
        )["stopped_at"]
        assert prefill.run([("p-alone", prompt, 1, pair.send_params(transfer))], until=("p-alone", "mid_prefill"))[
            "stopped_at"
        ]
    finally:
        doomed.process.kill()
        doomed.process.join(30)
    assert prefill.run([])["outputs"]["p-alone"]["finish_reason"] == "length"  # its own token still comes
    no_blocks_used(prefill)
    still_serves(Pair(prefill, decode, hello), plain, 6)  # a new sender for the live decode engine


# -- the key --------------------------------------------------------------------------------


def _holds_key(value: Any, key: bytes) -> bool:
    import json

    text = json.dumps(value).lower()
    return "authkey" in text or key.hex() in text or key.decode("latin-1") in json.dumps(value, ensure_ascii=False)


@needs_vllm
def test_hello_and_served_answers_carry_no_key(engines: Any) -> None:
    from kvferry.vllm.config import default_authkey_path, load_authkey

    prefill, decode, plain, hello = engines
    key = load_authkey()  # the default file the engines made and share (no setting)
    assert os.path.dirname(default_authkey_path()) == os.path.join(os.environ["XDG_RUNTIME_DIR"], "kvferry")
    prompt = prompt_of(100, 60)
    got = Pair(prefill, decode, hello).turn("nokey", prompt)
    assert got["decode"]["finish_reason"] == "length" and got["prefill"]["finish_reason"] == "length", got
    answers = [hello, got["prefill"]["kv_transfer_params"], got["decode"]["kv_transfer_params"]]
    assert got["prefill"]["kv_transfer_params"] == {
        "kvferry": {"op": "send", "transfer": got["prefill"]["kv_transfer_params"]["kvferry"]["transfer"]}
    }
    assert not any(_holds_key(a, key) for a in answers), answers


@needs_vllm
def test_prefill_with_another_key_fails_its_request_and_keeps_serving(
    engines: Any, model: str, tmp_path: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    prefill, decode, plain, hello = engines
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    # It trusts the decode server by configuration (its peer_mac, signed with the other key,
    # would be refused before any connection): the handshake itself is what fails.
    extra = {"authkey_file": str(other), "trusted_peers": [hello["peer"]]}
    stranger = Engine(model, "kv_producer", extra, max_num_batched_tokens=64)
    try:
        out = stranger.run(
            [
                ("p-stranger", prompt_of(70, 61), 1, Pair(stranger, decode, hello).send_params(uuid.uuid4().hex)),
                ("good", prompt_of(40, 62), 1, None),
            ]
        )["outputs"]
        assert out["p-stranger"]["finish_reason"] == "error", out
        # vLLM gives a failed request no kv_transfer_params: the reason is in the engine's log.
        log = capfd.readouterr().err
        assert (
            f"authentication failed with the decode server's rendezvous at {hello['peer']!r}: the two servers hold "
            "different keys" in log
        ), log[-3000:]
        assert out["good"]["finish_reason"] == "length"
        no_blocks_used(stranger, decode)
    finally:
        stranger.close()
    still_serves(Pair(prefill, decode, hello), plain, 63)  # the decode server serves its own key-holders


@needs_vllm
def test_key_files_refused_naming_the_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.errors import InvalidArgumentError
    from kvferry.vllm.config import ConnectorConfig, default_authkey_path, load_authkey

    good = tmp_path / "good.key"
    good.write_bytes(bytes(range(32)))
    good.chmod(0o600)
    assert ConnectorConfig.from_extra({"authkey_file": str(good)}).authkey() == bytes(range(32))
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 31)
    short.chmod(0o600)
    with pytest.raises(InvalidArgumentError, match=rf"{short}.*31 bytes, need at least 32"):
        ConnectorConfig.from_extra({"authkey_file": str(short)}).authkey()
    for mode in (0o640, 0o604):
        good.chmod(mode)
        with pytest.raises(InvalidArgumentError, match=rf"{good}.*mode {mode:04o} lets group or others in"):
            load_authkey(str(good))
    good.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(good, 12345, -1)
        with pytest.raises(InvalidArgumentError, match=rf"{good}.*owned by uid 12345, not by this user"):
            load_authkey(str(good))
    with pytest.raises(InvalidArgumentError, match=rf"{tmp_path / 'missing.key'}.*cannot open it"):
        load_authkey(str(tmp_path / "missing.key"))
    # The default: made once (0700 directory, 0600 file, 32 random bytes), re-used after.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    path = default_authkey_path()
    assert path == str(tmp_path / "run" / "kvferry" / "authkey")
    first = load_authkey()
    assert len(first) == 32 and load_authkey() == first
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert os.listdir(os.path.dirname(path)) == ["authkey"]  # no temporary file left
    os.chmod(os.path.dirname(path), 0o755)
    with pytest.raises(InvalidArgumentError, match=rf"authkey directory {os.path.dirname(path)!r}.*mode 0755"):
        load_authkey()


# -- bad kv_transfer_params -----------------------------------------------------------------

# (kv_transfer_params that are not an object never reach a connector: the OpenAI server's
# schema types the field as an object, and vLLM's own request processing reads it as one.)
BAD_DECODE = [
    {"kvferry": "recv"},
    {"kvferry": {"op": "bogus"}},
    {"kvferry": {"op": "recv"}},  # no transfer id
    {"kvferry": {"op": "recv", "transfer": 7}},
    {"kvferry": {"op": "recv", "transfer": "t", "timeout_s": -1}},
    {"kvferry": {"op": "recv", "transfer": "t", "extra": 1}},
    {"kvferry": {"op": "send", "transfer": "t", "peer": "/x"}},  # send on a consumer
    {"kvferry": {"op": "status"}},  # no transfer id
    {"kvferry": {"op": "status", "transfer": 7}},
    {"kvferry": {"op": "status", "transfer": "t", "timeout_s": 1}},  # status takes op and transfer only
]


@needs_vllm
@pytest.mark.parametrize("params", BAD_DECODE, ids=[str(i) for i in range(len(BAD_DECODE))])
def test_bad_params_fail_only_their_request_on_the_decode_engine(engines: Any, params: Any) -> None:
    prefill, decode, plain, hello = engines
    good = prompt_of(40, 21)
    out = decode.run([("bad", prompt_of(70, 20), OUT, params), ("good", good, OUT, None)])["outputs"]
    assert out["bad"]["finish_reason"] == "error"
    assert out["good"]["tokens"] == plain.run([("rgood", good, OUT, None)])["outputs"]["rgood"]["tokens"]
    no_blocks_used(decode)


@needs_vllm
def test_bad_params_fail_only_their_request_on_the_prefill_engine(engines: Any, tmp_path: Any) -> None:
    from kvferry.vllm import trust

    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    # Addresses from an HTTP body alone (unsigned, or signed with another key) are never
    # connected to: a listener of the test's sees no connection (no SSRF, no relay).
    bait = socket.create_server(("127.0.0.1", 0))
    bait_url = f"tcp://127.0.0.1:{bait.getsockname()[1]}"
    forged = trust.sign_peer(os.urandom(32), bait_url)
    bad = [
        {"kvferry": {"op": "send", "transfer": "t6", "peer": bait_url}},
        {"kvferry": {"op": "send", "transfer": "t7", "peer": bait_url, "peer_mac": forged}},
        {
            "kvferry": {"op": "send", "transfer": "t8", "peer": bait_url, "peer_mac": hello["peer_mac"]}
        },  # another URL's signature
        {"kvferry": {"op": "send", "transfer": "t1", "peer": str(tmp_path / "nobody.sock")}},  # unknown peer
        {
            "kvferry": {"op": "send", "transfer": "t2", "peer": hello["peer"], "authkey": "ab" * 16}
        },  # a key in a request: refused
        {"kvferry": {"op": "send", "transfer": "t3", "peer": ""}},
        {"kvferry": {"op": "send", "transfer": "t4", "peer": 5}},
        {"kvferry": {"op": "recv", "transfer": "t5"}},  # recv on a producer
    ]
    requests = [(f"bad{i}", prompt_of(70, 30 + i), 1, params) for i, params in enumerate(bad)]
    out = prefill.run(requests + [("good", prompt_of(40, 21), 1, None)])["outputs"]
    assert all(out[f"bad{i}"]["finish_reason"] == "error" for i in range(len(bad))), out
    assert out["good"]["finish_reason"] == "length"
    for transfer in ("t6", "t7", "t8"):
        assert "not a trusted decode server" in status_of(prefill, transfer)["error"]
    bait.setblocking(False)
    with pytest.raises(BlockingIOError):
        bait.accept()  # nothing connected to it
    bait.close()
    no_blocks_used(prefill)
    still_serves(pair, plain, 5)


def status_of(engine: Engine, transfer: str) -> dict[str, Any]:
    rid = f"status-{uuid.uuid4().hex[:8]}"
    out = engine.run([(rid, [0], 1, {"kvferry": {"op": "status", "transfer": transfer}})])["outputs"][rid]
    assert out["finish_reason"] == "length", out
    return dict(out["kv_transfer_params"]["kvferry"])


@needs_vllm
def test_status_tells_how_each_side_ended(engines: Any) -> None:
    """The one-token ``status`` op: a served transfer is ``done`` on both engines; one whose
    prefill request was aborted before its first chunk is ``failed`` on both, with the reason
    each side logged; an id never seen is ``unknown``. Nothing is computed or moved for it."""
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    prompt, served = prompt_of(100, 50), uuid.uuid4().hex
    decode.start("run", [("d-served", prompt, OUT, {"kvferry": {"op": "recv", "transfer": served}})], None, None)
    assert (
        prefill.run([("p-served", prompt, 1, pair.send_params(served))])["outputs"]["p-served"]["finish_reason"]
        == "length"
    )
    assert decode.result()["outputs"]["d-served"]["finish_reason"] == "length"
    assert status_of(decode, served) == {"op": "status", "transfer": served, "state": "done"}
    assert status_of(prefill, served) == {"op": "status", "transfer": served, "state": "done"}
    gone = uuid.uuid4().hex
    prefill.run(
        [("p-quit", prompt_of(150, 51), 1, pair.send_params(gone))], abort=("p-quit", "waiting_for_destination")
    )
    d = decode.run([("d-quit", prompt_of(150, 51), OUT, {"kvferry": {"op": "recv", "transfer": gone}})])
    assert d["outputs"]["d-quit"]["finish_reason"] == "error"
    theirs = status_of(prefill, gone)
    assert theirs["state"] == "failed" and re.fullmatch(
        r"prefill request p-quit\S* ended before its first chunk", theirs["error"]
    ), theirs
    assert status_of(decode, gone) == {
        "op": "status",
        "transfer": gone,
        "state": "failed",
        "error": f"the prefill side gave up: {theirs['error']}",
    }
    assert status_of(decode, "never-seen") == {"op": "status", "transfer": "never-seen", "state": "unknown"}
    no_blocks_used(prefill, decode)


@needs_vllm
def test_status_answers_from_a_bounded_record() -> None:
    """The scheduler half without an engine: a transfer a request holds is ``active``; a
    refused request's transfer is ``failed`` with the refusal; a later success does not hide
    a failure of the same id; only the newest MAX_OUTCOMES are kept."""
    from types import SimpleNamespace

    from kvferry.vllm import scheduler
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.metadata import Outcome

    manager = SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9],))
    side = scheduler.SchedulerSide(
        ConnectorConfig(),
        block_size=BLOCK,
        role="kv_consumer",
        engine_id="e",
        kv_cache_manager_getter=lambda: manager,
        authkey=b"k" * 32,
    )

    def request(rid: str, ours: dict[str, Any], n: int = 70) -> Any:
        return SimpleNamespace(
            request_id=rid,
            num_tokens=n,
            num_prompt_tokens=n,
            prompt_token_ids=list(range(n)),
            kv_transfer_params={"kvferry": ours},
        )

    def status(transfer: str) -> dict[str, Any]:
        delay, answer = side.request_finished(request("st", {"op": "status", "transfer": transfer}, 1), [])
        assert delay is False and answer is not None
        return dict(answer["kvferry"])

    recv = request("d1", {"op": "recv", "transfer": "live"})
    assert side.get_num_new_matched_tokens(recv, 0) == (70, True)
    side.update_state_after_alloc(recv, None, 70)
    assert status("live") == {"op": "status", "transfer": "live", "state": "active"}
    assert side.get_num_new_matched_tokens(request("s1", {"op": "status", "transfer": "live"}, 1), 0) == (
        0,
        False,
    )  # computes nothing
    bad = request("d2", {"op": "send", "transfer": "wrong-side", "peer": "/p"})
    assert side.get_num_new_matched_tokens(bad, 0) == (1, True)
    assert status("wrong-side") == {"op": "status", "transfer": "wrong-side", "state": "failed",
                                    "error": "request refused: op 'send' on a kv_consumer server: send prefill "
                                             "requests to a kv_producer (or kv_both) server"}  # fmt: skip
    side.record([Outcome("wrong-side", "done")])
    assert status("wrong-side")["state"] == "failed"
    side.record([Outcome(f"t{i}", "done") for i in range(scheduler.MAX_OUTCOMES)])
    assert status("wrong-side")["state"] == "unknown" and status("t0")["state"] == "done"  # the oldest forgotten first
    assert status(f"t{scheduler.MAX_OUTCOMES - 1}")["state"] == "done"


@needs_vllm
def test_halves_with_different_prompts_fail_both(engines: Any) -> None:
    prefill, decode, plain, hello = engines
    pair = Pair(prefill, decode, hello)
    got = pair.turn("mismatch", prompt_of(100, 40), prefill_prompt=prompt_of(100, 41))
    assert got["prefill"]["finish_reason"] == "error" and got["decode"]["finish_reason"] == "error", got
    no_blocks_used(prefill, decode)


# -- registration and metrics (no engine) ---------------------------------------------------


@needs_vllm
def test_register_by_name_is_idempotent() -> None:
    import kvferry.vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kvferry.vllm.register()
    kvferry.vllm.register()  # vLLM's factory raises on a duplicate name: this must not
    assert KVConnectorFactory.get_connector_class_by_name("KvferryConnector") is kvferry.vllm.KvferryConnector


@needs_vllm
def test_entry_point_names_the_register_function() -> None:
    import importlib

    import kvferry.vllm
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    target = project["entry-points"]["vllm.general_plugins"]["kvferry"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is kvferry.vllm.register
    assert any(dep.startswith("vllm") for dep in project["optional-dependencies"]["vllm"])


@needs_vllm
def test_stats_aggregate_and_reach_prometheus() -> None:
    import functools
    from types import SimpleNamespace

    from kvferry.vllm.connector import KvferryConnector
    from kvferry.vllm.stats import Tally
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KvferryConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    tally = Tally()
    tally.add("early_issued_bytes", 4096)
    tally.add("held_blocks", 3)
    tally.observe("hidden_fraction", 0.75)
    first = KvferryConnector.build_kv_connector_stats(tally.take())
    assert tally.take() == {"counts": {}, "observed": {}}  # taken once
    tally.add("early_issued_bytes", 1024)
    tally.add("duplicates_refused", 0)  # a zero is not an observation
    tally.observe("hidden_fraction", 0.25)
    both = first.aggregate(KvferryConnector.build_kv_connector_stats(tally.take()))
    assert both.reduce() == {"early_issued_bytes": 5120, "held_blocks": 3, "hidden_fraction_mean": 0.5}
    assert KvferryConnector.build_kv_connector_stats({}).is_empty()
    prom.observe(both.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvferry_early_issued_bytes_total{engine="0"} 5120.0' in text
    assert 'vllm:kvferry_held_blocks_total{engine="0"} 3.0' in text
    assert 'vllm:kvferry_hidden_fraction_count{engine="0"} 2.0' in text
    for name in ("early_landed_bytes_total", "chunk_bytes_total", "layer_bytes_total", "duplicates_refused_total",
                 "notices_refused_total", "transfer_seconds_count"):  # fmt: skip
        assert f"vllm:kvferry_{name}" in text


def test_extra_config_and_params_are_checked_by_name() -> None:
    from kvferry.errors import InvalidArgumentError

    try:
        from kvferry.vllm.config import ConnectorConfig, RequestParams, parse_params
    except ImportError:
        pytest.skip("kvferry.vllm needs vLLM")
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    assert ConnectorConfig.from_extra({"layer_groups": 2, "early": False}).layer_groups == 2
    assert ConnectorConfig.from_extra({"transfer_cores": [0]}).transfer_cores == (0,)
    assert ConnectorConfig.from_extra({"transfer_cores": []}).transfer_cores == ()
    assert ConnectorConfig().staging_bytes is None  # the ring's size follows the caches' device
    assert ConnectorConfig.from_extra({"staging_bytes": 8 << 20}).staging_bytes == 8 << 20
    for extra, named in [
        ({"layer_group": 2}, "layer_group"),
        ({"early": "no"}, "early"),
        ({"layer_groups": 0}, "layer_groups"),
        ({"transfer_timeout_s": float("nan")}, "transfer_timeout_s"),
        ({"transport": "shm"}, "transport='shm'"),
        ({"listen": "tcp://0.0.0.0:0"}, "wildcard bind needs advertise"),
        ({"listen": "unix://", "advertise": "10.0.0.1"}, "advertise"),
        ({"listen": "tcp://10.0.0.1:0"}, "transport='auto' with listen='tcp://10.0.0.1:0': auto picks cuda-ipc"),
        ({"listen": "tcp://10.0.0.1:0", "transport": "staging"}, "staging runs only on one host"),
        ({"listen": "http://x"}, "listen"),
        ({"transfer_cores": "1"}, "transfer_cores='1'"),
        ({"transfer_cores": [1 << 20]}, "not a CPU id"),
        ({"transfer_cores": [True]}, "transfer_cores"),
        ({"staging_bytes": 0}, "staging_bytes=0: must be a positive integer"),
        ({"staging_bytes": "1GiB"}, "staging_bytes='1GiB': must be a positive integer"),
        ({"staging_bytes": None}, "staging_bytes=None: must be a positive integer"),
    ]:
        with pytest.raises(InvalidArgumentError, match=named):
            ConnectorConfig.from_extra(extra)
    assert parse_params(None) is None and parse_params({"other": 1}) is None
    assert parse_params({"kvferry": {"op": "recv", "transfer": "t", "timeout_s": 5}}).timeout_s == 5.0
    assert parse_params({"kvferry": {"op": "status", "transfer": "t"}}) == RequestParams("status", "t")
    for params, named in [
        ({"kvferry": {"op": "status"}}, r"transfer=None"),
        ({"kvferry": {"op": "status", "transfer": "t", "peer": "/p"}}, r"keys \['peer'\] for op 'status'"),
        ({"kvferry": {"op": "send", "transfer": "t", "peer": "/p", "authkey": "00" * 32}}, "never travels"),
        ({"kvferry": {"op": "send", "transfer": "t"}}, "peer"),
        ({"kvferry": {"op": "recv", "transfer": ""}}, "transfer"),
        ({"kvferry": {"op": "recv", "transfer": "t", "timeout_s": True}}, "timeout_s"),
    ]:
        with pytest.raises(InvalidArgumentError, match=named):
            parse_params(params)


# -- real servers behind the proxy: kvferry's figures on /metrics ---------------------------


def _metric(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


@needs_vllm
def test_real_servers_show_kvferry_metrics(tmp_path: Any) -> None:
    from kvferry.vllm import testbed

    tiny = testbed.build_tiny_llama(tmp_path)
    (tmp_path / "bed").mkdir()
    prefill_config, decode_config = testbed.CONNECTORS["kvferry"]
    with testbed.Testbed(tiny, tmp_path / "bed", prefill_config, decode_config, proxy_connector="kvferry") as bed:
        rng = random.Random(5)
        system = [rng.randrange(3, 500) for _ in range(96)]
        # The prefill server alone sees the system prompt first (decode-cold for the pair).
        assert (
            testbed.call(
                bed.prefills[0].url, "/v1/completions", {"model": "tiny", "prompt": system, "max_tokens": 1}
            ).status
            == 200
        )
        prompt = system + [rng.randrange(3, 500) for _ in range(50)]
        for _ in range(2):
            answer = testbed.call(
                bed.url,
                "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert answer.status == 200 and len(answer.token_ids) == 8, answer.body
            prompt = prompt + answer.token_ids + [rng.randrange(3, 500) for _ in range(40)]
        # vLLM publishes connector stats with the engine's next stats record: wait for them
        # (bounded), not for a fixed time.
        wait_until(
            lambda: _metric(bed.prefills[0].metrics(), "vllm:kvferry_transfers_total") >= 2,
            "the prefill server's stats of both transfers",
        )
        p_text, d_text = bed.prefills[0].metrics(), bed.decodes[0].metrics()
        assert _metric(p_text, "vllm:kvferry_transfers_total") == 2, p_text
        assert _metric(p_text, "vllm:kvferry_early_issued_bytes_total") > 0  # turn 1: the system prompt
        assert _metric(p_text, "vllm:kvferry_chunk_bytes_total") > 0
        assert _metric(p_text, "vllm:kvferry_held_blocks_total") > 0  # turn 2: the decode server held turn 1
        assert _metric(p_text, "vllm:kvferry_hidden_fraction_count") == 2
        assert _metric(d_text, "vllm:kvferry_recv_seconds_count") == 2
        assert (
            "vllm:kvferry_duplicates_refused_total" in d_text
            and _metric(d_text, "vllm:kvferry_duplicates_refused_total") == 0
            and _metric(d_text, "vllm:kvferry_notices_refused_total") == 0
        )
        for server in bed.servers():
            assert server.kv_blocks()[0] == 0, server.name


# -- the rendezvous and the destination check (no engine) -----------------------------------


def _published(request_id: int, **changes: Any) -> dict[str, Any]:
    """A destination as the decode worker publishes it (worker._expect)."""
    destination = {
        "request_id": request_id,
        "epoch": 1,
        "prompt_len": 40,
        "digest": "0123456789abcdef0123456789abcdef",
        "block_size": 16,
        "dst_blocks": [7, 3, 9],
        "held_blocks": 1,
        "engine": "decode-0",
    }
    destination.update(changes)
    return destination


@needs_vllm
@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
def test_rendezvous_hands_a_destination_to_one_lookup_only(tmp_path: Any, listen: str) -> None:
    import threading

    from kvferry.errors import InvalidArgumentError, TransferError
    from kvferry.vllm import rendezvous

    key = os.urandom(32)
    with pytest.raises(InvalidArgumentError, match="wildcard bind needs advertise="):
        rendezvous.Rendezvous(key, lambda sender: "", listen="tcp://0.0.0.0:0")
    server = rendezvous.Rendezvous(key, lambda sender: f"/staging/{sender}", str(tmp_path), listen=listen)
    assert server.address.startswith(listen[:6]) and not server.address.endswith(":0")
    try:
        got: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: got.update(rendezvous.lookup(server.address, key, "T", 60, "P1")))
        waiting.start()  # asks before the decode side published: it waits for it
        server.publish("T", _published(1))
        waiting.join(60)
        assert got == dict(_published(1), endpoint="/staging/P1")  # that prefill engine's own endpoint
        assert server.taker("T") == "P1"
        with pytest.raises(TransferError, match="already taken"):
            rendezvous.lookup(server.address, key, "T", 0, "P2")
        # Its taker asking again (it preempted the request) waits for the decode side to offer it again.
        with pytest.raises(TransferError, match="this prefill engine took it, and its decode server did not offer"):
            rendezvous.lookup(server.address, key, "T", 0, "P1")
        with pytest.raises(TransferError, match="already expected"):
            server.publish("T", _published(2))
        server.withdraw("T", "its blocks arrived")
        with pytest.raises(TransferError, match="ended on the decode server: its blocks arrived"):
            rendezvous.lookup(server.address, key, "T", 0, "P1")
        with pytest.raises(
            TransferError, match="authentication failed with the decode server's rendezvous.*different keys"
        ):
            rendezvous.lookup(server.address, os.urandom(32), "U", 0, "P1")  # a wrong key
        with pytest.raises(TransferError, match="cannot reach"):
            rendezvous.lookup("/bare/path.sock", key, "U", 0, "P1")  # not a unix:// or tcp:// URL
        rendezvous.abandon(server.address, key, "V", "prefill aborted")  # before its publish
        server.publish("V", _published(3))
        assert server.abandoned("V") == "prefill aborted"
        with pytest.raises(TransferError, match="abandoned"):
            rendezvous.lookup(server.address, key, "V", 0, "P1")
        assert server.withdraw_untaken("V", "given up") and not server.withdraw_untaken("V", "again")
        with pytest.raises(TransferError, match="no decode request expected it"):
            rendezvous.lookup(server.address, key, "W", 0, "P1")
    finally:
        server.close()
    broken = rendezvous.Rendezvous(
        key, lambda sender: (_ for _ in ()).throw(RuntimeError("no room")), str(tmp_path), listen=listen
    )
    try:
        broken.publish("X", _published(4))
        with pytest.raises(TransferError, match="no endpoint for prefill engine 'P1': no room"):
            rendezvous.lookup(broken.address, key, "X", 0, "P1")
        assert "no room" in (broken.abandoned("X") or "")  # its decode request fails at once
    finally:
        broken.close()


@needs_vllm
def test_rendezvous_refuses_what_its_frames_cannot_carry(tmp_path: Any) -> None:
    from kvferry.errors import InvalidArgumentError, TransferError
    from kvferry.vllm import rendezvous

    key = os.urandom(32)
    server = rendezvous.Rendezvous(key, lambda sender: f"staging+unix:///run/{sender}\n", str(tmp_path))
    try:
        for bad, field in [
            (_published(1, held_blocks=4), "held_blocks"),  # more than its 3 ids
            (_published(1, dst_blocks=[1, -2, 3]), "dst_blocks"),
            (_published(1, digest="not hex"), "digest"),
            (_published(1, engine=""), "engine"),
            (_published(1, block_size=0), "block_size"),
        ]:
            # A TransferError too: the decode worker fails that request by it (worker._expect).
            with pytest.raises(
                rendezvous.InvalidDestinationError, match=f"invalid destination for transfer 'T': .*invalid {field}="
            ) as refused:
                server.publish("T", bad)
            assert isinstance(refused.value, TransferError) and isinstance(refused.value, InvalidArgumentError)
        with pytest.raises(rendezvous.InvalidDestinationError, match=r"missing \['engine'\], unknown \['extra'\]"):
            server.publish("T", {**{k: v for k, v in _published(1).items() if k != "engine"}, "extra": 1})
        with pytest.raises(InvalidArgumentError, match="invalid wait_s=-1"):
            rendezvous.lookup(server.address, key, "T", -1, "P1")
        with pytest.raises(InvalidArgumentError, match="invalid wait_s=3601"):
            rendezvous.lookup(server.address, key, "T", 3601, "P1")
        with pytest.raises(InvalidArgumentError, match="invalid transfer="):
            rendezvous.lookup(server.address, key, "", 0, "P1")
        with pytest.raises(InvalidArgumentError, match="invalid sender="):
            rendezvous.lookup(server.address, key, "T", 0, "P" * 129)
        with pytest.raises(TransferError, match="could not tell the decode server.*invalid transfer="):
            rendezvous.abandon(server.address, key, "", "why")
        # Nothing of these reached the rendezvous: T was never published, taken or abandoned.
        assert server.taker("T") is None and server.abandoned("T") is None
        # An endpoint URL the frame cannot carry (a control character) fails that lookup by
        # name and its decode request at once; the destination goes to nobody.
        server.publish("T", _published(1))
        with pytest.raises(TransferError, match="no usable endpoint for prefill engine 'P1'.*invalid endpoint="):
            rendezvous.lookup(server.address, key, "T", 0, "P1")
        assert server.taker("T") is None and "invalid endpoint=" in (server.abandoned("T") or "")
        # A long abandon reason is cut to the frame's bound, not refused.
        rendezvous.abandon(server.address, key, "U", "é" * 2000)
        assert server.abandoned("U") == "é" * 500
    finally:
        server.close()


@needs_vllm
def test_the_rendezvous_frames_are_a_set_of_their_own() -> None:
    """kvferry.vllm.frames' dataclasses list the fields of the codec's rendezvous records
    (rust/src/wire/rendezvous.rs) in wire order; the rendezvous's set shares only the
    handshake's frames and the goodbye with the transports'."""
    from dataclasses import fields

    from kvferry import _core
    from kvferry.errors import InvalidArgumentError
    from kvferry.transports import wire
    from kvferry.transports.frames import TRANSPORT, Announce
    from kvferry.vllm.frames import RENDEZVOUS, Abandoned, Destination, Lookup

    rendezvous = {"lookup", "destination", "refused", "abandon", "abandoned", "offer", "accepted"}
    assert set(RENDEZVOUS.classes) == {"challenge", "proof", "goodbye"} | rendezvous
    for kind, cls in RENDEZVOUS.classes.items():
        assert tuple(f.name for f in fields(cls)) == _core.WIRE_FIELDS[kind], kind
        if kind in TRANSPORT.classes:
            assert TRANSPORT.classes[kind] is cls
    with pytest.raises(InvalidArgumentError, match="not a frame of the rendezvous"):
        RENDEZVOUS.encode(Announce([(1, 1)]))
    with pytest.raises(InvalidArgumentError, match="not a frame of the transport channel"):
        wire.encode(Lookup("T", 0, "P"))
    assert RENDEZVOUS.decode(RENDEZVOUS.encode(Abandoned(call=5)), 4) == Abandoned(call=5)  # its call only
    destination = Destination(7, 2, 40, 16, 1, [7, 3, 9], "0123456789abcdef", "e0", "staging+unix:///x", call=9)
    got = RENDEZVOUS.decode(RENDEZVOUS.encode(destination), 1 << 20)
    assert isinstance(got, Destination) and got.call == 9
    published = {k: v for k, v in destination.fields().items() if k != "call"}  # as the connector reads it
    assert got.as_dict() == dict(published, dst_blocks=[7, 3, 9])
    assert type(got.as_dict()["dst_blocks"][0]) is int


@needs_vllm
@pytest.mark.parametrize("listen", ["unix://", "tcp://127.0.0.1:0"])
def test_a_bad_frame_at_the_rendezvous_ends_only_that_connection(tmp_path: Any, listen: str) -> None:
    import json
    import socket
    import struct

    from kvferry import _core
    from kvferry.transports import wire
    from kvferry.transports.frames import Goodbye, Notices
    from kvferry.vllm import rendezvous
    from kvferry.vllm.frames import RENDEZVOUS, Destination, Lookup

    key = os.urandom(32)
    server = rendezvous.Rendezvous(key, lambda sender: f"/staging/{sender}", str(tmp_path), listen=listen)
    where = wire.parse_address(server.address)

    def authenticated() -> socket.socket:
        sock = wire.connect(where, 10)
        wire.handshake(sock, key, wire.ROLE_SENDER, 10, server.address)
        return sock

    def goodbye_then_closed(sock: socket.socket) -> str:
        frame = wire.recv_frame(sock, frames=RENDEZVOUS)
        assert isinstance(frame, Goodbye), frame
        with pytest.raises(EOFError):
            wire.recv_frame(sock)  # the rendezvous closed this connection
        return frame.reason

    body = json.dumps({"op": "lookup", "transfer": "T", "wait_s": 0, "sender": "P1"}).encode()
    old_json = struct.pack(">I", len(body)) + body  # the rendezvous's frames before this codec
    destination = wire.encode(Destination(**dict(_published(9), endpoint="/x")), RENDEZVOUS)

    def ends(sock: socket.socket) -> None:
        # The rendezvous closes with bytes of ours unread, so the end is an EOF or a reset.
        sock.settimeout(10)  # a connection left open fails the test, it does not hang it
        with pytest.raises((EOFError, ConnectionError, wire.ProtocolError)):
            while True:
                wire.recv_frame(sock)

    try:
        # Before the handshake: JSON or garbage fails authentication; the connection closes.
        for data in (old_json, b"\x00" * 64):
            sock = wire.connect(where, 10)
            try:
                sock.sendall(data)
                ends(sock)
            finally:
                sock.close()
        # After it, a whole old JSON frame: the connection ends.
        sock = authenticated()
        try:
            sock.sendall(old_json)
            ends(sock)
        finally:
            sock.close()
        # Its first 12 bytes (all the rendezvous reads of it), garbage behind a valid header,
        # a frame of a type the rendezvous does not take, one it sends itself: each is read
        # whole, so the goodbye naming why arrives before the end.
        header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, 12, 5)  # a lookup of 5 bytes
        cases = [
            (old_json[: wire.HEADER.size], "bad magic"),
            (header + b"\xff" * 5, "invalid frame"),
            (wire.encode(Notices([], None)), "a notices frame, which the rendezvous does not take"),
            (destination, "a destination frame, which the rendezvous does not take"),
            (wire.encode(Goodbye("bye")), "a goodbye frame"),
        ]
        for data, why in cases:
            sock = authenticated()
            try:
                sock.sendall(data)
                assert why in goodbye_then_closed(sock)
            finally:
                sock.close()
        # A peer left mid-frame (a lookup cut short): its connection ends, no answer owed.
        sock = authenticated()
        sock.sendall(wire.encode(Lookup("T", 0, "P1"), RENDEZVOUS)[:-3])
        sock.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            wire.recv_frame(sock)
        sock.close()
        assert server.taker("T") is None and server.abandoned("T") is None  # none of them touched T
        # The rendezvous still serves: a good lookup gets its destination.
        server.publish("T", _published(5))
        assert rendezvous.lookup(server.address, key, "T", 10, "P1") == dict(_published(5), endpoint="/staging/P1")
        assert server.taker("T") == "P1"
        assert _core.WIRE_VERSION == wire.VERSION
    finally:
        server.close()


@needs_vllm
def test_destination_is_checked_against_the_request() -> None:
    from types import SimpleNamespace

    from kvferry.errors import KvFerryError
    from kvferry.vllm.config import prompt_digest
    from kvferry.vllm.scheduler import _check_destination

    prompt = list(range(1, 71))  # 3 blocks of 32
    request = SimpleNamespace(num_prompt_tokens=70, prompt_token_ids=prompt)
    good = {
        "prompt_len": 70,
        "digest": prompt_digest(prompt),
        "block_size": 32,
        "dst_blocks": [4, 5, 6],
        "held_blocks": 1,
        "request_id": 9,
        "epoch": 1,
        "endpoint": "staging+unix:///s",
    }
    assert _check_destination(dict(good), request, 32)["dst_blocks"] == [4, 5, 6]
    for change, named in [
        ({"digest": prompt_digest(prompt[:-1] + [0])}, "another prompt"),
        ({"prompt_len": 71}, "another prompt"),
        ({"block_size": 16}, "block_size"),
        ({"dst_blocks": [4, 5]}, "dst_blocks"),
        ({"dst_blocks": [4, -5, 6]}, r"dst_blocks\[1\]"),
        ({"dst_blocks": [4, 2**40, 6]}, r"dst_blocks\[1\]"),
        ({"dst_blocks": [4, True, 6]}, r"dst_blocks\[1\]"),
        ({"held_blocks": 3}, "held_blocks"),
        ({"epoch": 0}, "epoch"),
        ({"request_id": -1}, "request_id"),
        ({"endpoint": None}, "endpoint"),
        ({"endpoint": "nixl+tcp://10.0.0.1:5"}, "is for transport 'nixl'"),
        ({"endpoint": "bogus+unix:///s"}, "bogus"),
        ({"endpoint": "auto+nixl+tcp://10.0.0.1:5,nixl+tcp://10.0.0.1:6"}, "is for transport 'nixl' or 'nixl'"),
    ]:
        with pytest.raises(KvFerryError, match=named):
            _check_destination({**good, **change}, request, 32)


# -- TransferHook.update_src_blocks (what the connector adds to the hook; no vLLM) ----------


def test_hook_takes_a_block_table_that_grows_chunk_by_chunk() -> None:
    import numpy as np
    import torch
    from kvferry import BlockRange, InvalidArgumentError, UnknownRequestError
    from kvferry.hook import TransferHook
    from kvferry.layout import PagedKV
    from kvferry.receiver import KVReceiver
    from kvferry.sender import KVSender
    from kvferry.transports.inprocess import InProcessTransport

    tpb, shape = 4, (16, 2, 4, 8)  # 16 blocks of 4 tokens
    src = PagedKV(tuple(torch.randn(shape) for _ in range(2)), tpb)
    dst = PagedKV(tuple(torch.full(shape, float("nan")) for _ in range(2)), tpb)
    receiver = KVReceiver(dst)
    epoch = receiver.expect(1, 14, held=[BlockRange(0, 1)])  # 4 blocks, the first held
    hook = TransferHook(KVSender(src, InProcessTransport(receiver)))
    # Reused prefix of 8 tokens (blocks 0, 1); the engine allocated only those so far.
    table, dests = [9, 3, 12, 5], [0, 7, 2, 11]
    hook.add_request(
        1, 14, reused_len=8, src_blocks=[9, 3, -1, -1], dst_blocks=dests, held=[BlockRange(0, 1)], epoch=epoch
    )
    assert [n.start for n in hook.before_forward([1])] == [1]  # block 1 early; block 0 held
    hook.update_src_blocks(1, table[:3])  # the first chunk [8, 12) allocated block 2
    hook.after_forward([1], [8], [12])
    hook.update_src_blocks(1, table)  # the last chunk [12, 14): the partial block 3
    hook.after_forward([1], [12], [14])
    hook.finish(1)
    receiver.wait(1, timeout=10)
    for s, d in zip(table[1:], dests[1:]):
        for a, b in zip(src.layers, dst.layers):
            assert torch.equal(a[s], b[d])
    assert torch.isnan(dst.layers[0][dests[0]]).all()  # held: never written
    with pytest.raises(UnknownRequestError, match="request_id=1"):
        hook.update_src_blocks(1, table)
    hook.add_request(2, 8, reused_len=0, src_blocks=np.full(2, -1), dst_blocks=[4, 6])
    with pytest.raises(InvalidArgumentError, match="src_blocks=<3 ids>"):
        hook.update_src_blocks(2, [1, 2, 3])
    with pytest.raises(TypeError, match="src_blocks"):
        hook.update_src_blocks(2, [1.5])


@needs_vllm
@pytest.mark.parametrize("transport", ["staging", "nixl", "cuda-ipc"])
def test_given_up_blocks_past_the_fence_timeout(transport: str) -> None:
    """Past ``fence_timeout_s`` without the sender's fence: staging releases (its endpoint
    drops late writes); nixl and cuda-ipc keep the blocks while the sender is still
    connected (their writes land whatever the receiver decided) and release once that
    connection ended."""
    from types import SimpleNamespace

    from kvferry.errors import TransferTimeoutError
    from kvferry.transports.registry import Served
    from kvferry.vllm.config import ConnectorConfig
    from kvferry.vllm.decode_worker import DecodeWorker, _Recv
    from kvferry.vllm.metadata import RecvSpec
    from kvferry.vllm.worker import WorkerCommon

    class Receiver:
        released_unfenced: list[int] = []

        def release(self, kv: int, timeout: float) -> None:
            raise TransferTimeoutError("not fenced")

        def release_unfenced(self, kv: int, timeout: float) -> None:
            self.released_unfenced.append(kv)

    class Rendezvous:
        withdrawn: list[str] = []

        def withdraw_untaken(self, transfer: str, reason: str) -> bool:
            return False  # a prefill engine took it: it may write

        def taker(self, transfer: str) -> str:
            return "P"

        def withdraw(self, transfer: str, reason: str) -> None:
            self.withdrawn.append(transfer)

    side = DecodeWorker(
        WorkerCommon(ConnectorConfig(transport=transport), block_size=32, num_blocks=8, authkey=b"k" * 32)
    )
    side.receiver, side.rendezvous = Receiver(), Rendezvous()  # type: ignore[assignment]
    peers = [object()]  # the sender's authenticated connection
    endpoint = SimpleNamespace(connected=lambda: bool(peers))
    side.endpoints["P"] = Served(transport, endpoint, f"{transport}+tcp://127.0.0.1:1")
    st = _Recv(RecvSpec("r", 7, "T", 64, [[0, 1]], 0, "d", 1.0), 0.0, 1.0, giving_up="timed out", fence_deadline=5.0)
    assert side._release(st, now=1.0) is False  # before the fence timeout: both wait
    if transport == "staging":
        assert side._release(st, now=6.0) is True and side.receiver.released_unfenced == [7]  # type: ignore[attr-defined]
        return
    assert side._release(st, now=6.0) is False and side._release(st, now=600.0) is False  # kept
    assert side.receiver.released_unfenced == [] and side.rendezvous.withdrawn == []  # type: ignore[attr-defined]
    peers.clear()  # the sender's connection ended
    assert side._release(st, now=601.0) is True and side.receiver.released_unfenced == [7]  # type: ignore[attr-defined]


@needs_vllm
def test_engines_on_backends_that_prefer_other_layouts_agree_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM resolves an engine's KV cache layout from its attention backends' supported
    layouts (most preferred first) and its connector's required one. A backend that takes
    any layout, LBNHC first, and one that reads head-major blocks only (LBHNC or BLHNC)
    resolve to different layouts on their own: a pair kvferry refuses ("layout mismatch").
    Under KvferryConnector both resolve to LBHNC; with MLA it asks for none."""
    from types import SimpleNamespace

    from kvferry.vllm.connector import KvferryConnector
    from vllm.config import KVTransferConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    anywhere = ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
    head_major = ["LBHNC", "BLHNC"]
    kvferry = KVTransferConfig(
        kv_connector="KvferryConnector", kv_role="kv_both", kv_connector_module_path="kvferry.vllm.connector"
    )

    def resolved(supported: list[str], transfer: Any, mla: bool = False) -> str:
        config = SimpleNamespace(
            cache_config=SimpleNamespace(kv_cache_layout=None),
            kv_transfer_config=transfer,
            model_config=SimpleNamespace(use_mla=mla),
        )
        return resolve_kv_cache_layout(config, [supported]).name

    assert (resolved(anywhere, None), resolved(head_major, None)) == ("LBNHC", "LBHNC")
    assert (resolved(anywhere, kvferry), resolved(head_major, kvferry)) == ("LBHNC", "LBHNC")
    assert (
        KvferryConnector.get_required_kvcache_layout(SimpleNamespace(model_config=SimpleNamespace(use_mla=True)))
        is None
    )
    assert resolved(anywhere, kvferry, mla=True) == "LBNHC"  # no preference: the backend's own
