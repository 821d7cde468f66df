#!/usr/bin/env bash
# The offline bundle's installer (scripts/offline_bundle.sh copies it to
# OUT/install.sh): run on the target, a GPU host without network, from the
# bundle's folder. Nothing is downloaded.
#
#   ./install.sh DEST [--python PY]
#
# PY (default python3) is the host's Python 3.12 whose CUDA torch is used.
# Checks first, each failure saying what to do: Python 3.12, torch,
# transformers (tokenizers, --engine torch), gcc and Python.h (the kernels are
# compiled here, for this CPU), Cython and setuptools (the build),
# libpython3.12.so.1.0 (the Triton stub links it; the bundle's copy is used
# when the host has none), /dev/shm's size (a warning). Then: DEST/venv over
# the host's torch (a .pth after the venv's own site-packages, as
# scripts/install.sh --host-torch makes it), the bundle's Triton set and
# overlay (numpy 1.26, tritonclient, llguidance) unpacked into it, the project in
# DEST/simple-sampler with its kernels built in place, a `simple-sampler`
# command, DEST/cache (SIMPLE_SAMPLER_CACHE) holding SmolLM2's tokenizer and
# the files of the bundle's cache/ folder if it has one (`scripts/gpu_bench.sh
# --prepare`'s real rows), and checks that the stubs' environment (an isolated
# interpreter, as the Python backend runs it) imports numpy below 2, the
# kernels and llguidance and loads the tokenizer, and that tritonserver and the stub find
# every library. Prints the line to source: DEST/env.sh.
set -euo pipefail

bundle="$(cd "$(dirname "$0")" && pwd)"
python=python3
dest=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python="$2"; shift ;;
        -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
        *) dest="$1" ;;
    esac
    shift
done
if [ -z "$dest" ]; then
    sed -n '6p' "$0" >&2
    exit 2
fi
fail() { echo "install.sh: $*" >&2; exit 1; }
SHM_WANTED_KB=$((1024 * 1024))  # 2 sampler instances and the others' pools: about 0.5 GB

# -- checks -----------------------------------------------------------------
command -v "$python" > /dev/null || fail "no $python: give --python the host's Python 3.12"
version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$version" = 3.12 ] || fail "$python is Python $version: the bundle's Triton stub embeds" \
    "Python 3.12; give --python the host's Python 3.12 (the one with its CUDA torch)"
torch_site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" \
    || fail "$python cannot import torch (above): give --python the Python 3.12 whose torch to use"
"$python" -c 'import transformers' || fail "$python cannot import transformers (above): the" \
    "tokenizers and --engine torch's models need it: copy its wheels here and pip install them"
command -v gcc > /dev/null || fail "no gcc: the sampling kernels are compiled on this host" \
    "(Ubuntu: apt install gcc, from a local mirror or a .deb)"
include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[ -f "$include/Python.h" ] || fail "no $include/Python.h: the kernels' build needs Python's" \
    "headers (Ubuntu: python3.12-dev)"
"$python" -c 'import Cython, setuptools' 2> /dev/null || fail "$python lacks Cython or" \
    "setuptools, which build the kernels: copy their wheels here and pip install them" \
    "(pip download Cython setuptools where there is network)"
libdir="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
libpython_dir=""
if [ ! -e "$libdir/libpython3.12.so.1.0" ] && ! ldconfig -p 2> /dev/null | grep -q 'libpython3\.12\.so\.1\.0 '; then
    [ -f "$bundle/libpython3.12.so.1.0.xz" ] || fail "no libpython3.12.so.1.0 on this host" \
        "and none in the bundle: install it (Ubuntu: libpython3.12t64) or rebuild the bundle" \
        "with --python a Python 3.12 that has one"
    libpython_dir="$dest/lib"
    echo "install.sh: no libpython3.12.so.1.0 on this host: the bundle's copy goes to $libpython_dir"
fi
shm_kb="$(df -Pk /dev/shm 2> /dev/null | awk 'NR == 2 {print $4}')"
if [ -z "$shm_kb" ] || [ "$shm_kb" -lt "$SHM_WANTED_KB" ]; then
    echo "install.sh: warning: /dev/shm has ${shm_kb:-no} KiB free; serving with 2 sampler" \
         "instances wants about 1 GiB (docs/GPU.md, \"Serving details\"): enlarge it or use" \
         "fewer --instances" >&2
fi

# -- install ----------------------------------------------------------------
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
[ -z "$libpython_dir" ] || libpython_dir="$dest/lib"
# --without-pip: nothing is pip-installed here, and venv's ensurepip is a
# separate package on some distributions (Ubuntu: python3.12-venv).
"$python" -m venv --without-pip "$dest/venv"
venv_python="$dest/venv/bin/python"
"$venv_python" - "$bundle" "$dest" "$torch_site" "$libpython_dir" <<'EOF'
import lzma
import shutil
import sys
import sysconfig
import tarfile
from pathlib import Path

bundle, dest, torch_site, libpython_dir = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
site = Path(sysconfig.get_path("purelib"))
for part, where in (("triton.tar.xz", site), ("overlay.tar.xz", site),
                    ("project.tar.xz", dest / "simple-sampler"), ("tokenizer.tar.xz", dest / "cache")):
    where.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle / part) as tar:
        tar.extractall(where, filter="data")
if (bundle / "cache").is_dir():
    shutil.copytree(bundle / "cache", dest / "cache", dirs_exist_ok=True)
if libpython_dir:
    Path(libpython_dir).mkdir(parents=True, exist_ok=True)
    with lzma.open(bundle / "libpython3.12.so.1.0.xz") as packed:
        (Path(libpython_dir) / "libpython3.12.so.1.0").write_bytes(packed.read())
# After the venv's own site-packages: numpy 1.26 and the overlay first, the
# host's torch (and what else only the host has) still found.
(site / "simple-sampler-host-torch.pth").write_text(
    f"import site; site.addsitedir({torch_site!r})\n")
(site / "simple-sampler-src.pth").write_text(str(dest / "simple-sampler" / "src") + "\n")
# The host's scipy and scikit-learn are built for numpy 2: under the venv's
# numpy 1.26 scipy fails at import (np.long), and transformers imports
# scikit-learn (which imports scipy) when it finds it, as 5.17's generation
# utilities do at import (seen on the first GPU host, 2026-11-28). None in
# sys.modules makes both absent: find_spec says None, import raises
# ModuleNotFoundError. Nothing the stubs run needs either.
(site / "simple-sampler-numpy1-guard.pth").write_text(
    "import sys; [sys.modules.setdefault(name, None) for name in ('scipy', 'sklearn')]\n")
command = dest / "venv" / "bin" / "simple-sampler"
command.write_text(f"#!{dest}/venv/bin/python\nimport sys\nfrom simple_sampler.cli import main\n"
                   "sys.exit(main())\n")
command.chmod(0o755)
EOF
echo "install.sh: building the kernels for this CPU"
(cd "$dest/simple-sampler" && "$venv_python" setup.py --quiet build_ext --inplace) \
    || fail "the kernels' build failed (above)"
lib_path="${libpython_dir:+$libpython_dir:}"
cat > "$dest/env.sh" <<EOF
# simple-sampler from the offline bundle: source this file, then run simple-sampler.
export PATH="$dest/venv/bin:\$PATH"
export SIMPLE_SAMPLER_CACHE="\${SIMPLE_SAMPLER_CACHE:-$dest/cache}"
${libpython_dir:+export LD_LIBRARY_PATH="$libpython_dir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"}
EOF

# -- checks of the result -----------------------------------------------------
# The stubs' environment: the venv's interpreter isolated (-I), as the Python
# backend starts it (PYTHONPATH ignored, .pth files honoured).
LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:-}" SIMPLE_SAMPLER_CACHE="$dest/cache" "$venv_python" -I -c '
import sys
import numpy, torch, tritonclient.grpc, tritonclient.http, ml_dtypes
from transformers import AutoModelForCausalLM, GenerationMixin  # the static and torch engines
import llguidance, llguidance.hf  # structured outputs (serving/structured.py)
import simple_sampler._sampling as kernels
from simple_sampler import models
from simple_sampler.serving.text import load_tokenizer
if int(numpy.__version__.split(".")[0]) >= 2:
    sys.exit(f"install.sh: the stubs would import numpy {numpy.__version__} ({numpy.__file__}): "
             "Triton 2.51s Python 3.12 stub crashes on numpy 2")
print("install.sh: the stubs import numpy", numpy.__version__, "from", numpy.__file__)
print("install.sh: torch", torch.__version__, "from", torch.__file__, "cuda", torch.cuda.is_available())
print("install.sh: kernels", kernels.__file__)
llguidance.LLMatcher.grammar_from_json_schema("{\"type\": \"object\"}")
print("install.sh: llguidance", llguidance.__file__)
print("install.sh: tokenizer of", len(load_tokenizer()), "tokens in", models.cache_dir())
' || fail "the stubs' environment is not usable (above)"
site="$("$venv_python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
triton="$site/pytriton/tritonserver"
for binary in "$triton/bin/tritonserver" "$triton/python_backend_stubs/3.12/triton_python_backend_stub"; do
    missing="$(LD_LIBRARY_PATH="$lib_path$site/nvidia_pytriton.libs:$libdir" ldd "$binary" \
               | grep 'not found' || true)"
    [ -z "$missing" ] || fail "$(basename "$binary") lacks libraries: $missing"
done
echo "install.sh: done. Run:"
echo "  source $dest/env.sh"
echo "  simple-sampler serve --engine torch --device cuda --model DIR --openai-port 0 \\"
echo "      --demo \"What is the capital of France?\""
echo "(DIR: a Hugging Face checkpoint on this host; the bundle carries no weights and no"
echo "fastapi/uvicorn for the OpenAI-compatible API, hence --openai-port 0). Without a"
echo "checkpoint: --engine static --model-config NAME (a shipped shape, random weights),"
echo "whose text is the bundle's SmolLM2 tokenizer in $dest/cache."
