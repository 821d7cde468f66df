"""scripts/offline_bundle.sh and the installer it ships (scripts/offline_install.sh):
the cheap parts only. The target's checks refuse a wrong host before anything
is made, each saying what to do; the overlay keeps the stubs' environment below
numpy 2. Building the bundle (about 3 min of one core: lzma preset 9 over
110 MB) and installing it are not run here (docs/GPU.md, "Without network")."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = ROOT / "scripts" / "offline_install.sh"


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
