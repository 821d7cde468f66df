"""Where a Python backend stub's CPU goes: ``execute`` under cProfile on the
stub's own thread clock (``time.thread_time``: CPU, not wall time, so a
loaded machine does not inflate it), one ``.prof`` file per model instance
written when the model unloads.

On when ``$SIMPLE_SAMPLER_PROFILE`` names a directory, in the environment
the server starts with (docs/COPIES.md, "Profiling the sampler stub")::

    SIMPLE_SAMPLER_PROFILE=/tmp/prof simple-sampler bench row-transport ...
    python -m pstats /tmp/prof/simple_sampler_0_0.prof   # sort tottime, stats 20
    python -m simple_sampler.triton.stub_profile /tmp/prof  # calls per request

The wrapper sees only the Python side of ``execute`` (our decode, the
kernels, pb_utils calls); the stub's C++ work between calls (reading the
request from shared memory, sending the response) shows in /proc CPU time
only.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import re
import sys
import time
from pathlib import Path

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


#: What ``calls_per_request`` lists: the request (``serve_request``), the
#: C path's share of it (the llm model's compact form), the general path's
#: decoding and sampling, their checks, the fallback's full-row sampling,
#: and the metric round trips.
PROFILED_FUNCTIONS = ("serve_request", "decide_plain_compact", "decode_request",
                      "sample_request", "sample_compact", "_check_compact", "sample", "increment")


def calls_per_request(paths) -> dict:
    """From stub profiles (one or more instances' ``.prof``): requests (calls
    of ``serve_request``), Python calls per request in all, and for each of
    PROFILED_FUNCTIONS its calls per request and its cumulative share of
    ``execute``'s CPU time. Counts do not depend on the machine's load;
    the shares do, somewhat."""
    stats = pstats.Stats(*paths)  # the instances' same functions added up
    by_name = {}
    for (_, _, name), (_, calls, _, cumulative, _) in stats.stats.items():
        # C functions by their own name: "<method 'get' of 'dict' objects>",
        # "<built-in method c_python_backend_utils.increment>" (Metric.increment)
        c_function = re.match(r"<(?:built-in )?method '?(?:\w+\.)*(\w+)", name)
        found = by_name.setdefault(c_function.group(1) if c_function else name, [0, 0.0])
        found[0] += calls
        found[1] += cumulative
    requests = by_name.get("serve_request", [0])[0]
    if not requests:
        raise ValueError(f"no serve_request call in {', '.join(map(str, paths))}")
    execute_s = by_name["_execute"][1]  # what StubProfile.run profiles
    # hot-first: one request a step (B <= 128), by the C path (tried for compact
    # requests only) or the general one
    compact = max(by_name.get(name, [0])[0] for name in ("decide_plain_compact", "sample_compact"))
    return {"requests": requests, "calls_per_request": stats.total_calls / requests,
            "compact_requests": compact,
            "calls_per_compact_request": stats.total_calls / compact if compact else None,
            "functions": {name: {"calls_per_request": by_name.get(name, [0])[0] / requests,
                                 "share": by_name.get(name, [0, 0.0])[1] / execute_s}
                          for name in PROFILED_FUNCTIONS}}


def main(argv: list[str]) -> int:
    # a directory stands for the profiles in it (what $SIMPLE_SAMPLER_PROFILE named)
    paths = [str(found) for path in argv
             for found in (sorted(Path(path).glob("*.prof")) if Path(path).is_dir() else [path])]
    summary = calls_per_request(paths)
    print(f"{summary['requests']} requests, {summary['calls_per_request']:.0f} Python calls "
          f"per request in execute")
    if summary["compact_requests"]:
        print(f"{summary['compact_requests']} of them compact: "
              f"{summary['calls_per_compact_request']:.0f} Python calls in all per compact "
              f"request (every request's calls over the compact ones)")
    for name, found in summary["functions"].items():
        print(f"  {name:<16} {found['calls_per_request']:6.2f} calls/request  "
              f"{found['share']:6.1%} of execute (cumulative)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
