"""Package exports imported on first use (PEP 562): ``lazy_exports`` builds a package's
``__getattr__``, ``__dir__`` and ``__all__`` from where each name lives, so that importing one of
its light modules (a config, for the command line) does not import the heavy ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, Sequence[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package`` whose name N lives in
    ``package.M`` for every M: (N, ...) of ``homes`` (or in M itself where M is a full
    ``rlinfluence.`` module name: a building block below the package)."""
    module_of = {name: module for module, names in homes.items() for name in names}
    exported = sorted(module_of)

    def getattr_(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = module_of[name]
        return getattr(importlib.import_module(module if module.startswith("rlinfluence.") else f"{package}.{module}"),
                       name)

    return getattr_, lambda: exported, exported
