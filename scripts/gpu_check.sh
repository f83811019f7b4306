#!/usr/bin/env bash
# The whole GPU check in one command, on a bare GPU machine whose python has torch and no megatron
# packages: installs the wheels of ./.whl (`make gpu-wheels` downloads them) over that torch, runs
# the `gpu` tests and `python -m benchmarks --device cuda`, and writes to OUTDIR:
#   env.txt       GPU, driver, torch/CUDA/megatron versions, commit
#   pytest.log    `pytest -m gpu`, three processes run side by side (pytest-main.log,
#                 pytest-stock_parity.log, pytest-syrk.log, each with its summary line last)
#   stock_parity.md  ours against megatron-core's own optimizers in Megatron-LM's loop on one GPU:
#                 the largest relative differences of loss and grad norm, and the bf16 floor
#   bench.log     the benchmark's progress and report
#   results.json  the benchmark's figures and target verdicts; results.md, its tables (among them
#                 standard vs symmetric NS)
#   syrk.log      the syrk section's progress and report; syrk/, its results.json and results.md
#                 (Triton syrk NS, --muon-use-syrk, against the standard NS, where syrk can run)
# Usage: bash scripts/gpu_check.sh OUTDIR   (docs/gpu.md); GPU_CHECK_ONLY=tests, =bench or =syrk runs
# one part (tests: 5 minutes at most; bench and syrk each fit a 10-minute slot; the syrk section
# compiles and autotunes its kernels for each shape, 83-94 s a shape on an H100). In a 15-minute
# lease: tests first, then bench, then syrk. Exit status: 0 when the tests and every benchmark section
# ran; 1 otherwise; 2 without a CUDA device or with an unknown GPU_CHECK_ONLY.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

ONLY=${GPU_CHECK_ONLY:-}
case "$ONLY" in
  ""|tests|bench|syrk) ;;
  *) echo "gpu_check: GPU_CHECK_ONLY=$ONLY: expected tests, bench or syrk" >&2; exit 2 ;;
esac

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False):" \
       "run this on a machine with an NVIDIA GPU; on CPU, use make test and make bench." >&2
  exit 2
fi

SITE=${GPU_CHECK_SITE:-/tmp/megatron_muon_gpu_site}
if ! "$PY" -c "import megatron.core, megatron_fsdp, emerging_optimizers" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: megatron-core is not installed and ./.whl has no wheels: run make gpu-wheels" \
         "on a machine with internet access and bring .whl along" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ local changes)')"
  date -u "+%Y-%m-%d %H:%M UTC"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
if [ -z "$ONLY" ] || [ "$ONLY" = tests ]; then
  # Three pytest processes side by side on the one GPU, each bounded at 280 s, so that the part
  # ends within 5 minutes (docs/gpu.md has the estimate): test_gpu.py and the other gpu tests; the
  # comparisons with megatron-core's own optimizers (their launches side by side, their figures in
  # OUT/stock_parity.md); the syrk test, whose Triton kernels compile for 83-94 s. -v: each test's
  # name and verdict as it ends, so a run stopped at the bound says how far it got.
  PARITY=tests/test_megatron_lm_stock_parity.py
  SYRK_TEST=tests/test_gpu.py::test_syrk_newton_schulz_matches_the_standard_bf16_iteration
  gpu_pytest() {  # NAME PYTEST_ARGS...: writes OUT/pytest-NAME.log
    local name=$1
    shift
    timeout 280 "$PY" -m pytest -m gpu -p no:cacheprovider -v -rA --durations=0 "$@" \
      > "$OUT/pytest-$name.log" 2>&1
  }
  gpu_pytest main tests --ignore "$PARITY" --deselect "$SYRK_TEST" &
  main=$!
  MEGATRON_MUON_FIGURES="$OUT" gpu_pytest stock_parity "$PARITY" &
  parity=$!
  gpu_pytest syrk "$SYRK_TEST" &
  syrk=$!
  for pid in "$main" "$parity" "$syrk"; do wait "$pid" || status=1; done
  cat "$OUT/pytest-main.log" "$OUT/pytest-stock_parity.log" "$OUT/pytest-syrk.log" \
    > "$OUT/pytest.log"
  grep -E "(PASSED|FAILED|ERROR|SKIPPED)|(passed|failed|error).* in [0-9.]+s" "$OUT/pytest.log"
  cat "$OUT/stock_parity.md" 2>/dev/null || echo "gpu_check: no stock_parity.md (the comparisons did not finish)"
fi
QUIET="UserWarning|warnings.warn|SyntaxWarning|Evict LRU"
if [ -z "$ONLY" ] || [ "$ONLY" = bench ]; then
  # Every section but syrk; results.json is rewritten after every section: what finished survives
  # the time bound.
  SECTIONS=$("$PY" -c "from benchmarks.gpu_config import SECTION_NAMES as s
print(' '.join('--section ' + n for n in s if n != 'syrk'))")
  # shellcheck disable=SC2086  # one word per flag and name
  timeout 480 "$PY" -m benchmarks --device cuda --out "$OUT" $SECTIONS > "$OUT/bench.log" 2>&1 \
    || status=1
  grep -v -E "$QUIET" "$OUT/bench.log" | tail -60
fi
if [ -z "$ONLY" ] || [ "$ONLY" = syrk ]; then
  # A launch per shape, each bounded (benchmarks.gpu_run.SYRK_SHAPE_TIMEOUT_S).
  timeout 560 "$PY" -m benchmarks --device cuda --section syrk --out "$OUT/syrk" \
    > "$OUT/syrk.log" 2>&1 || status=1
  grep -v -E "$QUIET" "$OUT/syrk.log" | tail -30
fi
exit $status
