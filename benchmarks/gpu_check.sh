#!/usr/bin/env bash
# One-shot GPU check, under 7 minutes on one GPU, every part bounded by `timeout`:
#   1. the machine: GPU, torch, CUDA, triton;
#   2. the Triton kernels' correctness cases compiled on CUDA (tests/support/triton_cases.py);
#   3. the tests marked gpu (pytest -m gpu, over the test files that have such tests);
#   4. benchmarks/gpu_bench.py: kernels, DLRM and GPT vs plain PyTorch, the embedding
#      cache on the GPU vs tables in HBM and vs uncached host tables (last line JSON);
# then a summary: each part's status and seconds, and every benchmark target.
# Usage, from anywhere:  bash benchmarks/gpu_check.sh [--quick]   (--quick goes to the bench)
# A rerun of some parts only (two full runs and a cold start do not fit in 15 minutes of
# device time):  GPU_CHECK_PARTS="gpu_tests bench" bash benchmarks/gpu_check.sh
# Python: $PYTHON, else .venv/bin/python, else python3 (a CUDA build of torch, and triton).
# Logs, the cases' JSON lines, the bench's JSON (and its parts as they finish) go to $OUT
# (set by a device runner) or runs/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST="${OUT:-runs/gpu_check}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

TOTAL=400  # seconds for the whole check; each part gets at most its cap and what is left
PARTS=" ${GPU_CHECK_PARTS:-cases gpu_tests bench} "  # the parts after the machine check
declare -A STATUS SECS
cap() {  # cap <max seconds> <seconds kept for the parts after this one>
  local left=$(( TOTAL - SECONDS - $2 ))
  (( left < $1 )) && echo $(( left > 10 ? left : 10 )) || echo "$1"
}
run_part() {  # run_part <name> <timeout s> <log> <command...>: status and seconds recorded
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc=0
  shift 3
  if [[ $name != machine && $PARTS != *" $name "* ]]; then
    STATUS[$name]="skipped (GPU_CHECK_PARTS)"; SECS[$name]=0; return
  fi
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  SECS[$name]=$(( SECONDS - t0 ))
  if (( rc == 124 || rc == 137 )); then STATUS[$name]="timed out after ${limit}s"
  elif (( rc == 0 )); then STATUS[$name]="ok"
  else STATUS[$name]="failed (exit $rc)"; fi
  echo "== $name: ${STATUS[$name]} in ${SECS[$name]}s"
}

run_part machine 60 "$DEST/machine.log" "$PY" - <<'PY'
import sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    sys.exit(f"gpu_check: triton does not import ({e})")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (a CPU-only torch build?)")
p = torch.cuda.get_device_properties(0)
print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}")
PY
nvidia-smi -L 2>/dev/null | tee -a "$DEST/machine.log" || true

if [[ ${STATUS[machine]} == ok ]]; then
  run_part cases "$(cap 60 330)" "$DEST/cases.jsonl" "$PY" tests/support/triton_cases.py --device cuda

  # In-process checks first (every placement and optimizer, state dicts, kernels), then
  # the jobs, then the files that launch ranks (mpirun, gloo, nccl): a run cut short by
  # its timeout has then answered the most.
  FIRST=(tests/embedding/test_embedding_device.py tests/embedding/test_embedding_state_dict.py
         tests/cache/test_cache_device.py tests/ps/test_ps_inprocess.py tests/ps/test_ps_init_device.py
         tests/embedding/test_triton_kernels.py tests/jobs/test_device_jobs.py)
  mapfile -t MARKED < <(grep -l "mark.gpu" tests/*/test_*.py)
  GPU_TESTS=()
  for f in "${FIRST[@]}"; do [[ " ${MARKED[*]} " == *" $f "* ]] && GPU_TESTS+=("$f"); done
  for f in "${MARKED[@]}"; do [[ " ${FIRST[*]} " == *" $f "* ]] || GPU_TESTS+=("$f"); done
  if (( ${#GPU_TESTS[@]} )); then
    # Only the files with gpu tests are collected (others import packages this machine
    # may lack); -m gpu keeps their CUDA tests; -v names each result as it comes, so a
    # timed-out run still says which passed. The cases ran above: their pytest twin is
    # deselected. The shell timeout bounds the whole run (pytest-timeout may be absent).
    run_part gpu_tests "$(cap 140 190)" "$DEST/pytest_gpu.log" \
      env HYBRIDREC_REQUIRE_TRITON=1 "$PY" -m pytest -m gpu -v -p no:cacheprovider \
      --continue-on-collection-errors \
      --deselect tests/embedding/test_triton_kernels.py::test_triton_cases_on_cuda "${GPU_TESTS[@]}"
  else
    STATUS[gpu_tests]="none: no test file has a gpu mark"; SECS[gpu_tests]=0
  fi

  BENCH_LIMIT=$(cap 200 0)
  run_part bench "$BENCH_LIMIT" "$DEST/bench.log" \
    "$PY" benchmarks/gpu_bench.py --out "$DEST" --budget-s $(( BENCH_LIMIT - 15 )) "$@"
else
  for part in cases gpu_tests bench; do STATUS[$part]="not run: no usable GPU"; SECS[$part]=0; done
fi

echo
echo "== summary ($SECONDS s in all; logs in $DEST)"
for part in machine cases gpu_tests bench; do
  printf '  %-10s %-32s %4ss\n' "$part" "${STATUS[$part]:-not run}" "${SECS[$part]:-0}"
done
if [[ -s "$DEST/cases.jsonl" ]]; then
  "$PY" - "$DEST/cases.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith('{"case"')]
bad = [r["case"] for r in rows if not r["ok"]]
print(f"  cases: {len(rows) - len(bad)} of {len(rows)} passed" + (f"; failed: {bad}" if bad else ""))
PY
fi
if [[ -s "$DEST/pytest_gpu.log" ]]; then
  log="$DEST/pytest_gpu.log"
  echo "  gpu tests: $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed," \
    "$(grep -c ' ERROR' "$log") errors, $(grep -c ' SKIPPED' "$log") skipped" \
    "| $(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* =+$' "$log" | tail -n 1)"
fi
if [[ -s "$DEST/gpu_bench.json" ]]; then
  "$PY" - "$DEST/gpu_bench.json" <<'PY'
import json, sys
out = json.load(open(sys.argv[1]))
m = out["machine"]
print(f"  bench on {m.get('gpu', m['device'])}, torch {m['torch']}, triton {m.get('triton')}:")
for name, t in out["targets"].items():
    value = "null" if t["value"] is None else f"{t['value']:.3f}"
    print(f"    {name:26s} {value:>8s}  target >= {t['target']:<5}  {'met' if t['met'] else 'UNMET'}")
f = out["figures"]
print(f"    dlrm samples/s hybridrec {f['dlrm_gpu_samples_s']}, torch {f['dlrm_torch_samples_s']}")
print(f"    gpt tokens/s {f['gpt_tokens_s']}")
c = f["gpu_cache"]
if "samples_s" in c:
    print(f"    gpu_cache samples/s {json.dumps({k: round(v) for k, v in c['samples_s'].items()})}")
    print(f"    gpu_cache hit rate {json.dumps({k: round(v, 3) for k, v in c['hit_rate'].items()})}, "
          f"rows moved/step {json.dumps({k: round(v) for k, v in c['rows_moved_per_step'].items()})}")
else:
    print(f"    gpu_cache: {c.get('error') or c.get('skipped') or 'no figures'}")
for part, err in out["errors"].items():
    print(f"    error in {part}: {err}")
PY
elif [[ -s "$DEST/gpu_bench_parts.jsonl" ]]; then
  echo "  bench: no final JSON; the parts that finished ($DEST/gpu_bench_parts.jsonl):"
  "$PY" - "$DEST/gpu_bench_parts.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    part = json.loads(line)
    print(f"    {part.pop('part')}: " + json.dumps(part)[:300])
PY
else
  echo "  bench: no result"
fi
for part in machine cases gpu_tests bench; do
  [[ ${STATUS[$part]:-} == ok || ${STATUS[$part]:-} == none:* ]] || exit 1
done
