"""Imported before torch by every module that needs it (and by the subpackages that do), so
that without torch an import of any of them raises `kvferry.errors.MissingDependencyError`,
one line naming the extra to install, instead of a bare ``ModuleNotFoundError``."""

from kvferry._optional import require

require("torch")
