"""The Python backend's environment folders a killed tritonserver leaves
(/tmp/python_env_*, launch/processes.py): removed by the launcher that
ended it, never while a live server could own one."""
import os
import time

from simple_sampler.launch.processes import remove_orphaned_env_folders, started_at


def test_started_at_is_this_process_start():
    assert time.time() - 24 * 3600 * 365 < started_at() <= time.time()
    assert abs(started_at(os.getpid()) - started_at()) < 1e-6


def test_an_orphaned_folder_goes_and_a_live_servers_stays(tmp_path):
    pattern = str(tmp_path / "python_env_*")
    orphan = tmp_path / "python_env_orphan"
    orphan.mkdir()
    made = orphan.stat().st_mtime
    # a server that started before the folder was made may own it: kept
    assert remove_orphaned_env_folders(made - 60, pattern, [made - 5]) == []
    # made before this launcher started: not its to remove
    assert remove_orphaned_env_folders(made + 1, pattern, []) == []
    # a folder with an environment extracted into it: kept
    full = tmp_path / "python_env_full"
    full.mkdir()
    (full / "env").mkdir()
    # every live server started after it was made: an orphan, removed
    assert remove_orphaned_env_folders(made - 60, pattern, [made + 5]) == [str(orphan)]
    assert not orphan.exists() and full.exists()
    not_folder = tmp_path / "python_env_file"
    not_folder.write_text("")
    assert remove_orphaned_env_folders(made - 60, pattern, []) == []
    assert not_folder.exists()
