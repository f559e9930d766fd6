"""Optional dependencies. kvferry's planner (`kvferry._core`, `kvferry plan`) needs only
numpy; the rest needs an extra, and a missing one is reported in one line that names it:

```
torch       kvferry[torch]   the data plane (pools, copies, engines, transports), the
                             reference engine and every `kvferry bench`
matplotlib  kvferry[bench]   the timeline PNG of `kvferry bench agentic --png`
nixl        kvferry[nixl]    the NIXL transport
aiohttp     kvferry[proxy]   `kvferry proxy` (it needs no vLLM)
```
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

from kvferry.errors import MissingDependencyError

__all__ = ["EXTRAS", "missing_message", "require"]

# module -> (the extra that installs it, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("kvferry[torch]", "kvferry's data plane (pools, copies, transports) and its benches"),
    "matplotlib": ("kvferry[bench]", "the timeline PNG"),
    "nixl": ("kvferry[nixl]", "the NIXL transport"),
    "aiohttp": ("kvferry[proxy]", "kvferry proxy"),
}


def missing_message(module: str, what: Optional[str] = None) -> str:
    """The one-line message for a missing optional ``module`` (a key of `EXTRAS`)."""
    extra, needs = EXTRAS[module]
    return f"{what or needs} needs {module}, which is not installed: pip install '{extra}'"


def require(module: str, what: Optional[str] = None) -> ModuleType:
    """Imports ``module`` (a key of `EXTRAS`), or raises `MissingDependencyError` saying which
    extra to install. A module that is installed but fails to import for another reason (a
    broken dependency of its own) raises its own error, unchanged."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module and not (err.name or "").startswith(module + "."):
            raise
        raise MissingDependencyError(missing_message(module, what), name=module) from None
