"""Packaging: the extras agree with requirements-dev.txt, the version is the installed one,
and a missing optional dependency is one line naming the extra to install."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kvferry
import pytest
from helpers import TINY_MODEL, cli_argv
from kvferry._optional import EXTRAS, missing_message, require
from kvferry.errors import KvFerryError, MissingDependencyError

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> dict[str, str]:
    """requirements-dev.txt as {name: the whole requirement}."""
    rows = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = line.split(next((c for c in "<>=!~[ " if c in line), " "), 1)[0]
            rows[name.lower()] = line
    return rows


def _pyproject() -> dict:  # type: ignore[type-arg]
    tomllib = pytest.importorskip("tomllib")
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def test_extras_match_requirements_dev() -> None:
    project, dev = _pyproject(), _requirements()
    extras = project["optional-dependencies"]
    assert {"torch", "bench", "nixl", "proxy", "test"} <= set(extras)
    assert any(r.startswith("matplotlib") for r in extras["bench"]) and any(
        r.startswith("torch") for r in extras["bench"]
    )
    for group in (project["dependencies"], *(extras[name] for name in ("torch", "bench", "nixl", "proxy", "test"))):
        for requirement in group:
            name = requirement.split(next(c for c in "<>=!~" if c in requirement), 1)[0].lower()
            assert dev.get(name) == requirement, (
                f"pyproject.toml says {requirement!r}, requirements-dev.txt {dev.get(name)!r}"
            )


def test_every_optional_module_has_an_extra() -> None:
    extras = _pyproject()["optional-dependencies"]
    for module, (extra, _) in EXTRAS.items():
        name = extra.split("[")[1].rstrip("]")
        assert any(r.startswith(module) for r in extras[name]), (module, extra)


def test_version_is_the_installed_distribution() -> None:
    assert kvferry.__version__ == metadata.version("kvferry")
    assert "__version__" in kvferry.__all__


def test_version_fallback_without_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert kvferry._version() == "0+unknown"


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails as if absent
    with pytest.raises(MissingDependencyError) as err:
        require("matplotlib", "the timeline PNG (--png)")
    assert isinstance(err.value, ImportError) and isinstance(err.value, KvFerryError)
    assert (
        str(err.value)
        == "the timeline PNG (--png) needs matplotlib, which is not installed: pip install 'kvferry[bench]'"
    )
    assert err.value.name == "matplotlib"


def test_require_passes_other_import_errors_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed module whose own dependency is missing is not reported as the extra."""
    (tmp_path / "kvferry_fake_extra.py").write_text("import kvferry_fake_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRAS, "kvferry_fake_extra", ("kvferry[bench]", "a test"))
    with pytest.raises(ModuleNotFoundError) as err:
        require("kvferry_fake_extra")
    assert not isinstance(err.value, MissingDependencyError)
    assert err.value.name == "kvferry_fake_missing_dependency"


# Runs with torch (or another module) made unimportable, the way an install without the extra
# would see it.
BLOCK = "import sys; sys.modules[{module!r}] = None; "


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT)


@pytest.mark.parametrize(
    "module",
    [
        "kvferry.copy",
        "kvferry.engine",
        "kvferry.sender",
        "kvferry.transports.shm",
        "kvferry.refengine.serving",
        "kvferry.bench.agentic",
    ],
)
def test_library_import_without_torch(module: str) -> None:
    proc = _python(
        BLOCK.format(module="torch")
        + f"""
import kvferry  # the planner needs no torch
try:
    import {module}
except kvferry.MissingDependencyError as err:
    print(err)
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == missing_message("torch")
    assert "pip install 'kvferry[torch]'" in proc.stdout


@pytest.mark.parametrize(
    "module, argv, extra",
    [
        ("torch", ["bench", "agentic"], "kvferry[torch]"),
        ("torch", ["bench", "copy"], "kvferry[torch]"),
        (
            "matplotlib",
            cli_argv("bench", "agentic", sessions=1, turns=1, cached=64, new=16, output=2, **TINY_MODEL),
            "kvferry[bench]",
        ),
        (
            "nixl",
            [
                "bench",
                "copy",
                "--transport",
                "nixl",
                "--blocks",
                "2",
                "--layers",
                "1",
                "--block-kib",
                "4",
                "--reps",
                "1",
            ],
            "kvferry[nixl]",
        ),
    ],
    ids=["agentic-torch", "copy-torch", "png-matplotlib", "copy-nixl"],
)
def test_cli_missing_dependency_one_line_exit_2(module: str, argv: list[str], extra: str, tmp_path: Path) -> None:
    if module == "matplotlib":
        argv = [*argv, "--png", str(tmp_path / "t.png")]
    proc = _python(BLOCK.format(module=module) + f"from kvferry.cli import main; sys.exit(main({argv!r}))")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len([line for line in lines if not line.startswith("[bench ")]) == 1, proc.stderr  # progress lines aside
    assert lines[-1].startswith("kvferry bench: error: ") and f"pip install '{extra}'" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvferry {kvferry.__version__}"


def test_plan_needs_no_torch() -> None:
    """The planner and `kvferry plan` run on numpy alone."""
    argv = ["plan", "--tokens-per-block", "4", "--prompt", "32", "--reused", "12"]
    proc = _python(BLOCK.format(module="torch") + f"from kvferry.cli import main; sys.exit(main({argv!r}))")
    assert proc.returncode == 0, proc.stderr
    assert "exact-once: 8 of 8 needed blocks sent" in proc.stdout
