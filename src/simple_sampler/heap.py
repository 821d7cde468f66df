"""The garbage collector in a serving process: its heap frozen once the
process is ready, so that a full collection no longer walks it.

A process that has imported torch, transformers and a tokenizer holds
hundreds of thousands of objects the collector tracks (the llm stub serving
SmolLM2: 400,427; docs/results/gc-freeze-2026-11-29.md). CPython's full
collection walks every one of them (176 ms there, on the project's 2-core
host), holding the GIL, so the decode loop and every other thread of the
process stand still for that long, each time the objects surviving since the
last walk reach a quarter of those it walked (CPython's rule for a full one).
``gc.freeze`` moves the objects alive now into a permanent generation that no collection walks; what the process
allocates later is collected as before. vLLM ends its warm-up the same way
(``compile_or_warm_up_model`` calls ``freeze_gc_heap``), SGLang offers a
``freeze_gc`` for its processes, and AIPerf freezes its timing processes.

Standard library only: a Triton stub calls :func:`freeze` last in its
``initialize``. A bench measuring several cells in one process brackets each
cell with :func:`frozen`, which thaws the heap again when the cell ends, so
that the cell's engine, and on a GPU its cache, can still be collected.
:class:`PauseClock` times the collections that still run.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Iterator

log = logging.getLogger(__name__)


def freeze(context: str) -> int:
    """Collect the garbage there is, then freeze every object still alive
    (``gc.freeze``); returns the number frozen (``gc.get_freeze_count``).
    Logs how many and what the collection before it took: about what each
    full collection would have cost the process from then on."""
    started = time.perf_counter()
    gc.collect()
    collected_ms = 1e3 * (time.perf_counter() - started)
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of the garbage collector's walks (a full "
             "collection over them took %.0f ms)", context, frozen, collected_ms)
    return frozen


@contextlib.contextmanager
def frozen(context: str) -> Iterator[int]:
    """:func:`freeze` for the body of the ``with``, then ``gc.unfreeze``: the
    objects frozen go back to the oldest generation, to be collected once
    they are garbage (an engine in a reference cycle, its device memory
    with it)."""
    try:
        yield freeze(context)
    finally:
        gc.unfreeze()


class PauseClock:
    """The collections run since :meth:`install`, by generation, and the
    seconds they took (``gc.callbacks``): while one runs it holds the GIL,
    so every thread of the process waits that long. The llm model reports
    the seconds as ``simple_llm_gc_pause_us_total``; the served benches
    turn it into milliseconds per step."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def install(self) -> "PauseClock":
        gc.callbacks.append(self._on_collection)
        return self

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.collections[info["generation"]] += 1
