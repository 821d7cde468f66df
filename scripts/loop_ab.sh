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
# loop_ms_batch_state (the loop's time per step), the sampler request's times
# on the llm's side and the sampler's (request_* and decode_* ms, the
# histories as lists and by reference), and after / before. Run it alone on a
# quiet machine.
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
COLUMNS = ("loop_ms_batch_state", "request_value_ms", "request_ref_ms", "decode_value_ms",
           "decode_ref_ms")
print("penalties | ms | before | after | after / before")
for index, row in enumerate(runs["after"][0]["rows"]):
    for column in COLUMNS:
        if not all(column in r["rows"][index] for side in runs.values() for r in side):
            continue  # a column the before commit does not measure
        before, after = (statistics.median(r["rows"][index][column] for r in runs[side])
                         for side in ("before", "after"))
        print(f"{row['penalties']:9} | {column:19} | {before:7.3f} | {after:7.3f} | "
              f"{after / before:.3f}")
EOF
