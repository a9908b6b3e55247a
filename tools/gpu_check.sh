#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py says what it runs): bash tools/gpu_check.sh OUT [--stages ...]
#   first call:  bash tools/gpu_check.sh "$OUT"                 (loop, facts, equality, tests, sanitize: 340 s at most)
#   second call: bash tools/gpu_check.sh "$OUT" --stages bench  (only where the first says it is warranted)
cd "$(dirname "$0")/.." || exit 1
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
