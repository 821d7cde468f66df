"""The llm stub's decode-loop profile (cProfile, ``llm_service.PROFILE_ENV``)
read as calls per token by function: counts, not times, so they do not move
with the machine's load."""
from __future__ import annotations

import os
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..triton.llm_service import PROFILE_ENV

#: Functions listed per profile, most calls per token first.
PROFILE_TOP = 30


@contextmanager
def server_directory(variable: str, directory: str | os.PathLike | None) -> Iterator[None]:
    """With `directory` (made, absolute), `variable` names it for the servers
    started inside (their stubs read it at start); the variable as it was
    after. Without, nothing changes."""
    if not directory:
        yield
        return
    previous = os.environ.get(variable)
    Path(directory).mkdir(parents=True, exist_ok=True)
    os.environ[variable] = str(Path(directory).resolve())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(variable)
        else:
            os.environ[variable] = previous


def llm_profiles(profile_dir: str | None):
    """With `profile_dir`, the servers started inside profile their llm
    stub's decode loop into it (PROFILE_ENV)."""
    return server_directory(PROFILE_ENV, profile_dir)


def profile_calls(path: Path, tokens: int, server: str = "", top: int = PROFILE_TOP) -> dict:
    """The decode-loop thread's calls per token from its cProfile file:
    in total and by function (cProfile's count: Python functions and the
    C functions Python code calls directly; a C function called from C,
    e.g. through a ``functools.partial``, is not counted). What is paid per
    token counts the same on any machine under any load, where times do not
    (what is paid per step, the event loop's callbacks, moves a little with
    how the steps interleave). `server` labels the server it was read from."""
    stats = pstats.Stats(str(path))
    by_function = sorted(((calls / tokens, function_name(function))
                          for function, (_, calls, *_rest) in stats.stats.items()),
                         reverse=True)
    return {"server": server, "file": str(path), "tokens": tokens,
            "calls_per_token": stats.total_calls / tokens,
            "top": [[name, per_token] for per_token, name in by_function[:top]]}


def function_name(function: tuple[str, int, str]) -> str:
    """file:line(name) with the file's name alone (the servers' model
    directories are temporary); a C function as pstats names it."""
    file, line, name = function
    return pstats.func_std_string(function) if file == "~" else f"{Path(file).name}:{line}({name})"


def format_profile(profile: dict) -> str:
    lines = [f"decode-loop calls per token ({profile['server']}, {profile['tokens']} tokens, "
             f"{profile['file']}): {profile['calls_per_token']:.1f}"]
    lines += [f"  {per_token:7.2f}  {name}" for name, per_token in profile["top"]]
    return "\n".join(lines)
