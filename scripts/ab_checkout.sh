# Sourced by the before / after scripts (kernels_ab.sh, loop_ab.sh): their
# arguments REF ROUNDS OUT_DIR read into ref, rounds, out (the rest left in
# "$@"), this checkout in here, its interpreter in python, and commit REF
# checked out in "$work/tree" with its kernels built for this host (build
# errors shown); the checkout is removed on exit.
set -euo pipefail
ref="$1"; rounds="$2"; out="$3"; shift 3
here="$(cd "$(dirname "$0")/.." && pwd)"
python="$here/.venv/bin/python"
work="$(mktemp -d)"
trap 'git -C "$here" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

git -C "$here" worktree add --detach "$work/tree" "$ref" >/dev/null
(cd "$work/tree" && "$python" setup.py -q build_ext --inplace >/dev/null)
