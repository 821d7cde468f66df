"""Whether a process is alive, by its pid: the one check the row arena's
orphan sweep, TensorRT-LLM's worker watching its owner and the launcher's
stop and supervisor all make.

Standard library only, and importing it imports nothing else of the package
(``simple_sampler/__init__`` loads its names lazily): the lifeline watcher
(``launch/lifeline.py``), which must start in milliseconds, reaches it
through ``launch/processes.py``."""
from __future__ import annotations


def alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (dead, not yet reaped:
    ``kill(pid, 0)`` would still succeed on it), read from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
