#!/usr/bin/env bash
# The offline bundle: everything a GPU host without network needs to serve
# with Triton 2.51 from the nvidia-pytriton wheel, over the host's own Python
# 3.12 and CUDA PyTorch (docs/GPU.md, "Without network";
# ../shared/design/OFFLINE_GPU.md has the facts it rests on). Run where PyPI is
# reachable, in a checkout where `make install` has run (any Linux, any Python
# >= 3.10 with pip for --python); copy OUT to the target and run OUT/install.sh
# there.
#
#   scripts/offline_bundle.sh OUT [--python PY] [--fast]
#
# --fast packs with lzma preset 0 instead of 9: seconds instead of about 3
# minutes of one core, and a bundle about a third larger, so the 45 MiB budget
# is checked at preset 9 only (tests/test_offline_bundle.py builds with it).
#
# OUT gets, at most 45 MiB together (checked at the end):
#   triton.tar.xz       the minimal Triton set: tritonserver, the Python backend,
#                       the Python 3.12 stub, the wheel's bundled libraries but
#                       its 3.13 libpython, in the wheel's own layout
#                       (pytriton/tritonserver/..., nvidia_pytriton.libs/), which
#                       launch/install.py finds by `pytriton` on sys.path
#   overlay.tar.xz      cp312 wheels unpacked (--no-deps --target), .so
#                       stripped, test suites left out: numpy 1.26 (the stub
#                       crashes on numpy 2), tritonclient and what its grpc and
#                       http clients import, llguidance (structured outputs)
#   tokenizer.tar.xz    SmolLM2's tokenizer and config, no weights, as the
#                       checkout's .venv converted them (models.cache_dir()):
#                       the text of --engine simulated and of --model-config's
#                       random-weight shapes (serving/engines.py)
#   libpython3.12.so.1.0.xz
#                       the 3.12 stub links it; a stock host may lack it
#                       (written when PY is a 3.12 with a shared library)
#   project.tar.xz      this checkout's tracked files (git archive HEAD)
#   install.sh          scripts/offline_install.sh: the target's installer
#   MANIFEST            what is in each file, with the versions
set -euo pipefail

python=python3
out=""
xz_preset=9
budget_bytes=$((45 * 1024 * 1024))  # at preset 9
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python="$2"; shift ;;
        --fast) xz_preset=0; budget_bytes=unchecked ;;
        -*) echo "offline_bundle.sh: unknown option $1" >&2; exit 2 ;;
        *) out="$1" ;;
    esac
    shift
done
if [ -z "$out" ]; then
    sed -n '10p' "$0" >&2
    exit 2
fi
project="$(cd "$(dirname "$0")/.." && pwd)"

PYTRITON=nvidia-pytriton==0.7.0
# The versions OFFLINE_GPU.md tested with numpy 1.26 and the 3.12 stub. Pinned:
# ml_dtypes 0.6 requires numpy >= 2; tritonclient 2.73's generated code
# requires protobuf >= 6.33.5 and grpcio >= 1.81.1. No aiohttp: only the
# asyncio HTTP client (client/aio.py with http) uses it, and serve does not.
OVERLAY=(numpy==1.26.4 ml_dtypes==0.5.4 tritonclient==2.73.0 grpcio==1.85.3
         protobuf==6.33.6 python-rapidjson==1.25 gevent==26.9.0 geventhttpclient==2.6.1
         greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1 urllib3==2.8.0
         certifi==2026.10.19.post1 packaging==26.4 llguidance==1.9.1)
# Wheels for the target, not for this machine: CPython 3.12 on x86-64 Linux.
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
        --abi none --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)

work="$(mktemp -d "${TMPDIR:-/tmp}/simple-sampler-bundle-XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

echo "offline_bundle.sh: downloading $PYTRITON and the overlay's wheels (cp312)"
"$python" -m pip download --quiet --no-deps "${TARGET[@]}" --dest "$work/wheels" "$PYTRITON" \
    "${OVERLAY[@]}"
# --no-compile: the packing leaves __pycache__ out, so byte-compiling is wasted.
"$python" -m pip install --quiet --no-deps --no-compile "${TARGET[@]}" --target "$work/overlay" \
    "${OVERLAY[@]}" --no-index --find-links "$work/wheels"
if command -v strip > /dev/null; then
    # Debug symbols: a third of some of these libraries, never used on the target.
    find "$work/overlay" -name '*.so*' -type f -exec strip --strip-unneeded {} + 2> /dev/null || true
fi
rm -rf "$work/overlay/bin"  # console scripts with this machine's interpreter in them
# The packages' own test suites, never imported on the target: their room
# carries llguidance.
find "$work/overlay" -depth -type d -name tests -exec rm -rf {} +
# ... and out of each wheel's RECORD too (with bin/'s scripts), so that pip
# check and uninstall on the target see no missing file.
"$python" - "$work/overlay" <<'EOF_RECORD'
import csv, io, sys
from pathlib import Path

root = Path(sys.argv[1])
for record in root.glob("*.dist-info/RECORD"):
    rows = list(csv.reader(io.StringIO(record.read_text())))
    kept = [row for row in rows if row and (root / row[0]).exists()]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(kept)
    record.write_text(text.getvalue())
EOF_RECORD

# SmolLM2's converted directory (made from its GGUF on first use), whose
# tokenizer files the bundle carries.
venv_python="$project/.venv/bin/python"
[ -x "$venv_python" ] || { echo "offline_bundle.sh: no $venv_python: run \`make install\`" \
    "first (SmolLM2's tokenizer comes from the checkout's environment)" >&2; exit 1; }
smollm2_dir="$("$venv_python" -c 'from simple_sampler import models
from simple_sampler.serving.text import load_tokenizer
load_tokenizer()  # converts the GGUF when the directory is not there yet
print(models.cache_dir() / models.SMOLLM2_CACHE_NAME)')"

git -C "$project" archive --format=tar HEAD > "$work/project.tar"
cp "$project/scripts/offline_install.sh" "$out/install.sh"
chmod +x "$out/install.sh"

"$python" - "$work" "$out" "$project" "$budget_bytes" "$xz_preset" "$smollm2_dir" <<'EOF'
"""Packs the parts (lzma, no xz binary is needed on either side)."""
import glob
import io
import lzma
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

work, out, project, budget = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
preset, smollm2_dir = int(sys.argv[5]), Path(sys.argv[6])
#: Model files the bundle leaves out: the host brings a checkpoint (--model DIR).
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf")
STUB = "pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub"
TRITON_FILES = ("pytriton/tritonserver/bin/tritonserver",
                "pytriton/tritonserver/backends/python/libtriton_python.so",
                "pytriton/tritonserver/backends/python/triton_python_backend_utils.py", STUB)


def xz_tar(path: Path, members) -> None:
    """members: (name in the archive, bytes, mode)."""
    with lzma.open(path, "wb", preset=preset) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))


def wheel_members(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        for entry in archive.infolist():
            name = entry.filename
            keep = name in TRITON_FILES or (name.startswith("nvidia_pytriton.libs/")
                                            and not entry.is_dir() and "libpython3" not in name)
            if keep:
                # Executable bits live in the zip's external attributes (unix mode << 16).
                yield name, archive.read(entry), (entry.external_attr >> 16) & 0o777 or 0o644


def tree_members(root: Path, under: str = ""):
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            name = str(Path(under, path.relative_to(root)))
            yield name, path.read_bytes(), path.stat().st_mode & 0o777


[wheel] = glob.glob(str(work / "wheels" / "nvidia_pytriton-*.whl"))
triton = list(wheel_members(Path(wheel)))
assert {n for n, _, _ in triton} >= set(TRITON_FILES), "the wheel's layout changed"
xz_tar(out / "triton.tar.xz", triton)
xz_tar(out / "overlay.tar.xz", tree_members(work / "overlay"))
tokenizer = [m for m in tree_members(smollm2_dir, smollm2_dir.name)
             if not any(Path(m[0]).match(pattern) for pattern in WEIGHTS)]
assert any(name.endswith("/tokenizer.json") for name, _, _ in tokenizer), f"no tokenizer in {smollm2_dir}"
xz_tar(out / "tokenizer.tar.xz", tokenizer)
with lzma.open(out / "project.tar.xz", "wb", preset=preset) as packed:
    packed.write((work / "project.tar").read_bytes())

libpython = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent") / "libpython3.12.so.1.0"
if sys.version_info[:2] == (3, 12) and libpython.is_file():
    stripped = work / libpython.name
    shutil.copyfile(libpython, stripped)
    if shutil.which("strip"):  # its debug symbols are four fifths of it
        subprocess.run(["strip", "--strip-unneeded", str(stripped)], check=True)
    with lzma.open(out / "libpython3.12.so.1.0.xz", "wb", preset=preset) as packed:
        packed.write(stripped.read_bytes())
else:
    print(f"offline_bundle.sh: no libpython3.12.so.1.0 fallback ({sys.executable} is not a "
          f"Python 3.12 with a shared library): the target must have its own", file=sys.stderr)
    (out / "libpython3.12.so.1.0.xz").unlink(missing_ok=True)

overlay = sorted(p.name for p in (work / "overlay").iterdir() if p.name.endswith(".dist-info"))
sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.name != "MANIFEST"}
lines = [f"{name} {size}" for name, size in sizes.items()]
lines += ["", f"triton: {Path(wheel).name} ({len(triton)} files)", "overlay: " + " ".join(overlay),
          "tokenizer: " + " ".join(name for name, _, _ in tokenizer), f"lzma preset: {preset}"]
(out / "MANIFEST").write_text("\n".join(lines) + "\n")
total = sum(p.stat().st_size for p in out.iterdir())
print(f"offline_bundle.sh: {out} holds {total / 2**20:.1f} MiB in {len(sizes) + 1} files")
if budget == "unchecked":
    print(f"offline_bundle.sh: lzma preset {preset} (--fast): the 45 MiB budget is not checked")
elif total > int(budget):
    sys.exit(f"offline_bundle.sh: {total} bytes, over the budget of {budget} (45 MiB)")
EOF
