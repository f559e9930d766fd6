"""kvferry doctor: what it reports on this machine, its --json schema, a refused transport's
reason, the session key check (it makes no key), UCX's answer, and --peer against a probe
endpoint started here."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import kvferry
import pytest
from kvferry import doctor
from kvferry.errors import InvalidArgumentError
from kvferry.transports import registry

NO_CUDA = {"available": False, "devices": 0, "torch_cuda": None, "reason": "no CUDA device visible (test)"}
TOP = {"schema", "host", "versions", "cuda", "transports", "ucx", "limits", "authkey"}


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "authkey"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def test_report_tells_this_machine(key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = doctor.report(authkey_file=str(key), ucx_puts=False)
    assert set(r) == TOP and r["schema"] == doctor.SCHEMA_VERSION
    assert r["versions"]["kvferry"] == kvferry.__version__ and r["versions"]["torch"] == metadata.version("torch")
    assert [t["name"] for t in r["transports"]] == list(registry.names())
    nofile, memlock = resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = r["limits"]
    assert (lim["nofile_soft"], lim["nofile_hard"]) == tuple(None if v == resource.RLIM_INFINITY else v for v in nofile)
    assert lim["memlock_soft"] == (None if memlock[0] == resource.RLIM_INFINITY else memlock[0])
    st = os.statvfs("/dev/shm")
    assert lim["shm_bytes"] == st.f_frsize * st.f_blocks
    assert 0 <= lim["shm_free_bytes"] <= lim["shm_bytes"]
    assert r["authkey"] == {
        "path": str(key),
        "source": "authkey_file",
        "exists": True,
        "mode": "0600",
        "owner_uid": os.geteuid(),
        "ok": True,
        "reason": None,
    }
    text = doctor.format_report(r)
    assert f"kvferry {kvferry.__version__}" in text and f"session key (authkey_file): {key}, mode 0600" in text
    # How many staging rings of the connector's default sizes the free /dev/shm holds.
    free = {**r, "limits": {**lim, "shm_free_bytes": (3 << 30) + (5 << 20)}}
    assert "staging rings (vLLM connector's default sizes) in /dev/shm's " in doctor.format_report(free)
    assert ": 3 of 1.0 GiB (CUDA caches), 48 of 64.0 MiB (CPU caches)" in doctor.format_report(free)


def test_a_refused_transport_gives_registry_checks_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_cuda", lambda: dict(NO_CUDA))
    rows = {t["name"]: t for t in doctor.report(ucx_puts=False)["transports"]}
    with pytest.raises(InvalidArgumentError) as refused:
        registry.check("cuda-ipc", device="cpu")
    assert (
        rows["cuda-ipc"]["runs"] == []
        and rows["cuda-ipc"]["reason"] == f"{refused.value} (no CUDA device visible (test))"
    )
    assert rows["shm"] == {"name": "shm", "devices": ["cpu"], "reach": "on one host", "runs": ["cpu"], "reason": None}
    assert (
        rows["staging"]["runs"] == ["cpu"]
        and rows["staging"]["reason"] == "not for cuda pools: no CUDA device visible (test)"
    )


def test_key_problems_are_named_and_nothing_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    r = doctor.report(ucx_puts=False)["authkey"]
    assert r["path"] == str(runtime / "kvferry" / "authkey") and r["exists"] is False and r["ok"] is False
    assert "the first vLLM server to start makes it" in r["reason"]
    assert list(runtime.iterdir()) == []  # doctor made no key (the connector's loader would have)
    loose = tmp_path / "loose"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    r = doctor.report(authkey_file=str(loose), ucx_puts=False)["authkey"]
    assert r["ok"] is False and r["reason"] == "mode 0644 lets group or others in (chmod 600)"
    assert loose.stat().st_mode & 0o777 == 0o644


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed")
def test_ucx_answers_which_transport_carries_a_host_put(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_cuda", lambda: dict(NO_CUDA))
    ucx = doctor.report(ucx_puts=True)["ucx"]
    assert ucx["present"] and ucx["version"] and ucx["version"][0].isdigit()
    put = ucx["puts"]["host_to_host"]
    assert put["bit_exact"] is True and put["transports"] and all("/" in t for t in put["transports"]), put
    assert put["protocol"].startswith("remote memory write by ucp_put") and put["protocol"].endswith(
        "from host memory to host"
    )
    assert ucx["puts"]["vram_to_vram"] == {"reason": "not asked: no CUDA device visible (test)"}


@pytest.fixture
def probe(key: Path) -> Iterator[str]:
    """A probe endpoint (doctor --serve's) serving one probe, in a thread."""
    ready = threading.Event()
    where: list[str] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            doctor.serve_probes(
                listen="tcp://127.0.0.1:0",
                advertise=None,
                transport="staging",
                authkey_file=str(key),
                count=1,
                ready=lambda a: (where.append(a), ready.set()),
            )
        except BaseException as err:  # shown by the test
            errors.append(err)
            ready.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(60) and not errors, errors
    yield where[0]
    thread.join(60)
    assert not thread.is_alive() and not errors, errors


def test_peer_handshake_and_bit_exact_transfer_through_the_cli(probe: str, key: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry.cli",
            "doctor",
            "--json",
            "--no-ucx",
            "--peer",
            probe,
            "--authkey-file",
            str(key),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert set(r) == TOP | {"peer"}
    p = r["peer"]
    assert set(p) == {"url", "ok", "handshake_ms", "transfer_ms", "bytes", "gbps", "verdict", "reason"}
    assert p["ok"] is True and p["reason"] is None and p["url"] == probe
    total = doctor.PROBE["layers"] * doctor.PROBE["blocks"]
    assert p["verdict"] == f"bit-exact: {total} of {total} block-layers equal"
    assert p["bytes"] == total * doctor.PROBE["words"] * 4 and p["handshake_ms"] > 0 and p["gbps"] > 0


def test_peer_reports_bytes_that_differ(probe: str, key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prober derives its pattern first, the probe after the blocks landed: the prober's
    copy is altered in one word, and the probe must see that block-layer differ."""
    real, calls = doctor._pattern, []

    def pattern(seed: str) -> Any:
        p = real(seed)
        if not calls:
            p[1, 5, 17] ^= 1
        calls.append(seed)
        return p

    monkeypatch.setattr(doctor, "_pattern", pattern)
    p = doctor.probe_peer(probe, authkey_file=str(key))
    total = doctor.PROBE["layers"] * doctor.PROBE["blocks"]
    assert p["ok"] is False and p["verdict"] == p["reason"] == f"FAILED: 1 of {total} block-layers differ", p


def test_peer_with_another_key_fails_naming_the_keys(probe: str, key: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    p = doctor.probe_peer(probe, authkey_file=str(other))
    assert p["ok"] is False and "authentication failed" in p["reason"] and "different keys" in p["reason"], p
    assert doctor.probe_peer(probe, authkey_file=str(key))["ok"]  # the probe serves on: its one probe


def test_exit_status_says_whether_the_host_can_run_what_was_checked(
    key: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Status 1 and one line on stderr naming each problem when a server on this host would
    fail (a key file the connector refuses, a named one that is missing); 0 when a default key
    file is only not made yet (the first server makes it)."""
    from kvferry.cli import main

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert main(["doctor", "--no-ucx"]) == 0 and capsys.readouterr().err == ""
    assert main(["doctor", "--no-ucx", "--authkey-file", str(key)]) == 0 and capsys.readouterr().err == ""
    key.chmod(0o644)
    assert main(["doctor", "--no-ucx", "--authkey-file", str(key)]) == 1
    out, err = capsys.readouterr()
    assert "NOT USABLE: mode 0644 lets group or others in (chmod 600)" in out
    assert err == (
        f"kvferry doctor: this host cannot run what was checked: session key {key}: "
        "mode 0644 lets group or others in (chmod 600)\n"
    )
    missing = tmp_path / "none"
    assert main(["doctor", "--no-ucx", "--json", "--authkey-file", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["authkey"]["exists"] is False
    assert err.startswith(f"kvferry doctor: this host cannot run what was checked: session key {missing}: cannot stat")


def test_problems_name_a_put_that_was_not_bit_exact(key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_cuda", lambda: dict(NO_CUDA))
    r = doctor.report(authkey_file=str(key), ucx_puts=False)
    assert doctor.problems(r) == []
    put = {"transports": ["cma/memory"], "protocol": "p", "ranges": [], "bit_exact": False}
    r["ucx"]["puts"] = {"host_to_host": put, "vram_to_vram": {"reason": "not asked"}}
    assert doctor.problems(r) == ["UCX host-to-host put: the bytes that arrived differ from those sent"]
