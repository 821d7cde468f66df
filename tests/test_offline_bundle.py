"""scripts/offline_bundle.sh and the installer it ships (scripts/offline_install.sh).

The cheap parts: the target's checks refuse a wrong host before anything is
made, each saying what to do; the overlay keeps the stubs' environment below
numpy 2. The slow one: the bundle built (--fast), installed over a stand-in
for the GPU host (scripts/offline_host.sh: Python 3.12, torch, numpy 2, scipy), and
the simulated engine served from the bundle's own Triton, overlay and
tokenizer, answering one streamed request and one guided by the bundle's
llguidance, then stopped with nothing left."""
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simple_sampler import models
from simple_sampler.client import GenerateClient
from simple_sampler.launch.processes import alive, list_stubs, held_regions
from simple_sampler.launch.ports import free_ports
from simple_sampler.launch.supervisor import arena_regions
from simple_sampler.rows import ROWS_VERSION, SYNTHETIC_SOURCE_ROWS, real_rows

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = ROOT / "scripts" / "offline_install.sh"
#: Exit statuses of `scripts/offline_host.sh --where`.
NO_PYTHON312, NOT_MADE = 3, 4


def fake_python(tmp_path: Path, version: str, has_torch: bool) -> Path:
    """An interpreter that reports `version` and imports torch or not."""
    script = tmp_path / f"python-{version}"
    torch_answer = 'print("/host/site-packages")' if has_torch else 'raise ImportError("torch")'
    script.write_text(f"""#!{sys.executable}
import sys
code = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "-c" else ""
if "version_info" in code:
    print("{version}")
elif "torch" in code:
    {torch_answer}
""")
    script.chmod(0o755)
    return script


def install(tmp_path, python):
    return subprocess.run(["bash", str(INSTALLER), str(tmp_path / "dest"), "--python",
                           str(python)], capture_output=True, text=True, timeout=60)


def test_the_installer_refuses_another_python_than_the_stubs(tmp_path):
    result = install(tmp_path, fake_python(tmp_path, "3.11", has_torch=True))
    assert result.returncode == 1
    assert "is Python 3.11" in result.stderr and "give --python the host's Python 3.12" in \
        result.stderr
    assert not (tmp_path / "dest").exists()  # checked before anything is made


def test_the_installer_refuses_a_python_without_torch(tmp_path):
    result = install(tmp_path, fake_python(tmp_path, "3.12", has_torch=False))
    assert result.returncode == 1 and "cannot import torch" in result.stderr
    assert not (tmp_path / "dest").exists()


def test_the_overlay_keeps_numpy_below_2_and_ml_dtypes_that_allows_it():
    text = (ROOT / "scripts" / "offline_bundle.sh").read_text()
    overlay = re.search(r"OVERLAY=\((.*?)\)", text, re.S).group(1).split()
    pins = dict(p.split("==") for p in overlay)
    assert pins["numpy"].startswith("1.") and pins["ml_dtypes"] < "0.6"
    assert {"tritonclient", "grpcio", "protobuf", "python-rapidjson"} <= set(pins)


def host_python() -> str:
    """The GPU-host stand-in's python; a skip where this machine has no Python 3.12."""
    where = subprocess.run(["bash", str(ROOT / "scripts" / "offline_host.sh"), "--where"],
                           capture_output=True, text=True, timeout=60)
    if where.returncode == NO_PYTHON312:
        pytest.skip(where.stderr.strip())
    if where.returncode == NOT_MADE:
        pytest.fail(where.stderr.strip())
    assert where.returncode == 0, where.stderr
    return where.stdout.strip()


def run(command, **kwargs) -> str:
    """stdout of a command that must succeed (its output in the failure)."""
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True,
                            **kwargs)
    assert result.returncode == 0, f"{command[:2]}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result.stdout


def children(pid: int) -> list[int]:
    """The child processes of `pid`, whichever of its threads started them."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += map(int, (task / "children").read_text().split())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return found


@pytest.mark.slow
def test_the_bundle_installs_and_serves_the_simulated_engine_from_its_own_triton(tmp_path):
    python = host_python()
    bundle, dest = tmp_path / "bundle", tmp_path / "dest"
    run(["bash", ROOT / "scripts" / "offline_bundle.sh", bundle, "--python", python, "--fast"],
        timeout=600)
    parts = {"triton.tar.xz", "overlay.tar.xz", "tokenizer.tar.xz", "libpython3.12.so.1.0.xz",
             "project.tar.xz", "install.sh", "MANIFEST"}
    assert {p.name for p in bundle.iterdir()} == parts
    assert "smollm2-135m-instruct/tokenizer.json" in (bundle / "MANIFEST").read_text()
    # The simulated engine's bank is fitted to real SmolLM2 rows, which the
    # bundle does not carry (10.7 MiB): a cache/ folder beside it, as
    # `scripts/gpu_bench.sh --prepare` makes one, goes into DEST/cache.
    real_rows(SYNTHETIC_SOURCE_ROWS)
    (bundle / "cache").mkdir()
    # as gpu_bench.sh --prepare copies them (the prompts' hash in the name picks one)
    for rows in models.cache_dir().glob(f"real_rows-v{ROWS_VERSION}-*-n{SYNTHETIC_SOURCE_ROWS}.npy"):
        shutil.copy(rows, bundle / "cache")

    installed = run(["bash", bundle / "install.sh", dest, "--python", python], timeout=600)
    assert f"numpy 1.26.4 from {dest}/venv/" in installed
    assert f"tokenizer of 49152 tokens in {dest}/cache" in installed
    assert f"llguidance {dest}/venv/" in installed
    # The host's scipy and scikit-learn (built for numpy 2) import there and
    # are hidden from the stubs' environment, where they would fail on numpy 1.26.
    hidden = "import importlib.util as u; print([u.find_spec(n) is None for n in ('scipy', 'sklearn')])"
    assert run([python, "-c", hidden]).strip() == "[False, False]"
    assert run([dest / "venv" / "bin" / "python", "-I", "-c", hidden]).strip() == "[True, True]"

    ports = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k not in ("SIMPLE_SAMPLER_CACHE", "PYTHONPATH")}
    serve = subprocess.Popen(
        ["bash", "-c", f'source "{dest}/env.sh" && exec simple-sampler serve --engine simulated '
         f"--http-port {ports[0]} --grpc-port {ports[1]} --metrics-port {ports[2]} "
         f'--openai-port 0 --instances 1 --log "{tmp_path}/tritonserver.log"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    servers, regions = [], set()
    try:
        # serve's own start-up deadline ends it long before this one: a stall
        # shows as a failure here, not as a suite that never ends
        assert select.select([serve.stdout], [], [], 600)[0], "serve printed nothing in 600 s"
        ready = serve.stdout.readline()
        assert "Triton is ready (simulated data plane" in ready, ready + serve.stderr.read()
        [triton] = [pid for pid in children(serve.pid)
                    if os.readlink(f"/proc/{pid}/exe").endswith("/tritonserver")]
        assert os.readlink(f"/proc/{triton}/exe").startswith(f"{dest}/venv/")
        stubs = list_stubs(triton)
        servers = [triton, *(stub.pid for stub in stubs)]
        regions = held_regions(triton) | {stub.shm_region for stub in stubs}
        assert stubs and regions
        for stub in stubs:
            maps = Path(f"/proc/{stub.pid}/maps").read_text()
            assert f"{dest}/venv/lib/python3.12/site-packages/numpy/" in maps, stub.model

        chunks = list(GenerateClient(f"127.0.0.1:{ports[1]}", "grpc").stream(
            "What is the capital of France?", max_tokens=8, temperature=0.0))
        assert len(chunks) >= 2 and chunks[-1].finish_reason == "length"
        assert sum(len(chunk.token_ids) for chunk in chunks) == 8
        assert "".join(chunk.text for chunk in chunks).strip()
        # structured outputs from the bundle's llguidance, in the llm stub
        guided = list(GenerateClient(f"127.0.0.1:{ports[1]}", "grpc").stream(
            "Yes or no?", max_tokens=8, temperature=1.0, guided_decoding_guide_type="regex",
            guided_decoding_guide="(yes|no)"))
        assert "".join(chunk.text for chunk in guided) in ("yes", "no")
        assert guided[-1].finish_reason == "stop"
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            _, stderr = serve.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()  # its lifeline process then ends tritonserver and the stubs
            raise
    assert serve.returncode == 0, stderr
    assert "tritonserver stopped (status 0)" in stderr
    deadline = time.monotonic() + 10
    while any(map(alive, servers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in servers if alive(pid)]
    assert not {name for name in regions if Path("/dev/shm", name).exists()}
    assert not arena_regions(servers)
