"""Where the Triton server, its Python backend and our files are.

Two layouts are supported:

* the ``nvidia-pytriton`` wheel (PyPI), which carries a real Triton server
  (``pytriton/tritonserver/bin/tritonserver``), its shared libraries
  (``nvidia_pytriton.libs``), the Python backend and one backend stub per
  Python version;
* an NGC container, where the server is ``/opt/tritonserver/bin/tritonserver``
  and the Python backend (with the stub built for the container's Python) is
  ``/opt/tritonserver/backends/python``.

``$TRITONSERVER`` names a server binary explicitly. The backend directory a
server is started with must hold ``python/`` (libtriton_python.so, the stub
matching this interpreter, triton_python_backend_utils.py) and our
``simple_sampler/model.py``; :func:`assemble_backends` builds one.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

NGC_ROOT = Path("/opt/tritonserver")
STUB_NAME = "triton_python_backend_stub"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


class InstallError(RuntimeError):
    """Something a server needs is missing; the message says what and how to fix it."""


@dataclass(frozen=True)
class TritonInstall:
    """server: the tritonserver binary; library_dirs: what LD_LIBRARY_PATH
    needs; python_backend: directory with libtriton_python.so; stub: the
    backend stub for this Python (None when python_backend has its own)."""

    server: Path
    library_dirs: tuple[Path, ...]
    python_backend: Path
    stub: Path | None


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_install() -> TritonInstall | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    server = root / "bin" / "tritonserver"
    if not server.is_file():
        return None
    stub = root / "python_backend_stubs" / python_version() / STUB_NAME
    if not stub.is_file():
        available = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise InstallError(
            f"nvidia-pytriton has no Python backend stub for Python {python_version()} "
            f"(it has {', '.join(available)}); use one of those Python versions")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(server, (libs,) if libs.is_dir() else (), root / "backends" / "python",
                         stub)


def find_triton() -> TritonInstall:
    """The server to run: $TRITONSERVER, else the nvidia-pytriton wheel, else NGC's."""
    explicit = os.environ.get("TRITONSERVER")
    if explicit:
        server = Path(explicit)
        if not server.is_file():
            raise InstallError(f"TRITONSERVER={explicit} is not a file")
        root = server.parent.parent
        return TritonInstall(server, (root / "lib",), root / "backends" / "python", None)
    install = _pytriton_install()
    if install is not None:
        return install
    server = NGC_ROOT / "bin" / "tritonserver"
    if server.is_file():
        return TritonInstall(server, (NGC_ROOT / "lib",), NGC_ROOT / "backends" / "python", None)
    raise InstallError(
        "no tritonserver found: install the wheel that carries one "
        "(pip install nvidia-pytriton==0.7.0), run inside an NGC tritonserver container, "
        "or set TRITONSERVER to the binary")


def project_file(relative: str) -> Path:
    """A file of this project's checkout (backends/, model_repository/).

    $SIMPLE_SAMPLER_HOME names the checkout (Docker images set it); otherwise
    the checkout this package was installed from in editable mode.
    """
    home = os.environ.get("SIMPLE_SAMPLER_HOME")
    root = Path(home) if home else Path(__file__).resolve().parents[3]
    path = root / relative
    if not path.exists():
        raise InstallError(f"{path} not found: set SIMPLE_SAMPLER_HOME to the simple-sampler "
                           f"checkout (the directory with backends/ and model_repository/)")
    return path


def assemble_backends(destination: Path, install: TritonInstall) -> Path:
    """Fill `destination` with python/ (backend + stub) and simple_sampler/."""
    python = destination / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        source = install.python_backend / name
        if not source.is_file():
            raise InstallError(f"the Python backend file {source} is missing")
        shutil.copy2(source, python / name)
    stub = install.stub or install.python_backend / STUB_NAME
    if not stub.is_file():
        raise InstallError(f"the Python backend stub {stub} is missing")
    shutil.copy2(stub, python / STUB_NAME)
    ours = destination / "simple_sampler"
    ours.mkdir(exist_ok=True)
    shutil.copy2(project_file("backends/simple_sampler/model.py"), ours / "model.py")
    return destination


def is_system_library_dir(path: str | None) -> bool:
    """True for the dynamic loader's default directories (/lib, /usr/lib, their
    64-bit and multiarch variants), which need no LD_LIBRARY_PATH entry."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    defaults = {f"{root}{suffix}" for root in ("/lib", "/usr/lib")
                for suffix in ("", "64", *([f"/{multiarch}"] if multiarch else []))}
    return bool(path) and os.path.normpath(path) in defaults
