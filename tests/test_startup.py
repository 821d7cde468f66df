"""serve's start-up wait: the timeout per engine, the progress lines while a
model loads, and the library path the server is started with. The server is
a stand-in (tests/slow_tritonserver.py): its readiness comes after a delay, as
Triton's does while the llm model builds a TensorRT engine."""
from pathlib import Path

import pytest
import slow_tritonserver

from simple_sampler.serving import engines
from simple_sampler.launch.install import is_system_library_dir
from simple_sampler.launch.server import TritonServer


@pytest.fixture
def slow_install(tmp_path, monkeypatch):
    """An install whose 'tritonserver' loads its llm model for READY_AFTER_S seconds."""
    monkeypatch.setenv("READY_AFTER_S", "3")
    return slow_tritonserver.install(tmp_path)


def test_a_slow_model_load_is_waited_for_with_progress_lines(slow_install, tmp_path, capsys):
    server = TritonServer(tmp_path / "repository", install=slow_install)
    try:
        server.start(timeout=60, progress_s=1)
    finally:
        server.stop()
    progress = [line for line in capsys.readouterr().err.splitlines()
                if "waiting for tritonserver" in line]
    assert progress and all("of 60 s (--startup-timeout)" in line for line in progress)
    assert any("llm LOADING" in line for line in progress)


def test_a_startup_timeout_shorter_than_the_load_fails_naming_the_flag(slow_install, tmp_path):
    server = TritonServer(tmp_path / "repository", install=slow_install)
    try:
        with pytest.raises(TimeoutError, match=r"not ready after 1 s \(raise --startup-timeout"):
            server.start(timeout=1, progress_s=10)
        assert server.process.poll() is not None  # stopped
    finally:
        server.stop()


def test_the_default_startup_timeout_covers_an_engine_build():
    assert engines.startup_timeout("tensorrt_llm") == 1800
    assert engines.startup_timeout("torch") == engines.startup_timeout(None) == 180


def test_serve_refuses_a_non_positive_startup_timeout(capsys):
    from simple_sampler.cli import main

    assert main(["serve", "--sampler-only", "--startup-timeout", "0"]) == 2
    assert "startup_timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_system_library_directories_are_not_put_first_on_the_library_path():
    assert is_system_library_dir("/usr/lib/x86_64-linux-gnu/") or \
        not Path("/usr/lib/x86_64-linux-gnu").exists()
    assert is_system_library_dir("/usr/lib") and is_system_library_dir("/lib64")
    assert not is_system_library_dir("/root/.pyenv/versions/3.11.7/lib")
    assert not is_system_library_dir("/usr/local/lib") and not is_system_library_dir(None)
