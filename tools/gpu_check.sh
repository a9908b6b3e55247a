#!/usr/bin/env bash
# The GPU check of issue 20 (tools/gpu_check.py says what it runs): bash tools/gpu_check.sh OUT [--stages ...]
cd "$(dirname "$0")/.." || exit 1
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
