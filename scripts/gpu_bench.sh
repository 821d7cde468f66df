#!/usr/bin/env bash
# One command on one GPU host (Python 3.12 + a CUDA build of PyTorch and
# transformers; no Triton, no network): the CUDA tests of the GPU-bound data
# plane and the in-line baseline, then the compiled decode step's CUDA test,
# then per shipped shape: forward_only on the eager and the compiled decode
# step (`bench serve-gpu --decode-step eager compiled`, B in {64, 256}), then
# `bench serve-gpu` on the static engine, B in {64, 256}, top_p in {1.0,
# 0.95}, rows in {flat, fitted}, modes forward_only, gpu_inline, simple,
# simple_hot_first (and simple_overlap, two lanes, on fitted rows), then, given
# SERIAL_LIMIT_S, the same with launch_ahead off (fitted rows, top_p 1:
# serve-gpu-serial-SHAPE).
# Writes JSON and Markdown per shape and a dated README.md
# (machine, commit, command) under the output folder. Sized to finish in
# under 8 minutes: each shape gets a time limit, and a shape cut off says so
# in the README.
#
#   scripts/gpu_bench.sh --prepare DIR   # HERE (a machine with `make install`
#                                        # done): SmolLM2's tokenizer and real
#                                        # rows into DIR (~15 MB), for the host
#   SIMPLE_SAMPLER_CACHE=DIR scripts/gpu_bench.sh [OUTPUT_DIR]   # on the GPU host
#
# `bench engine-step` (ENGINE_STEP_LIMIT_S, default 45) times the static
# engine's host work per decode step, the rows' copy to the host included.
#
# DEVICE=cpu (float32) is a dry run of the script on a CPU host: figures that
# mean nothing. CUDA_TESTS_LIMIT_S (default 90) bounds the CUDA tests,
# COMPILED_TESTS_LIMIT_S (default 60) the compiled step's. COMPILED_LIMIT_S
# (default half of SHAPE_LIMIT_S) bounds a shape's forward_only on both steps,
# out of its SHAPE_LIMIT_S: torch.compile's time on the host is unknown; a
# compile cut off says so in the README and leaves the shape the rest.
# SERIAL_LIMIT_S (default 0: not run) is kept for the shape's last part: the
# modes again with launch_ahead off (fitted rows, top_p 1), beside the served
# phase's auto (on, on a GPU). It is a fresh process (imports, the model drawn
# again) whose one file is written when it ends: under about 30 s it returns
# nothing, so a session sized like scripts/gpu_session.sh's leaves it out.
#
# First run on an H200 through scripts/gpu_session.sh:
# docs/results/gpu-2026-11-28.md.
set -uo pipefail
# Each step's `timeout --foreground`: the step stays in this script's process
# group, so a signal to the group (the caller's own timeout) stops it too
# instead of leaving it running on the GPU beside the next call.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1

if [[ "${1:-}" == "--prepare" ]]; then
    target="${2:?--prepare DIR}"
    cache="${SIMPLE_SAMPLER_CACHE:-$HOME/.cache/simple-sampler}"
    "$ROOT/.venv/bin/python" -c "from simple_sampler.rows import real_rows; real_rows(64)" || exit 1
    mkdir -p "$target/smollm2-135m-instruct"
    cp "$cache"/real_rows-v*-n64.npy "$target/" || exit 1
    for name in config.json tokenizer.json tokenizer_config.json chat_template.jinja \
                generation_config.json; do  # no weights: the host draws its own
        [[ -f "$cache/smollm2-135m-instruct/$name" ]] && cp "$cache/smollm2-135m-instruct/$name" \
            "$target/smollm2-135m-instruct/"
    done
    du -sh "$target"
    exit 0
fi

OUT_DIR="${1:-${OUT:-$ROOT/results/gpu-bench-$(date -u +%Y%m%dT%H%M%SZ)}}"
mkdir -p "$OUT_DIR"
SHAPES="${SHAPES:-llama-3.2-1b qwen2.5-0.5b llama-3.1-8b smollm2-135m}"
SHAPE_LIMIT_S="${SHAPE_LIMIT_S:-85}"
COMPILED_LIMIT_S="${COMPILED_LIMIT_S:-$(( SHAPE_LIMIT_S / 2 ))}"
SERIAL_LIMIT_S="${SERIAL_LIMIT_S:-0}"
export DEVICE="${DEVICE:-cuda}"
README="$OUT_DIR/README.md"
commit="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo "${GIT_COMMIT:-unknown}")"
{
    echo "# gpu_bench.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "- command: \`$0 $*\` (SHAPES=\"$SHAPES\", SHAPE_LIMIT_S=$SHAPE_LIMIT_S," \
         "COMPILED_LIMIT_S=$COMPILED_LIMIT_S, SERIAL_LIMIT_S=$SERIAL_LIMIT_S, DEVICE=$DEVICE)"
    echo "- commit: $commit"
    echo "- machine: $(nvidia-smi -L 2>/dev/null | head -1 || echo 'nvidia-smi absent'); $(nproc) CPUs"
    echo "- python: $("$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1)"
} > "$README"

# The Cython kernels (the simple modes' sampler) for this Python: built in
# place when they do not import; without them only forward_only and gpu_inline run.
if ! "$PYTHON" -c "import simple_sampler._sampling" 2>/dev/null; then
    (cd "$ROOT" && "$PYTHON" setup.py build_ext --inplace > "$OUT_DIR/build_ext.log" 2>&1) \
        && echo "- kernels: built in place for this Python" >> "$README" \
        || echo "- kernels: NOT BUILT (build_ext.log): simple modes skipped" >> "$README"
fi

echo "## CUDA tests" >> "$README"
if "$PYTHON" -c "import pytest, scipy" 2>/dev/null; then
    (cd "$ROOT" && timeout --foreground "${CUDA_TESTS_LIMIT_S:-90}" "$PYTHON" -m pytest -q -p no:cacheprovider -k cuda \
        tests/test_inline.py tests/test_static_decode.py tests/test_row_arena_engine.py \
        tests/test_host_copy.py tests/test_torch_hot_first.py tests/test_prompt_logprobs.py \
        tests/test_structured.py) \
        > "$OUT_DIR/cuda_tests.log" 2>&1
    echo "exit $?: $(tail -1 "$OUT_DIR/cuda_tests.log")" >> "$README"
    # apart: its compile's time on the host is unknown (a cut-off reads exit 124)
    (cd "$ROOT" && timeout --foreground "${COMPILED_TESTS_LIMIT_S:-60}" "$PYTHON" -m pytest -q -p no:cacheprovider \
        -k cuda tests/test_compiled_decode.py) > "$OUT_DIR/compiled_tests.log" 2>&1
    echo "compiled decode step: exit $?: $(tail -1 "$OUT_DIR/compiled_tests.log")" >> "$README"
else
    echo "skipped: pytest or scipy missing on this host" >> "$README"
fi

echo "## bench engine-step (the static engine's host time per decode step)" >> "$README"
# llama-3.2-1b's vocabulary, one narrow layer: the step's host work, the rows' copy to the host included
dtype_name=$([[ "$DEVICE" == cuda ]] && echo bfloat16 || echo float32)
(cd "$ROOT" && timeout --foreground "${ENGINE_STEP_LIMIT_S:-45}" "$PYTHON" -m simple_sampler.cli bench engine-step \
    --device "$DEVICE" --dtype "$dtype_name" --batch 64 256) > "$OUT_DIR/engine-step.md" 2>&1
echo "exit $?: engine-step.md" >> "$README"

echo "## bench serve-gpu (static engine)" >> "$README"
for shape in $SHAPES; do
    started=$(date +%s)
    # forward_only, eager then compiled, B 64 then 256 (scripts/gpu_bench_shape.py)
    timeout --foreground "$COMPILED_LIMIT_S" "$PYTHON" "$ROOT/scripts/gpu_bench_shape.py" compiled "$shape" \
        "$OUT_DIR" > "$OUT_DIR/serve-gpu-compiled-$shape.log" 2>&1
    status=$?
    case $status in
        0) echo "- $shape, forward_only eager and compiled: serve-gpu-compiled-$shape.md" \
                "$(grep -ho 'compiled decode step FAILED.*' "$OUT_DIR/serve-gpu-compiled-$shape.md")" \
                >> "$README" ;;
        124) echo "- $shape, forward_only eager and compiled: CUT OFF after ${COMPILED_LIMIT_S}s" \
                  "(torch.compile or the runs did not finish; what ended is in" \
                  "serve-gpu-compiled-$shape.md, serve-gpu-compiled-$shape.log)" >> "$README" ;;
        *) echo "- $shape, forward_only eager and compiled: FAILED, exit $status:" \
                "$(tail -1 "$OUT_DIR/serve-gpu-compiled-$shape.log")" >> "$README" ;;
    esac
    left=$(( SHAPE_LIMIT_S - SERIAL_LIMIT_S - ($(date +%s) - started) ))
    timeout --foreground "$(( left > 1 ? left : 1 ))" "$PYTHON" "$ROOT/scripts/gpu_bench_shape.py" served \
        "$shape" "$OUT_DIR" > "$OUT_DIR/serve-gpu-$shape.log" 2>&1
    status=$?
    case $status in
        0) echo "- $shape: serve-gpu-$shape.md" >> "$README" ;;
        124) echo "- $shape: CUT OFF after ${left}s, what was left of ${SHAPE_LIMIT_S}s" \
                  "(serve-gpu-$shape.log)" >> "$README" ;;
        *) echo "- $shape: FAILED, exit $status: $(tail -1 "$OUT_DIR/serve-gpu-$shape.log")" \
               >> "$README" ;;
    esac
    # the same modes with launch_ahead off, fitted rows, top_p 1: what launching ahead gives
    [ "$SERIAL_LIMIT_S" -gt 0 ] || continue
    left=$(( SHAPE_LIMIT_S - ($(date +%s) - started) ))
    if [ "$left" -lt 10 ]; then
        echo "- $shape, launch_ahead off: NOT RUN, ${left}s left" >> "$README"
        continue
    fi
    timeout --foreground "$left" "$PYTHON" "$ROOT/scripts/gpu_bench_shape.py" serial "$shape" "$OUT_DIR" \
        > "$OUT_DIR/serve-gpu-serial-$shape.log" 2>&1
    status=$?
    case $status in
        0) echo "- $shape, launch_ahead off: serve-gpu-serial-$shape.md" >> "$README" ;;
        124) echo "- $shape, launch_ahead off: CUT OFF after ${left}s" \
                  "(serve-gpu-serial-$shape.log)" >> "$README" ;;
        *) echo "- $shape, launch_ahead off: FAILED, exit $status:" \
                "$(tail -1 "$OUT_DIR/serve-gpu-serial-$shape.log")" >> "$README" ;;
    esac
done
cat "$README"
