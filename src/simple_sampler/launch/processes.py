"""A Triton server's processes, read from /proc, and how to end them all.

Standard library and ``simple_sampler.pids`` only, imported by path (not
through the package) by the lifeline watcher (lifeline.py), which must start
in milliseconds and must not import numpy or the kernels: it only reads
/proc, signals processes and removes files in /dev/shm.
"""
from __future__ import annotations

import glob
import os
import re
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

# Absolute: the lifeline loads this file by its path, outside the package.
from simple_sampler.pids import alive

STUB_EXECUTABLE = "triton_python_backend_stub"
SERVER_EXECUTABLE = "tritonserver"
SHM_DIRECTORY = Path("/dev/shm")
#: The folder Triton's Python backend makes for its environments, one for each
#: backend built on it, as it initializes (python_backend's pb_env.cc,
#: EnvironmentManager: mkdtemp of a hard-coded /tmp/python_env_XXXXXX, which
#: TMPDIR does not move) and removes as it finalizes: a killed server leaves it.
PYTHON_ENV_FOLDERS = "/tmp/python_env_*"
#: A process mapping one of these may be a Triton server (one that makes such folders).
TRITON_LIBRARIES = (b"libtriton_python.so", b"libtritonserver.so")
#: How much later than a folder's time a process may have started and still own it
#: (whole-second timestamps, a clock stepped between the two).
OWNER_CLOCK_SLACK_S = 2.0


@dataclass(frozen=True)
class Stub:
    """One model instance's process, as read from its command line:
    ``stub <repo>/<model>/<version>/model.py <shm region> <size> <growth>
    <parent pid> <python lib dir> <ipc timeout> <instance name> <runtime>``."""

    pid: int
    model: str
    instance: str
    shm_region: str

    @classmethod
    def from_cmdline(cls, pid: int, argv: list[str]) -> "Stub | None":
        if len(argv) < 9 or not argv[0].endswith(STUB_EXECUTABLE):
            return None
        return cls(pid, Path(argv[1]).parent.parent.name, argv[8], argv[2])


def _processes():
    """(pid, state, parent pid, process group, argv) of every readable process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        yield (int(entry.name), stat[0], int(stat[1]), int(stat[2]),
               [a.decode(errors="replace") for a in argv if a])


def list_stubs(server_pid: int) -> list[Stub]:
    """The live stub processes whose parent is `server_pid`."""
    stubs = []
    for pid, state, parent, _group, argv in _processes():
        if parent != server_pid or state == b"Z":
            continue
        stub = Stub.from_cmdline(pid, argv)
        if stub is not None:
            stubs.append(stub)
    return stubs


#: The Python backend's per-instance regions: ``triton_python_backend_shm_region_<uuid>``,
#: or ``triton_<backend>_shm_region_<uuid>`` for a backend built on it (simple_sampler's).
BACKEND_REGION = re.compile(r"^triton_\w*_shm_region_[0-9a-f-]+$")


def held_regions(pid: int) -> set[str]:
    """The backend regions (BACKEND_REGION) that process `pid` maps or holds
    open. Triton creates and maps a stub's region before it starts the stub,
    so a server stopped in that moment holds a region that no stub's command
    line names yet: its maps name it, and before it is sized and mapped (an
    empty file, which a CI run left behind: several models load at once)
    only its open file descriptors do."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            paths = [fields[5].removesuffix(" (deleted)").strip()
                     for line in maps.read().splitlines()
                     # address perms offset dev inode [path]
                     if len(fields := line.split(maxsplit=5)) == 6]
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for descriptor in descriptors:
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{descriptor}"))
        except OSError:  # closed meanwhile
            continue
    return {Path(path).name for path in paths
            if path.startswith(f"{SHM_DIRECTORY}/") and BACKEND_REGION.match(Path(path).name)}


def group_members(group: int) -> dict[int, list[str]]:
    """pid -> argv of the live processes of process group `group` (a server
    started in a session of its own: tritonserver and its stubs)."""
    return {pid: argv for pid, state, _parent, pgid, argv in _processes()
            if pgid == group and state != b"Z" and pid != os.getpid()}


def unlink_shm(regions) -> list[str]:
    """Remove the named shared-memory regions that still exist; returns them."""
    removed = []
    for region in regions:
        try:
            (SHM_DIRECTORY / region).unlink()
            removed.append(region)
        except FileNotFoundError:
            pass
        except OSError as error:
            print(f"could not remove shared memory {region}: {error}", flush=True)
    return removed


def end_group(group: int, arena_prefix: str = "", settle_s: float = 5.0) -> tuple[list[int], list[str]]:
    """SIGKILL every process of `group` and remove the shared memory its
    stubs held: each stub's region and the row arenas named
    ``<arena_prefix><stub pid>-...`` (row_arena.py). Returns (the pids
    killed, the regions removed).

    The group is frozen (SIGSTOP) first and listed again until no new member
    appears, so that no stub forked between the listing and the kill is
    missed; a killed process's regions are removed once it is gone (a stub
    still alive could map them again)."""
    frozen: dict[int, list[str]] = {}
    while True:
        fresh = {pid: argv for pid, argv in group_members(group).items() if pid not in frozen}
        if not fresh:
            break
        for pid in fresh:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen.update(fresh)
    stubs = [stub for pid, argv in frozen.items()
             if (stub := Stub.from_cmdline(pid, argv)) is not None]
    # Read while frozen: the regions of stubs Triton was just starting too.
    held = set().union(*(held_regions(pid) for pid in frozen)) if frozen else set()
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + settle_s
    while any(alive(pid) for pid in frozen) and time.monotonic() < deadline:
        time.sleep(0.02)
    arenas = tuple(f"{arena_prefix}{stub.pid}-" for stub in stubs) if arena_prefix else ()
    regions = sorted({stub.shm_region for stub in stubs} | held)
    if arenas:
        regions += sorted(name for name in os.listdir(SHM_DIRECTORY) if name.startswith(arenas))
    return sorted(frozen), unlink_shm(regions)


#: With every stub gone, how long before Triton's exit timeout what it still
#: holds (an ensemble) is ended (StubsUnloading).
ALL_GONE_MARGIN_S = 2.0


class StubsUnloading:
    """The stubs of a stopping Triton, watched for what it still holds after
    the drain. A client that keeps a gRPC stream open after its last
    response holds that request's model in Triton 2.51 until the stream
    ends: the model that answered it (``llm``) is never finalized, an ensemble never
    unloads, and Triton waits out its exit timeout, then exits with status
    1 (its gRPC server, which would close the stream, stops after the
    models). ``settled``: some stub has unloaded (Triton is unloading), and
    no stub has exited or given up its region for `held_s`, or every stub
    has and it is `all_gone_by` (time.monotonic(); None: never): what is
    still loaded then waits on clients, not on work (the caller checks that
    nothing is in flight). What is left once every stub is gone (an
    ensemble) has no work of its own, but Triton takes a moment to exit
    after its last stub, so it is ended only just before Triton's exit
    timeout (`exit_timeout_s` from now: made as Triton is signalled) would
    strike (ALL_GONE_MARGIN_S): stubs that took 7 s to unload under load
    left `held_s` no room before it."""

    def __init__(self, stubs, held_s: float, exit_timeout_s: float | None = None):
        self.stubs, self.held_s = list(stubs), held_s
        self.all_gone_by = (None if exit_timeout_s is None
                            else time.monotonic() + exit_timeout_s - ALL_GONE_MARGIN_S)
        self.last_change = time.monotonic()
        self.gone = 0

    def _unloaded(self, stub) -> bool:
        return not alive(stub.pid) and not (SHM_DIRECTORY / stub.shm_region).exists()

    def loaded(self) -> list[str]:
        return [stub.model for stub in self.stubs if not self._unloaded(stub)]

    def settled(self) -> bool:
        gone = sum(self._unloaded(stub) for stub in self.stubs)
        now = time.monotonic()
        if gone != self.gone:
            self.gone, self.last_change = gone, now
        all_gone = gone == len(self.stubs) and self.all_gone_by is not None and now >= self.all_gone_by
        return gone > 0 and (now - self.last_change >= self.held_s or all_gone)


def started_at(pid: int | str = "self") -> float:
    """When process `pid` started, in seconds since the epoch, at most a
    second early (/proc/stat gives the boot time in whole seconds)."""
    with open(f"/proc/{pid}/stat", "rb") as process:
        ticks = int(process.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/stat", "rb") as system:
        boot = next(int(line.split()[1]) for line in system if line.startswith(b"btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _possible_env_owners() -> list[float]:
    """When each live process of this user that may own a Python backend's
    environment folder started: a tritonserver by its name, and any process
    mapping Triton's libraries (a server under another name, Triton run in
    a Python process). One whose mappings cannot be read is not counted: a
    process of the same user hides them only when made non-dumpable (this
    host's init does), which Triton is not; counting it kept every folder."""
    starts = []
    for pid, state, _parent, _group, argv in _processes():
        if state == b"Z" or pid == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            if not (argv and Path(argv[0]).name == SERVER_EXECUTABLE):
                with open(f"/proc/{pid}/maps", "rb") as maps:
                    if not any(library in line for line in maps for library in TRITON_LIBRARIES):
                        continue
            starts.append(started_at(pid))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return starts


def remove_orphaned_env_folders(since: float | None = None, pattern: str = PYTHON_ENV_FOLDERS,
                                possible_owners: list[float] | None = None) -> list[str]:
    """Remove the Python backend's environment folders (PYTHON_ENV_FOLDERS)
    that a killed server left: this user's, made at or after `since`
    (default: this process's start, the launcher's), empty, and made more
    than OWNER_CLOCK_SLACK_S before every live process that may own one
    started (`possible_owners`: their starts; default: read from /proc after
    the folders are listed, so an owner of a listed folder is among them).
    An environment extracted into one keeps it (only an empty folder is
    removed). Never raises: a stop goes on whatever this meets. Returns the
    folders removed. A server in another PID namespace sharing /tmp is not
    seen: its folders made while this launcher ran could be taken."""
    try:
        since = started_at() if since is None else since
        folders = glob.glob(pattern)
        if possible_owners is None:
            possible_owners = _possible_env_owners() if folders else []
        removed = []
        for folder in folders:
            try:
                made = os.lstat(folder)
            except OSError:
                continue
            made_at = max(made.st_mtime, made.st_ctime)
            if (made.st_uid != os.getuid() or not stat.S_ISDIR(made.st_mode) or made_at < since
                    or any(start <= made_at + OWNER_CLOCK_SLACK_S for start in possible_owners)):
                continue
            try:
                os.rmdir(folder)
                removed.append(folder)
            except OSError:  # not empty, or removed meanwhile
                continue
        return removed
    except Exception as error:  # noqa: BLE001 - a stop must not fail on a leftover folder
        print(f"could not sweep the Python backend's folders {pattern}: {error!r}", flush=True)
        return []
