"""The watch that ends a Triton server when its launcher dies without
warning (``kill -9``, the OOM killer, a CI timeout): run as a script by
``TritonServer.launch`` (server.py), in a session of its own, as

    python lifeline.py <read end of a pipe>

The launcher holds the pipe's only write end and writes into it, once the
server is started, tritonserver's pid, the server's backend copy and its
temporary repository (an empty line when the repository is not the
server's own), one a line; and "released" once it has ended the server
itself (a stop, or a supervisor's kill before a restart). Nothing has to run in the launcher for
the watch to work: when the launcher exits, however it exits, the kernel
closes its end and this process reads end-of-file. Then tritonserver's
process group (the server and its stubs, started in a session of their own)
is killed, the stubs' shared memory removed (processes.end_group) and,
unless the launcher said "released", the two folders too (and the Python
backend's environment folders the killed server left): a launcher that
ends its server itself removes them when it stops for good, and a
supervisor's restart reuses the repository. What a released server left
running (a stub slow to exit) is still ended.

Standard library only (processes.py adds ``simple_sampler.pids``, which
imports nothing else), and processes.py is loaded by its path, not through
the package's modules: those would import numpy and the kernels, seconds on
a loaded machine for a process that only waits.
"""
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path

#: The row arenas' name prefix before the owner pid (row_arena.PREFIX and the
#: pid namespace), passed by the launcher: the package is not imported here.
ARENA_PREFIX_ARG = 2


def _processes_module():
    path = Path(__file__).with_name("processes.py")
    spec = importlib.util.spec_from_file_location("simple_sampler_lifeline_processes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up by name
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    # Ctrl-C in the launcher's terminal, or a hang-up, is the launcher's to
    # handle; this process ends only with the launcher.
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    read_end, arena_prefix = int(argv[1]), argv[ARENA_PREFIX_ARG]
    received = b""
    while chunk := os.read(read_end, 64):
        received += chunk
    lines = received.decode(errors="replace").split("\n")
    server_pid, folders, released = lines[0], lines[1:3], "released" in lines[3:]
    if not server_pid.strip().isdigit():
        return 0  # the launcher went before it started a server
    processes = _processes_module()
    killed, removed = processes.end_group(int(server_pid), arena_prefix)
    if not released:  # a server killed now, or dead before its launcher, leaves them
        processes.remove_orphaned_env_folders()
    if not killed:
        return 0
    if released:
        print(f"simple-sampler lifeline: ended {len(killed)} process(es) {killed} that "
              f"tritonserver (pid {server_pid}) left", flush=True)
        return 0
    for folder in filter(None, folders):  # the launcher died with its server
        shutil.rmtree(folder, ignore_errors=True)
    print(f"simple-sampler lifeline: the launcher of tritonserver (pid {server_pid}) is gone; "
          f"killed {len(killed)} process(es) {killed}, removed shared memory "
          f"{removed or 'none'} and {' and '.join(filter(None, folders))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
