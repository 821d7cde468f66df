"""Benchmarks behind `simple-sampler bench ...`: figures measured side by side in one run.

A bench is a package here, bench/NAME/ (docs/INTERNALS.md, "Adding a bench"):
its `__init__` is its spec, `SPEC = BenchSpec(...)` (bench/spec.py), a light
module that imports its measuring code (NAME/measuring.py, which may import
torch) only inside `measure` and `table`, since building the command line
imports every spec. The plain modules beside them (calibrate and perf, commands
of their own, and the benches' shared helpers) are no bench; floor/ is a
Triton model folder.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from .spec import BenchSpec


@cache
def registry() -> dict[str, BenchSpec]:
    """Every bench's spec by name, in name order, found by discovery so that
    adding a bench touches no list: each package in bench/ is a bench and must
    have a SPEC; the plain modules are not imported."""
    specs = [importlib.import_module(f"{__name__}.{found.name}").SPEC
             for found in pkgutil.iter_modules(__path__) if found.ispkg]
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.name)}
