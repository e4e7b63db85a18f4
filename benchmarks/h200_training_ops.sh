#!/usr/bin/env bash
# One device call on the H200 for the row-wise training operators (rmsnorm, rmsnorm_backward,
# softmax_backward, cross_entropy, cross_entropy_backward, layernorm_backward, add_rmsnorm,
# add_layernorm) and the training batchnorm (batchnorm, batchnorm_backward): install the staged
# wheels (.device-wheels/, ../shared/device/stage.sh), then run the steps named as arguments,
# writing results under $OUT (at most 8 files come back: the export is one archive).
#   steps: tests   their GPU tests (every valid config at the odd widths, defaults on awkward
#                  shapes; GPU_K: a pytest -k expression, GPU_TESTS: other paths)
#          compile their compile tests over every distinct variant (KATO_COMPILE_FULL=1, sm_90,
#                  cut after COMPILE_TIMEOUT s; COMPILE_TESTS: other test paths)
#          tune    tune every benchmark case of benchmarks/torch_ops/{rmsnorm,rmsnorm_backward,
#                  softmax_backward,cross_entropy,cross_entropy_backward,layernorm_backward,
#                  add_rmsnorm,add_layernorm,batchnorm,batchnorm_backward}.py (TUNE_BUDGET
#                  configs each, default 40; MAX_MINUTES: start no tuning job after that;
#                  IMPORT_DIR: earlier winners to load first) into a fresh database, time each winner
#                  against PyTorch and the copy bandwidth (benchmarks/operators.py), export the
#                  winners ($OUT/h200.tgz, for data/h200)
#          defaults  the same timing with each operator's default config, nothing tuned
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 KATO_COMPILE_CACHE=/tmp/kato-cubin KATO_TEST_CUBIN_CACHE=/tmp/kato-test-cubin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
OPS="rmsnorm rmsnorm_backward softmax_backward cross_entropy cross_entropy_backward
  layernorm_backward add_rmsnorm add_layernorm batchnorm batchnorm_backward"
cases=(); for o in $OPS; do cases+=(--case "$o"); done
kato() { python3 -c 'from kato.service.cli import main; main()' "$@"; }
for step in ${*:-tests}; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider --durations=20 ${GPU_K:+-k "$GPU_K"} \
             ${GPU_TESTS:-tests/gpu/test_softmax_backward_gpu.py tests/gpu/test_rmsnorm_gpu.py \
             tests/gpu/test_rmsnorm_backward_gpu.py tests/gpu/test_cross_entropy_gpu.py \
             tests/gpu/test_layernorm_backward_gpu.py tests/gpu/test_add_rmsnorm_gpu.py \
             tests/gpu/test_add_layernorm_gpu.py tests/gpu/test_batchnorm_train_gpu.py} \
             2>&1 | tee "$OUT/gpu_tests.log" | tail -45 ;;
    compile) KATO_COMPILE_FULL=1 KATO_COMPILE_TEST_ARCHS=sm_90 timeout "${COMPILE_TIMEOUT:-600}" \
             python3 -m pytest -q -p no:cacheprovider -s ${COMPILE_TESTS:-\
             tests/kernels/test_softmax_backward_compile.py tests/kernels/test_rmsnorm_compile.py \
             tests/kernels/test_rmsnorm_backward_compile.py tests/kernels/test_cross_entropy_compile.py \
             tests/kernels/test_layernorm_backward_compile.py tests/kernels/test_add_rmsnorm_compile.py \
             tests/kernels/test_add_layernorm_compile.py tests/kernels/test_batchnorm_train_compile.py} \
             2>&1 | tee "$OUT/compile_full.log" | tail -12 ;;
    tune) DB=sqlite:///$OUT/kato.db
          # IMPORT_DIR: winners tuned earlier (kato export files) that need no tuning again.
          [[ -n "${IMPORT_DIR:-}" ]] && kato import "$IMPORT_DIR" --db "$DB" | tail -1
          python3 benchmarks/operators.py --db "$DB" --tune "${TUNE_BUDGET:-40}" "${cases[@]}" \
            ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} \
            --out "$OUT/operators.json" 2>&1 | tee "$OUT/operators.log" | tail -40
          kato export /tmp/h200 --db "$DB" | tail -2 && tar czf "$OUT/h200.tgz" -C /tmp h200 ;;
    defaults) python3 benchmarks/operators.py --db "sqlite:////tmp/empty.db" "${cases[@]}" \
            --out "$OUT/defaults.json" 2>&1 | tee "$OUT/defaults.log" | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== end $(date +%T)"
