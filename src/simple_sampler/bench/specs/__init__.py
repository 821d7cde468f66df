"""The benches' specs (bench/spec.py), one module each: a module here with a
SPEC is a bench, found by discovery, so that adding one touches no list."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from ..spec import BenchSpec


@cache
def registry() -> dict[str, BenchSpec]:
    """Every bench's spec by name, in name order."""
    specs = [importlib.import_module(f"{__name__}.{module.name}").SPEC
             for module in pkgutil.iter_modules(__path__)]
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.name)}
