"""Where a Python backend stub's CPU goes: ``execute`` under cProfile on the
stub's own thread clock (``time.thread_time``: CPU, not wall time, so a
loaded machine does not inflate it), one ``.prof`` file per model instance
written when the model unloads.

On when ``$SIMPLE_SAMPLER_PROFILE`` names a directory, in the environment
the server starts with (docs/COPIES.md, "Profiling the sampler stub")::

    SIMPLE_SAMPLER_PROFILE=/tmp/prof simple-sampler bench row-transport ...
    python -m pstats /tmp/prof/simple_sampler_0_0.prof   # sort tottime, stats 20

The wrapper sees only the Python side of ``execute`` (our decode, the
kernels, pb_utils calls); the stub's C++ work between calls (reading the
request from shared memory, sending the response) shows in /proc CPU time
only.
"""
from __future__ import annotations

import cProfile
import os
import re
import time

PROFILE_ENV = "SIMPLE_SAMPLER_PROFILE"


class StubProfile:
    """Profiles calls made through ``run`` when $SIMPLE_SAMPLER_PROFILE is
    set; ``dump`` writes ``<dir>/<instance>.prof``. Otherwise ``run`` just calls."""

    def __init__(self, instance: str):
        self.directory = os.environ.get(PROFILE_ENV, "")
        self.path = os.path.join(self.directory, re.sub(r"[^\w.-]", "_", instance) + ".prof")
        self.profiler = cProfile.Profile(time.thread_time) if self.directory else None

    def run(self, function, *args):
        if self.profiler is None:
            return function(*args)
        return self.profiler.runcall(function, *args)

    def dump(self) -> str | None:
        """The .prof file written, or None when profiling is off."""
        if self.profiler is None:
            return None
        os.makedirs(self.directory, exist_ok=True)
        self.profiler.dump_stats(self.path)
        return self.path
