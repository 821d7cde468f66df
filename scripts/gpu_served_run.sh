#!/usr/bin/env bash
# The served GPU benchmark in one command on a GPU host (issue 43, item 3):
# install from the offline bundle when one is given (its install.sh, i.e.
# scripts/offline_install.sh), then `bench serve-gpu-served`, which starts a
# real Triton server per sampling mode (inline, the baseline, first; simple; simple hot-first) on
# `--engine static --device cuda`, drives B in {64, 256} x top_p in {1.0,
# 0.95} streamed requests over gRPC from this host, measures the forward-only
# bound in-process, and stops each server (checking /dev/shm after it).
# Writes to OUT: README.md (date, command, commit, machine, then the results
# as Markdown), served.json, served.md, bench.log, server-logs/<mode>.log and,
# with --bundle, install.log. Sized for under 8 minutes (BENCH_LIMIT_S,
# default 390, bounds the benchmark; a cut-off run says so in README.md).
#
#   scripts/gpu_served_run.sh OUT [--bundle DIR] [--shape NAME] [--model DIR] [--python PY]
#
# --shape: a shipped shape (llama-3.2-1b by default: V = 128,256; qwen2.5-0.5b,
#   llama-3.1-8b, smollm2-135m) or a config.json, with RANDOM WEIGHTS (flat
#   rows, labelled so); --model DIR: a checkpoint of its own weights instead.
# --python: the host's Python 3.12 with CUDA torch, for the bundle's install
#   (default python3); without --bundle the checkout's .venv (make
#   install-gpu-host) or python3.
# SmolLM2's tokenizer (the prompts' and the random shapes' text) must be in
#   the cache: with --bundle, the bundle's (its install's env.sh sets
#   SIMPLE_SAMPLER_CACHE to OUT/install/cache unless it is set); without,
#   $SIMPLE_SAMPLER_CACHE, else ~/.cache/simple-sampler
#   (`scripts/gpu_bench.sh --prepare DIR` where there is network makes one to
#   copy over).
# BENCH_ARGS: more options for the benchmark, e.g. "--instances 4" or, for a
#   dry run on a CPU host, "--device cpu --quick".
#
# First run on an H200 through scripts/gpu_session.sh:
# docs/results/gpu-2026-11-28.md. Its dry run on the CPU is tested.
set -uo pipefail
# `timeout --foreground`: the benchmark stays in this script's process group,
# so a signal to the group (the caller's own timeout) stops it too; its
# servers go with it (their lifeline).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command_line="$0 $*"
usage() { sed -n '14p' "$0" | sed 's/^#  *//' >&2; exit 2; }
out="" bundle="" shape="llama-3.2-1b" model="" host_python="python3"
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) bundle="${2:?--bundle DIR}"; shift ;;
        --shape) shape="${2:?--shape NAME}"; shift ;;
        --model) model="${2:?--model DIR}"; shift ;;
        --python) host_python="${2:?--python PY}"; shift ;;
        -*) echo "gpu_served_run.sh: unknown option $1" >&2; usage ;;
        *) [ -z "$out" ] || usage; out="$1" ;;
    esac
    shift
done
[ -n "$out" ] || usage
mkdir -p "$out"
out="$(cd "$out" && pwd)"
readme="$out/README.md"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-390}"
fail() { echo "gpu_served_run.sh: $*" | tee -a "$readme" >&2; exit 1; }

{
    echo "# gpu_served_run.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "- command: \`$command_line\` (BENCH_ARGS=\"${BENCH_ARGS:-}\", BENCH_LIMIT_S=$BENCH_LIMIT_S)"
} > "$readme"

# -- install, or the environment already here -----------------------------------
if [ -n "$bundle" ]; then
    bundle="$(cd "$bundle" && pwd)" || fail "no bundle folder $bundle"
    echo "- install: $bundle/install.sh $out/install (install.log)" >> "$readme"
    bash "$bundle/install.sh" "$out/install" --python "$host_python" > "$out/install.log" 2>&1 \
        || fail "the bundle's install failed: $(tail -3 "$out/install.log")"
    # shellcheck disable=SC1091
    source "$out/install/env.sh"
    python="$out/install/venv/bin/python"
    project="$out/install/simple-sampler"
    # git archive records the commit in the tar's pax header
    commit="$("$python" -c 'import sys, tarfile
print(tarfile.open(sys.argv[1]).pax_headers.get("comment", "unknown"))' \
        "$bundle/project.tar.xz" 2> /dev/null || echo unknown)"
else
    python="${PYTHON:-$ROOT/.venv/bin/python}"
    [ -x "$python" ] || python=python3
    project="$ROOT"
    commit="$(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo "${GIT_COMMIT:-unknown}")"
fi
export HF_HUB_OFFLINE=1
{
    echo "- commit: $commit"
    echo "- machine: $(nvidia-smi -L 2> /dev/null | head -1 || echo 'nvidia-smi absent'); CPU" \
         "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores;" \
         "/dev/shm $(df -Ph /dev/shm 2> /dev/null | awk 'NR == 2 {print $4}') free"
    echo "- python: $("$python" -c 'import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1)"
} >> "$readme"

# SmolLM2's tokenizer: the prompts are tokenized with it (a --model brings its own)
cache="${SIMPLE_SAMPLER_CACHE:-$HOME/.cache/simple-sampler}"
if [ -z "$model" ] && [ ! -f "$cache/smollm2-135m-instruct/tokenizer.json" ]; then
    fail "no SmolLM2 tokenizer in $cache/smollm2-135m-instruct: run" \
         "\`scripts/gpu_bench.sh --prepare DIR\` where there is network, copy DIR here and set" \
         "SIMPLE_SAMPLER_CACHE=DIR (a bundle carries it: --bundle)"
fi

# -- the benchmark -----------------------------------------------------------------
if [ -n "$model" ]; then source_args=(--model "$model"); else source_args=(--model-config "$shape"); fi
# shellcheck disable=SC2086  # BENCH_ARGS: words on purpose
(cd "$project" && timeout --foreground --kill-after=30 "$BENCH_LIMIT_S" "$python" -m simple_sampler.cli \
    bench serve-gpu-served "${source_args[@]}" --json --markdown "$out/served.md" \
    --log-dir "$out/server-logs" ${BENCH_ARGS:-}) > "$out/served.json" 2> "$out/bench.log"
status=$?
echo >> "$readme"
case $status in
    0) cat "$out/served.md" >> "$readme"
       "$python" - "$out/served.json" >> "$readme" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
left = {s["mode"]: s["left_in_dev_shm"] for s in report["servers"] if s["left_in_dev_shm"]}
status = {s["mode"]: s["exit_status"] for s in report["servers"] if s["exit_status"] != 0}
failed = {s["mode"]: s["error"] for s in report["servers"] if s.get("error")}
print(f"\nservers stopped cleanly: {'yes' if not left and not status else 'NO'}"
      + (f"; exit statuses {status}" if status else "") + (f"; left {left}" if left else ""))
print(f"modes that failed: {failed if failed else 'none'}")
EOF
       ;;
    124|137) echo "**CUT OFF after ${BENCH_LIMIT_S} s** (bench.log, server-logs/; the modes" \
                  "measured before: server-logs/partial.json)" >> "$readme" ;;
    *) echo "**FAILED, exit $status**: $(tail -3 "$out/bench.log")" >> "$readme" ;;
esac
cat "$readme"
exit $status
