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
source "$(dirname "$0")/ab_checkout.sh"
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
