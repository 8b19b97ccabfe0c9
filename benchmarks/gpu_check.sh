#!/usr/bin/env bash
# One-shot GPU check of the Triton embedding kernels (< 5 min on one GPU):
#   1. the correctness cases of tests/triton_cases.py, compiled on CUDA (no interpreter);
#   2. benchmarks/triton_bench.py (Triton vs torch embedding_bag, and FBGEMM TBE if it imports).
# Usage, from anywhere:  bash benchmarks/gpu_check.sh [--quick]
# Python: $PYTHON, else .venv/bin/python, else python3 -- it needs a CUDA build of torch and triton.
# Logs and the bench's JSON line go to $OUT (set by a device runner) or runs/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST="${OUT:-runs/gpu_check}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

echo "== machine"
nvidia-smi -L || echo "nvidia-smi not found"
"$PY" - <<'PY'
import sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    sys.exit(f"gpu_check: triton does not import ({e}): pip install triton")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (a CPU-only torch build?)")
print("gpu", torch.cuda.get_device_name(0))
PY

echo "== correctness on CUDA (tests/triton_cases.py --device cuda)"
status=0
timeout 180 "$PY" tests/triton_cases.py --device cuda | tee "$DEST/cases.jsonl" || status=$?
echo "cases exit status: $status"

echo "== benchmark (benchmarks/triton_bench.py $*)"
bstatus=0
timeout 180 "$PY" benchmarks/triton_bench.py "$@" | tee "$DEST/bench.log" || bstatus=$?
tail -n 1 "$DEST/bench.log" > "$DEST/bench.json" || true
echo "bench exit status: $bstatus"
exit $(( status != 0 || bstatus != 0 ))
