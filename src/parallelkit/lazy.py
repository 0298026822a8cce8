"""Public names a package hands on from its rooms when first used (PEP 562), so that importing one room loads no
other: the `adapters` and `optimizers` doors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from typing import Any


def handed_on(package: str, rooms: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name of `rooms` (name -> the room, a submodule, holding it) imported
    from its room when first asked for, and kept."""

    def __getattr__(name: str) -> Any:
        if name not in rooms:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{rooms[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
