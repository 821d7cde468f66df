"""Where a process's threads spend their wall time: every thread's Python
stack sampled at a fixed interval by a daemon thread (``sys._current_frames``),
counted, and written as collapsed stacks (``thread;outer;...;inner count``
per line, what flamegraph.pl and speedscope read) when the process stops.

For a host where py-spy cannot run (no ptrace, nothing to install: a lent
GPU host). A sample says where each thread *is*, running or blocked: a
thread waiting for Triton to take a response sits in the call that sends it,
one waiting for the device in the call that synchronizes. So the shares are
of wall time per thread, not of CPU (the /proc CPU columns of the benches
give that).

On in a Triton stub when ``$SIMPLE_SAMPLER_STACKS_DIR`` names a directory in
the server's environment (``bench serve-gpu-served --stacks`` sets it to
``LOG_DIR/stacks/MODE``); the llm model writes ``DIR/llm-<pid>.stacks``. Each sample holds the GIL for tens of
microseconds: at the default 200 Hz, well under 1% of a core.

    python -m simple_sampler.stacks DIR/llm-1234.stacks   # share per thread, top frames

Standard library only.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

STACKS_ENV = "SIMPLE_SAMPLER_STACKS_DIR"
INTERVAL_S = 0.005
#: frames kept per stack, innermost first: deeper ones are the stub's own
#: entry points, the same in every sample
MAX_DEPTH = 48


def _frame_label(code, line: int) -> str:
    path = code.co_filename
    # the package's modules by their path inside it, others by file name
    marker = "simple_sampler" + os.sep
    short = path[path.rindex(marker):] if marker in path else os.path.basename(path)
    return f"{code.co_name} ({short}:{line})"


class StackSampler:
    """Samples every other thread's stack each ``interval_s`` until
    :meth:`stop`, which writes the counts to ``path``."""

    def __init__(self, path: str | os.PathLike, interval_s: float = INTERVAL_S):
        self.path = Path(path)
        self.interval_s = interval_s
        self.counts: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    @classmethod
    def from_env(cls, name: str) -> "StackSampler | None":
        """Started, writing ``$SIMPLE_SAMPLER_STACKS_DIR/<name>.stacks``; None
        when the variable is unset."""
        directory = os.environ.get(STACKS_ENV)
        if not directory:
            return None
        return cls(Path(directory) / f"{name}.stacks").start()

    def start(self) -> "StackSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < MAX_DEPTH:
                    stack.append((frame.f_code, frame.f_lineno))
                    frame = frame.f_back
                self.counts[(names.get(ident, f"thread-{ident}"), tuple(stack))] += 1
            self.samples += 1

    def stop(self) -> Path:
        """Stop sampling and write the collapsed stacks (outermost frame first)."""
        self._stop.set()
        self._thread.join()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as out:
            for (name, stack), count in self.counts.most_common():
                frames = ";".join(_frame_label(code, line) for code, line in reversed(stack))
                out.write(f"{name};{frames} {count}\n")
        return self.path


def summary(path: str | os.PathLike, top: int = 12) -> list[str]:
    """Per thread: its samples, and the innermost frames it sat in most
    (self), each with its share of the thread's samples."""
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in Path(path).read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        name, *frames = stack.split(";")
        per_thread[name][frames[-1] if frames else "-"] += int(count)
    lines = []
    for name, leaves in sorted(per_thread.items(), key=lambda item: -sum(item[1].values())):
        total = sum(leaves.values())
        lines.append(f"{name}: {total} samples")
        lines += [f"  {100 * count / total:5.1f}%  {leaf}" for leaf, count in leaves.most_common(top)]
    return lines


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(f"# {argument}")
        print("\n".join(summary(argument)))
