#!/usr/bin/env bash
# The first GPU run, checked end to end, inside the NGC image (docs/GPU.md,
# "First GPU run"): TensorRT-LLM's own greedy reference, then the server, then
# every check; one result in --out (gpu-first-run.json and .md) and the
# server's log in --out/logs. Exits 0 only if every check that ran passed.
#
#   scripts/gpu_first_run.sh --model /models/checkpoint --out /out [--max-context 2048]
#   scripts/gpu_first_run.sh --dry-run --out /tmp/check    (simulated engine, no GPU)
#
# The logic is `simple-sampler gpu-check` (src/simple_sampler/launch/gpu_check.py).
set -euo pipefail
exec simple-sampler gpu-check "$@"
