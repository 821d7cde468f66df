#!/usr/bin/env bash
# The decode loop's own time per step before / after, alternated in one run on
# one host: `bench loop` (docs/DECODE_LOOP.md) of another commit, its kernels
# built here, against this checkout's.
#
#   scripts/loop_ab.sh REF ROUNDS OUT_DIR [bench loop options...]
#
# REF: the "before" commit. Each of ROUNDS rounds runs before, then after;
# OUT_DIR/{before,after}-N.json are `bench loop --json` outputs. Printed at the
# end: per penalties setting, the median over the rounds of each side's
# loop_ms_batch_state (the loop's time per step) and after / before. Run it
# alone on a quiet machine.
source "$(dirname "$0")/ab_checkout.sh"

mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for side in before after; do
        src="$here/src"; [ "$side" = before ] && src="$work/tree/src"
        echo "== $side (round $round): $([ "$side" = before ] && echo "$ref" || git -C "$here" rev-parse --short HEAD)"
        PYTHONPATH="$src" "$python" -m simple_sampler.cli bench loop --json "$@" > "$out/$side-$round.json"
    done
done
"$python" - "$out" "$rounds" <<'EOF'
import json, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
runs = {side: [json.load(open(f"{out}/{side}-{n}.json")) for n in range(1, rounds + 1)]
        for side in ("before", "after")}
print("penalties | before ms/step | after ms/step | after / before")
for index, row in enumerate(runs["after"][0]["rows"]):
    before, after = (statistics.median(r["rows"][index]["loop_ms_batch_state"] for r in runs[side])
                     for side in ("before", "after"))
    print(f"{row['penalties']:9} | {before:14.3f} | {after:13.3f} | {after / before:.3f}")
EOF
