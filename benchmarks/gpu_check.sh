#!/usr/bin/env bash
# One-shot GPU check, at most TOTAL (420) seconds on one GPU, every part bounded by `timeout`:
#   machine    GPU, torch, CUDA, triton, and whether a trivial Triton kernel builds here;
#   headline   benchmarks/gpu_bench.py --headline: kernel speed, DLRM step, GPT MFU first,
#              so that a loan cut short still yields them;
#   cases      the Triton kernels' correctness cases compiled on CUDA
#              (tests/support/triton_cases.py), in parallel shards;
#   gpu_tests  the in-process tests marked gpu (every placement and optimizer, state dicts,
#              caches, the fused lookup against the CPU);
#   bench      benchmarks/gpu_bench.py --after-headline: the kernels with every optimizer,
#              the embedding cache on the GPU, the compiled GPT (last line JSON, with the
#              headline's figures merged in);
#   jobs       (only when asked: GPU_CHECK_PARTS=jobs) the gpu tests that train whole jobs or
#              launch ranks: DLRM and LM for 100 steps at two precisions, torchrun, mpirun;
# then a summary: each part's status and seconds, and every benchmark target.
# Usage, from anywhere:  bash benchmarks/gpu_check.sh [--quick]   (--quick goes to the bench)
# Some parts only (a second full run and a cold start do not fit in 15 minutes of device
# time):  GPU_CHECK_PARTS="gpu_tests bench" bash benchmarks/gpu_check.sh
# The plan (parts and caps) without running anything:  GPU_CHECK_PLAN=1 bash benchmarks/gpu_check.sh
# Python: $PYTHON, else .venv/bin/python, else python3 (a CUDA build of torch, and triton).
# Logs, the cases' JSON lines, the bench's JSON (and its parts as they finish) go to $OUT
# (set by a device runner) or runs/gpu_check/.
#
# Budget, from counted compiles (a cold Triton cache compiles every kernel variant once per
# process: ~3 s for an update kernel, ~0.7 s for a forward one, ~0.5 s for the others, on
# one core). The counts are the distinct (kernel, constexprs, argument types) the parts
# launch, counted with Triton's interpreter (the dispatch forced on the CPU variants):
#   machine    30 s: imports ~5 s; the launcher's C module (one gcc run, ~3 s) + 1 kernel.
#   headline   90 s: start, CUDA context, 1 GB copy buffer ~10 s;
#              kernels: forward 8 configs x 1 (the L1 and L20 keys share binaries: pooling is
#                not specialised) + occurrence 1 + update 1 (row-wise Adagrad) = 10 compiles
#                ~9 s, timing 2 poolings x 2 kernels x 2 impls x 260 calls ~5 s;
#              dlrm: 2 x 26 x 1 M x 128 tables ~5 s; forward 8 configs (D 128) + 1 + 1 = 10
#                compiles ~10 s; 2 precisions x 2 impls x 12 steps ~3 s;
#              gpt: forward 7 configs (D 768 prunes one) + 1 + update Adam (6 column blocks)
#                = 9 compiles ~10 s; 12 steps with cuBLAS and SDPA warm-up ~3 s
#              ~55 s in all.
#   cases      60 s: 65 compiles: update 31 (6 optimizer codes x {runs, coalesced rows} x
#                {scaled, not} x BLOCK_D {16, 32, 64, 128} x column blocks, as the cases reach
#                them) + forward 29 (8 configs x 2 modes in fwd_every_config + 13 fixed-config
#                variants) + occurrence 4 + probe 1 = 31 x 3 + 29 x 0.7 + 4 x 0.5 ~ 115 s on
#                one core. Autotuning is off there (fwd_every_config runs every config): on,
#                17 launch keys x 8 configs = 136 forward compiles more (~95 s). In 8 shards
#                in parallel the largest compiles ~25 s, + ~10 s to start.
#   gpu_tests  120 s: update 19 (embedding_device 9, state_dict 2, cache_device 2, the fused
#                lookup at D 24: 6) + forward 11 + occurrence 6 ~ 19 x 3 + 11 x 0.7 + 6 x 0.5
#                ~ 68 s, autotuning off (on: 12 keys x 8 configs = 96 forward compiles more,
#                ~67 s); ~40 s of tests.
#   bench      what is left, >= 110 s: kernels with 5 more update compiles (~15 s) and 6
#                optimizers x 2 poolings timed (~15 s); the cache part in what remains (at
#                least 30 s, at most 90 s); the compiled GPT only with 45 s left.
#   30 + 90 + 60 + 120 + 110 = 410 <= TOTAL = 420; a cold start (1-2 minutes) besides
#   leaves room in 15 minutes for a rerun of some parts, or for `jobs` (380 s) alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST="${OUT:-runs/gpu_check}"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

TOTAL=420  # seconds for the whole check (the summary takes a few more)
ORDER=(machine headline cases gpu_tests bench jobs)
declare -A CAP=([machine]=30 [headline]=90 [cases]=60 [gpu_tests]=120 [bench]=110 [jobs]=380)
REST_PARTS=" bench jobs "  # these get all that is left (at least their cap is reserved)
DEFAULT_PARTS="headline cases gpu_tests bench"
PARTS=" machine ${GPU_CHECK_PARTS:-$DEFAULT_PARTS} "  # the machine check always runs
CASE_SHARDS=8  # processes compiling the cases' kernels in parallel (16 cores)

# In-process gpu test files first (every placement and optimizer, state dicts, kernels):
# they answer the most per second. Files that train whole jobs or launch ranks are the
# `jobs` part; any other file with gpu tests goes at the end of gpu_tests.
IN_PROCESS=(tests/embedding/test_embedding_device.py tests/embedding/test_embedding_state_dict.py
            tests/cache/test_cache_device.py tests/ps/test_ps_inprocess.py
            tests/ps/test_ps_init_device.py tests/embedding/test_triton_kernels.py
            tests/embedding/test_sparse_pipeline.py tests/jobs/test_checkpoint_cuda_rng.py)
JOB_FILES=(tests/jobs/test_device_jobs.py tests/jobs/test_memory_plan.py
           tests/comm/test_comm_device.py tests/cache/test_cache_mpi.py)

selected() { [[ $PARTS == *" $1 "* ]]; }
reserved_after() {  # the caps of the selected parts after part $1
  local seen=0 sum=0 p
  for p in "${ORDER[@]}"; do
    if (( seen )) && selected "$p"; then sum=$(( sum + CAP[$p] )); fi
    [[ $p == "$1" ]] && seen=1
  done
  echo "$sum"
}
limit_of() {  # seconds part $1 may run: its cap (a rest part: all that is left), within
  # what the selected parts after it leave; never under 10
  local left=$(( TOTAL - SECONDS - $(reserved_after "$1") )) lim=${CAP[$1]}
  if [[ $REST_PARTS == *" $1 "* ]] || (( left < lim )); then lim=$left; fi
  (( lim < 10 )) && lim=10
  echo "$lim"
}

if [[ ${GPU_CHECK_PLAN:-0} == 1 ]]; then
  echo "total ${TOTAL}s; default parts: $DEFAULT_PARTS"
  for p in "${ORDER[@]}"; do
    if selected "$p"; then kind="cap"; [[ $REST_PARTS == *" $p "* ]] && kind="rest, at least"
      echo "part $p $kind ${CAP[$p]}s"
    fi
  done
  exit 0
fi
mkdir -p "$DEST"

declare -A STATUS SECS
run_part() {  # run_part <name> <log> <command...>: status and seconds recorded
  local name=$1 log=$2 t0=$SECONDS rc=0 limit
  shift 2
  if ! selected "$name"; then
    STATUS[$name]="skipped (GPU_CHECK_PARTS)"; SECS[$name]=0; return
  fi
  limit=$(limit_of "$name")
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  SECS[$name]=$(( SECONDS - t0 ))
  if (( rc == 124 || rc == 137 )); then STATUS[$name]="timed out after ${limit}s"
  elif (( rc == 0 )); then STATUS[$name]="ok"
  else STATUS[$name]="failed (exit $rc)"; fi
  echo "== $name: ${STATUS[$name]} in ${SECS[$name]}s"
}

cases_in_shards() {  # the cases in CASE_SHARDS processes at once; exit 1 if any failed
  local i rc=0 pids=()
  for (( i = 0; i < CASE_SHARDS; i++ )); do
    "$PY" tests/support/triton_cases.py --device cuda --shard "$i/$CASE_SHARDS" \
      > "$DEST/cases.$i.jsonl" 2> "$DEST/cases.$i.err" &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { rc=1; tail -n 20 "$DEST/cases.$i.err"; }
  done
  return $rc
}
export -f cases_in_shards
export PY DEST CASE_SHARDS

gpu_pytest() {  # the gpu tests of the given files: -v names each result as it comes, so a
  # timed-out run still says which passed; only those files are collected (others import
  # packages this machine may lack). Autotuning off: the cases run every forward config.
  env HYBRIDREC_REQUIRE_TRITON=1 HYBRIDREC_TRITON_AUTOTUNE=0 "$PY" -m pytest -m gpu -v \
    -p no:cacheprovider --continue-on-collection-errors "$@"
}
export -f gpu_pytest

# A part about to run drops its earlier results (those of parts not run this time stay:
# --after-headline reads the headline's).
selected headline && rm -f "$DEST"/gpu_bench_headline*
selected cases && rm -f "$DEST"/cases.*.jsonl "$DEST"/cases.*.err
selected bench && rm -f "$DEST"/gpu_bench.json "$DEST"/gpu_bench_parts.jsonl
run_part machine "$DEST/machine.log" "$PY" - <<'PY'
import sys
import warnings
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
from embedding.kernels import triton_builds, triton_prerequisites
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    builds = triton_builds(torch.device("cuda"))
if builds:
    print("triton kernels: build here")
else:  # the tables fall back to torch; the kernel parts will fail and say why
    why = "; ".join(str(w.message) for w in caught) or ", ".join(triton_prerequisites())
    print(f"triton kernels: CANNOT BUILD here ({why})")
PY
nvidia-smi -L 2>/dev/null | tee -a "$DEST/machine.log" || true

if [[ ${STATUS[machine]} == ok ]]; then
  run_part headline "$DEST/headline.log" \
    "$PY" benchmarks/gpu_bench.py --headline --out "$DEST" "$@"

  run_part cases "$DEST/cases.log" bash -c cases_in_shards

  mapfile -t MARKED < <(grep -l "mark.gpu" tests/*/test_*.py)
  GPU_TESTS=() JOBS=()
  for f in "${IN_PROCESS[@]}"; do [[ " ${MARKED[*]} " == *" $f "* ]] && GPU_TESTS+=("$f"); done
  for f in "${JOB_FILES[@]}"; do [[ " ${MARKED[*]} " == *" $f "* ]] && JOBS+=("$f"); done
  for f in "${MARKED[@]}"; do
    [[ " ${IN_PROCESS[*]} ${JOB_FILES[*]} " == *" $f "* ]] || GPU_TESTS+=("$f")
  done
  # The cases ran above: their pytest twin is deselected. The shell timeout bounds the
  # whole run (pytest-timeout may be absent).
  if (( ${#GPU_TESTS[@]} )); then
    run_part gpu_tests "$DEST/pytest_gpu.log" bash -c 'gpu_pytest "$@"' gpu_pytest \
      --deselect tests/embedding/test_triton_kernels.py::test_triton_cases_on_cuda \
      "${GPU_TESTS[@]}"
  else
    STATUS[gpu_tests]="none: no test file has a gpu mark"; SECS[gpu_tests]=0
  fi

  BENCH_LIMIT=$(limit_of bench)
  run_part bench "$DEST/bench.log" "$PY" benchmarks/gpu_bench.py --after-headline \
    --out "$DEST" --budget-s $(( BENCH_LIMIT > 30 ? BENCH_LIMIT - 15 : 15 )) "$@"

  if (( ${#JOBS[@]} )); then
    run_part jobs "$DEST/pytest_jobs.log" bash -c 'gpu_pytest "$@"' gpu_pytest "${JOBS[@]}"
  else
    STATUS[jobs]="none: no job file has a gpu mark"; SECS[jobs]=0
  fi
else
  for part in "${ORDER[@]:1}"; do STATUS[$part]="not run: no usable GPU"; SECS[$part]=0; done
fi

echo
echo "== summary ($SECONDS s in all; logs in $DEST)"
for part in "${ORDER[@]}"; do
  printf '  %-10s %-32s %4ss\n' "$part" "${STATUS[$part]:-not run}" "${SECS[$part]:-0}"
done
grep -h "^triton kernels:" "$DEST/machine.log" 2>/dev/null | sed 's/^/  /'
if compgen -G "$DEST/cases.*.jsonl" > /dev/null; then
  "$PY" - "$DEST"/cases.*.jsonl <<'PY'
import json, sys
rows = {}
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith('{"case"'):
            r = json.loads(line)
            rows[r["case"]] = r
bad = sorted(n for n, r in rows.items() if not r["ok"])
print(f"  cases: {len(rows) - len(bad)} of {len(rows)} passed" + (f"; failed: {bad}" if bad else ""))
PY
fi
for log in "$DEST/pytest_gpu.log" "$DEST/pytest_jobs.log"; do
  [[ -s "$log" ]] || continue
  echo "  $(basename "$log" .log): $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log")" \
    "failed, $(grep -c ' ERROR' "$log") errors, $(grep -c ' SKIPPED' "$log") skipped" \
    "| $(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* =+$' "$log" | tail -n 1)"
done
BENCH_JSON="$DEST/gpu_bench.json"
[[ -s "$BENCH_JSON" ]] || BENCH_JSON="$DEST/gpu_bench_headline.json"
if [[ -s "$BENCH_JSON" ]]; then
  "$PY" - "$BENCH_JSON" <<'PY'
import json, sys
out = json.load(open(sys.argv[1]))
m = out["machine"]
print(f"  bench ({sys.argv[1].rsplit('/', 1)[-1]}) on {m.get('gpu', m['device'])}, "
      f"torch {m['torch']}, triton {m.get('triton')}:")
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
else
  for parts in "$DEST/gpu_bench_parts.jsonl" "$DEST/gpu_bench_headline_parts.jsonl"; do
    [[ -s "$parts" ]] || continue
    echo "  bench: no final JSON; the parts that finished ($parts):"
    "$PY" - "$parts" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    part = json.loads(line)
    print(f"    {part.pop('part')}: " + json.dumps(part)[:300])
PY
  done
  compgen -G "$DEST/gpu_bench*_parts.jsonl" > /dev/null || echo "  bench: no result"
fi
for part in "${ORDER[@]}"; do
  s=${STATUS[$part]:-}
  [[ $s == ok || $s == none:* || $s == skipped* ]] || exit 1
done
