#!/usr/bin/env bash
# A stand-in for the offline bundle's GPU host on a machine without a GPU, for
# tests/test_offline_bundle.py (`make test` makes it through `make
# offline-host`): a Python 3.12 venv holding what such a host has
# (../shared/design/OFFLINE_GPU.md): torch, numpy 2, transformers, scipy,
# scikit-learn, Cython and setuptools. The torch is the project's pin (the
# model extra) from PyPI, which serves Linux only CUDA builds for Python 3.12:
# about 4.7 GB with its nvidia libraries, minutes with network. Made once
# per machine, beside the model cache ($SIMPLE_SAMPLER_CACHE, else
# ~/.cache/simple-sampler: offline-host-py312), for every checkout there, and
# again when those requirements change.
#
#   scripts/offline_host.sh           make it (nothing to do when it is made with
#                                     the same requirements)
#   scripts/offline_host.sh --where   print its python; exit 3 when this machine
#                                     has no Python 3.12, 4 when it is not made
#
# The Python 3.12: `python3.12` if it runs, else pyenv's newest 3.12.x (a pyenv
# shim refuses a version that is installed but not selected).
set -euo pipefail

project="$(cd "$(dirname "$0")/.." && pwd)"
host="${SIMPLE_SAMPLER_CACHE:-$HOME/.cache/simple-sampler}/offline-host-py312"
stamp="$host/.installed"  # holds the requirements it was made with

find_python312() {
    local candidate
    for candidate in python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
                                  2> /dev/null | sort -rV); do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2> /dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

case "${1:-}" in
    --where)
        python312="$(find_python312)" || { echo "no Python 3.12 on this machine (python3.12 on" \
            "PATH or pyenv's versions/3.12.x): the bundle's Triton stub embeds Python 3.12" >&2; exit 3; }
        [ -f "$stamp" ] || { echo "no GPU-host stand-in at $host: \`make offline-host\` makes it" \
            "from $python312 (scripts/offline_host.sh)" >&2; exit 4; }
        echo "$host/bin/python"
        exit 0 ;;
    "") ;;
    *) sed -n '13,16p' "$0" >&2; exit 2 ;;
esac

if ! python312="$(find_python312)"; then
    echo "offline_host.sh: no Python 3.12 here: no stand-in (tests/test_offline_bundle.py skips)"
    exit 0
fi
# The torch and transformers requirements of the project's model extra.
mapfile -t requirements < <("$python312" -c "import sys, tomllib
extras = tomllib.load(open(sys.argv[1], 'rb'))['project']['optional-dependencies']
print('\n'.join(r for r in extras['model'] if r.startswith(('torch', 'transformers'))))" \
    "$project/pyproject.toml")
# scipy and scikit-learn as the GPU image has them, built for numpy 2: the
# bundle's venv (numpy 1.26) must hide them (scripts/offline_install.sh).
requirements+=("numpy>=2" "scipy>=1.16" scikit-learn ml_dtypes Cython setuptools)
mkdir -p "$(dirname "$host")"
exec 9> "$host.lock"
flock 9  # one maker at a time: checkouts of this machine share it
if [ "$(cat "$stamp" 2> /dev/null)" = "${requirements[*]}" ]; then
    exit 0
fi
echo "offline_host.sh: $host from $python312 with ${requirements[*]} (about 4.7 GB)"
rm -rf "$host"
"$python312" -m venv "$host"
"$host/bin/python" -m pip install --quiet "${requirements[@]}"
"$host/bin/python" -c "import torch, numpy, transformers, Cython
print('offline_host.sh: torch', torch.__version__, 'numpy', numpy.__version__)"
echo "${requirements[*]}" > "$stamp"
