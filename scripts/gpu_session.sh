#!/usr/bin/env bash
# One GPU call for both GPU issues, inside a fixed time: the served run from
# the offline bundle (scripts/gpu_served_run.sh: install, real Triton servers
# on the static CUDA engine, issue 43), then the in-process bench
# (scripts/gpu_bench.sh: CUDA tests, the compiled decode step's CUDA test,
# bench engine-step, per shape forward_only on the eager and the compiled decode step and
# serve-gpu with flat and fitted rows, issue 42) with the time that is
# left, over the interpreter and kernels the install made. Everything lands in WORK; OUT gets two files (a device
# call brings back at most eight): README.md (both phases' READMEs and times)
# and results.tar.gz (WORK without the install, logs included), written after
# each phase and again on the way out (a call cut off keeps what ended).
#
#   scripts/gpu_session.sh BUNDLE OUT [WORK]
#
# SESSION_S (default 560): the whole run's seconds; SERVED_LIMIT_S (default
# 280) bounds the served benchmark; SERVED_ARGS (default "--instances 8
# --stream-interval 16 --stacks": the first run's was --instances 8, one
# response a token; --stacks: where the llm stub's threads spend their wall
# time, in served/server-logs/stacks/) are its options; SHAPES: gpu_bench.sh's (default "llama-3.2-1b llama-3.1-8b").
# GIT_COMMIT: the commit, where the checkout has no .git. DEVICE=cpu with
# SERVED_ARGS="--device cpu --quick" is a dry run on a CPU host. HOST_PYTHON
# (default python3): the host's Python 3.12 with torch, for the install and the bench.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:?usage: scripts/gpu_session.sh BUNDLE OUT [WORK]}"
out="${2:?usage: scripts/gpu_session.sh BUNDLE OUT [WORK]}"
work="${3:-/tmp/gpu-session}"
session_s="${SESSION_S:-560}"
started=$(date +%s)
commit="${GIT_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)}"
elapsed() { echo $(( $(date +%s) - started )); }
mkdir -p "$out" "$work"
summary="$work/README.md"
{
    echo "# gpu_session.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "- command: \`$0 $*\` (SESSION_S=$session_s, SERVED_LIMIT_S=${SERVED_LIMIT_S:-280}," \
         "SERVED_ARGS=\"${SERVED_ARGS:---instances 8 --stream-interval 16 --stacks}\", SHAPES=\"${SHAPES:-llama-3.2-1b llama-3.1-8b}\")"
    echo "- commit: $commit"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        2> /dev/null | sed 's/^/- gpu: /'
    echo "- cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
} > "$summary"

# OUT's two files from what has ended so far: after each phase, and on the way
# out (a call cut off by its limit still returns the phases it finished)
deliver() {
    {
        cat "$summary"
        echo
        cat "$work/served/README.md" 2> /dev/null || echo "(no served README: $(tail -3 "$work/served-run.log" 2> /dev/null))"
        echo
        cat "$work/bench/README.md" 2> /dev/null || echo "(no bench README)"
    } > "$out/README.md"
    tar czf "$out/results.tar.gz" -C "$work" --exclude=served/install . 2> /dev/null
}
# a phase's benchmark runs under a `timeout` of its own (another process
# group): stopped with its callers, not left running beside the next call
stop_descendants() {
    local child
    for child in $(ps -o pid= --ppid "$1" 2> /dev/null); do
        stop_descendants "$child"
        kill -TERM "$child" 2> /dev/null
    done
}
trap deliver EXIT
trap 'stop_descendants $$; exit 143' TERM INT

# -- 1. served (install + real servers) ----------------------------------------------
BENCH_LIMIT_S="${SERVED_LIMIT_S:-280}" BENCH_ARGS="${SERVED_ARGS:---instances 8 --stream-interval 16 --stacks}" \
    bash "$ROOT/scripts/gpu_served_run.sh" "$work/served" --bundle "$bundle" \
    --python "${HOST_PYTHON:-python3}" > "$work/served-run.log" 2>&1
echo "- served run: exit $?, done at $(elapsed) s" >> "$summary"
deliver

# -- 2. in-process, with the time left ---------------------------------------------------
# The host's own Python (numpy 2: the CUDA tests need its scipy, which the
# install's venv, on numpy 1.26 for the stubs, hides) over the installed
# project, whose kernels use no numpy C API; over this checkout when the
# install did not get that far (gpu_bench.sh then builds the kernels).
python="${HOST_PYTHON:-python3}" install="$work/served/install"
if PYTHONPATH="$install/simple-sampler/src" "$python" -c 'import simple_sampler._sampling' 2> /dev/null; then
    project="$install/simple-sampler"
    # the code that runs is the bundle's: its commit (git archive's pax header)
    bundled="$("$python" -c 'import sys, tarfile
print(tarfile.open(sys.argv[1]).pax_headers.get("comment", "unknown"))' "$bundle/project.tar.xz" 2> /dev/null)"
    if [ -n "$bundled" ] && [ "$bundled" != "$commit" ]; then
        echo "- in-process bench: the bundle's code, commit $bundled (not $commit)" >> "$summary"
        commit="$bundled"
    fi
else
    project="$ROOT"
fi
# the install's cache (SmolLM2's tokenizer, the bundle's real rows); where the
# install stopped before making it, the same unpacked from the bundle here
if [ -d "$install/cache" ]; then
    export SIMPLE_SAMPLER_CACHE="$install/cache"
elif [ -f "$bundle/tokenizer.tar.xz" ] && mkdir -p "$work/cache" \
        && tar xJf "$bundle/tokenizer.tar.xz" -C "$work/cache" 2> /dev/null; then
    cp -r "$bundle/cache/." "$work/cache/" 2> /dev/null
    export SIMPLE_SAMPLER_CACHE="$work/cache"
fi
shapes="${SHAPES:-llama-3.2-1b llama-3.1-8b}"
count=$(wc -w <<< "$shapes")
left=$(( session_s - $(elapsed) - 15 ))
tests_s=$(( left / 5 < 90 ? left / 5 : 90 ))
compiled_tests_s=$(( left / 8 < 60 ? left / 8 : 60 ))  # torch.compile of two tiny models
engine_step_s=30  # bench engine-step: the imports, a one-layer model, two buckets' capture
shape_s=$(( (left - tests_s - compiled_tests_s - engine_step_s) / count ))
if [ "$shape_s" -ge 20 ]; then
    GIT_COMMIT="$commit" PYTHON="$python" SHAPES="$shapes" \
        SHAPE_LIMIT_S="$shape_s" CUDA_TESTS_LIMIT_S="$tests_s" \
        COMPILED_TESTS_LIMIT_S="$compiled_tests_s" ENGINE_STEP_LIMIT_S="$engine_step_s" \
        bash "$project/scripts/gpu_bench.sh" "$work/bench" > "$work/bench-run.log" 2>&1
    echo "- in-process bench: exit $?, $shape_s s a shape, done at $(elapsed) s" >> "$summary"
else
    echo "- in-process bench: NOT RUN, $left s left" >> "$summary"
fi

# -- results back: a few files ----------------------------------------------------------
deliver
trap - EXIT
ls -la "$out"
cat "$out/README.md"
