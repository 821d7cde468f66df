#!/usr/bin/env bash
# Kernels before / after, alternated in one run on one host: the kernels of
# another commit (built here for this host) against this checkout's, through
# this checkout's `bench kernels`, so the rows, configs and timing are the same
# code and only the compiled kernels differ.
#
#   scripts/kernels_ab.sh REF ROUNDS OUT_DIR [bench kernels options...]
#
# REF: the "before" commit. Each of ROUNDS rounds runs before, then after;
# OUT_DIR/{before,after}-N.json are `bench kernels --json` outputs, and the
# tables are printed as they come, then the before/after table
# (scripts/kernels_ab_table.py). Run it alone on a quiet machine.
set -euo pipefail
ref="$1"; rounds="$2"; out="$3"; shift 3
here="$(cd "$(dirname "$0")/.." && pwd)"
python="$here/.venv/bin/python"
work="$(mktemp -d)"
trap 'git -C "$here" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

git -C "$here" worktree add --detach "$work/tree" "$ref" >/dev/null
(cd "$work/tree" && "$python" setup.py -q build_ext --inplace >/dev/null 2>&1)
# this checkout's package with the "before" kernels in place of its own
cp -r "$here/src" "$work/before-src"
rm -f "$work"/before-src/simple_sampler/_sampling*.so
cp "$work"/tree/src/simple_sampler/_sampling*.so "$work/before-src/simple_sampler/"

mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for side in before after; do
        src="$here/src"; [ "$side" = before ] && src="$work/before-src"
        echo "== $side (round $round): kernels of $([ "$side" = before ] && echo "$ref" || git -C "$here" rev-parse --short HEAD)"
        PYTHONPATH="$src" "$python" -m simple_sampler.cli bench kernels --json "$@" > "$out/$side-$round.json"
        PYTHONPATH="$src" "$python" -c "import json, sys; from simple_sampler.bench.kernels.measuring import format_table; print(format_table(json.load(open(sys.argv[1]))['results']))" "$out/$side-$round.json"
    done
done
echo "== before / after (scripts/kernels_ab_table.py $out)"
"$python" "$here/scripts/kernels_ab_table.py" "$out"
