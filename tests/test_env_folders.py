"""The Python backend's environment folders a killed tritonserver leaves
(/tmp/python_env_*, launch/processes.py): removed by the launcher that
ended it, never while a live server could own one."""
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simple_sampler.launch.processes import (OWNER_CLOCK_SLACK_S, _possible_env_owners,
                                             remove_orphaned_env_folders, started_at)


@pytest.fixture
def started():
    """Start a process from a command; (its pid, the clock before and after its start)."""
    processes = []

    def start(command: list[str], wait_for: str | None = None):
        before = time.time()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        processes.append(process)
        if wait_for is not None:
            assert process.stdout.readline().strip() == wait_for
        return process.pid, before, time.time()

    yield start
    for process in processes:
        process.kill()
        process.wait()


def test_started_at_is_when_the_process_started(started):
    pid, before, after = started(["sleep", "30"])
    # /proc/stat's boot time is whole seconds: at most a second early
    assert before - 1.05 <= started_at(pid) <= after
    assert abs(started_at(os.getpid()) - started_at()) < 1e-6


def test_a_server_by_its_name_or_its_library_may_own_a_folder(started, tmp_path):
    named, _, _ = started(["bash", "-c", "exec -a tritonserver sleep 30"])
    library = tmp_path / "libtriton_python.so"
    library.write_bytes(b"\0" * 4096)
    mapping, _, _ = started([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({str(library)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True); time.sleep(30)")], wait_for="mapped")
    other, _, _ = started(["sleep", "30"])
    deadline = time.monotonic() + 30
    while _argv0(named) != "tritonserver":  # bash has exec'd, however loaded the host
        assert time.monotonic() < deadline, f"bash never exec'd: {_argv0(named)!r}"
        time.sleep(0.02)
    owners = _possible_env_owners()
    assert started_at(named) in owners and started_at(mapping) in owners
    assert started_at(other) not in owners  # a process like any other


def _argv0(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().split(b"\0")[0].decode()


def test_an_orphaned_folder_goes_and_a_live_servers_stays(tmp_path):
    pattern = str(tmp_path / "python_env_*")
    orphan = tmp_path / "python_env_orphan"
    orphan.mkdir()
    made = max(orphan.stat().st_mtime, orphan.stat().st_ctime)
    # a process that started before the folder was made, or within the clock's slack
    # after it, may own it: kept
    assert remove_orphaned_env_folders(made - 60, pattern, [made - 5]) == []
    assert remove_orphaned_env_folders(made - 60, pattern, [made + OWNER_CLOCK_SLACK_S]) == []
    # made before this launcher started: not its to remove
    assert remove_orphaned_env_folders(made + 1, pattern, []) == []
    # a folder with an environment extracted into it: kept
    full = tmp_path / "python_env_full"
    full.mkdir()
    (full / "env").mkdir()
    # every possible owner started after it was made: an orphan, removed
    later = made + OWNER_CLOCK_SLACK_S + 1
    assert remove_orphaned_env_folders(made - 60, pattern, [later]) == [str(orphan)]
    assert not orphan.exists() and full.exists()
    not_folder = tmp_path / "python_env_file"
    not_folder.write_text("")
    assert remove_orphaned_env_folders(made - 60, pattern, []) == []
    assert not_folder.exists()


def test_the_sweep_never_raises_into_a_stop(monkeypatch, capsys):
    from simple_sampler.launch import processes

    def broken(pid="self"):
        raise StopIteration("no btime line")

    monkeypatch.setattr(processes, "started_at", broken)
    assert processes.remove_orphaned_env_folders() == []
    assert "could not sweep the Python backend's folders" in capsys.readouterr().out


def test_a_killed_server_leaves_no_env_folder_where_no_other_server_runs():
    """Through a real server: the folders its Python backend made are gone
    once kill() returns, unless another tritonserver is running (which may
    own them: another test's, beside this one)."""
    from simple_sampler.launch import processes
    from simple_sampler.launch.serve import assemble_in_temp
    from simple_sampler.launch.server import TritonServer
    from simple_sampler.settings import SamplerSettings

    before = set(glob.glob(processes.PYTHON_ENV_FOLDERS))
    server = TritonServer(assemble_in_temp(SamplerSettings(), None), temporary_repository=True)
    try:
        server.start()
        made = set(glob.glob(processes.PYTHON_ENV_FOLDERS)) - before
        assert made  # the Python backend's, as it initialized
        server.kill()
        left = made & set(glob.glob(processes.PYTHON_ENV_FOLDERS))
        others = [pid for pid, state, _, _, argv in processes._processes()
                  if state != b"Z" and argv and Path(argv[0]).name == processes.SERVER_EXECUTABLE]
        assert not left or others, left
    finally:
        server.stop()
