"""The output formats, one module each (docs/adding-a-format.md), and the targets. This registry
imports every module of the package that defines `FORMAT` and registers it; `register` adds one
from outside (a test, a plugin). Nothing outside a format's module compares its name. Standard
library only: the command line builds `--format`'s choices and help from here while torch loads.
"""

from __future__ import annotations

import importlib
import pkgutil

from mla_convert.formats.format import (
    IGNORED,
    INT4,
    QUANTIZED,
    Becomes,
    Format,
    ScaleLayout,
    all_formats,
    find,
    get,
    names,
    register,
    registered,
    seal_built_ins,
    target,
    unregister,
)
from mla_convert.formats.targets import DEFAULT_TARGET, TARGETS, Target

__all__ = [
    "DEFAULT_FORMAT",
    "DEFAULT_TARGET",
    "IGNORED",
    "INT4",
    "QUANTIZED",
    "TARGETS",
    "Becomes",
    "Format",
    "ScaleLayout",
    "Target",
    "all_formats",
    "find",
    "get",
    "names",
    "register",
    "registered",
    "target",
    "unregister",
]


def _register_builtins() -> None:
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FORMAT", None), Format):
            register(module.FORMAT)
    seal_built_ins()


_register_builtins()
DEFAULT_FORMAT = names()[0]
