#!/usr/bin/env bash
# One device call on the H200 (see ../shared/device/README.md): install the staged wheels, then
# run the steps named as arguments, writing results under $OUT.
#   steps: occupancy gputests verify winners operators throughput mlp spaces ktexamples compile
#          fleet batch sweep baselines profile (default: occupancy gputests operators)
#   `verify` runs the pytest selections of VERIFY_TESTS (separated by ";", e.g. "tests/gpu/
#   test_matmul_gpu.py -k stream_k; tests/gpu/test_sort_gpu.py"), each in a process of its own
#   (a kernel's trap kills its CUDA context, and with it every later test of that process),
#   VERIFY_JOBS (default 4) at once, each cut after VERIFY_TIMEOUT s (default 150): for
#   correctness only, since they share the GPU; a line per selection in $OUT/verify/summary.txt.
#   `batch` runs benchmarks/batch_tuning.py --compare-serial (issue 35; BATCH_ARGS: more
#   options); `sweep` runs benchmarks/matmul_sweep.py (SWEEP_ARGS, e.g. "--engine mma --dtypes
#   float32 --case matmul:1000x1001x999").
#   `profile` runs Nsight Compute on benchmarks/profile_case.py for each entry of PROFILES
#   (";"-separated "operator:shape:dtype [config JSON]", the stored winner where no config is
#   given), the kernels matching PROFILE_KERNEL (regex, default: the operator's name), one
#   launch each, sections PROFILE_SECTIONS (default SpeedOfLight MemoryWorkloadAnalysis):
#   $OUT/profile/<i>.txt, e.g. one config at an odd and an aligned shape.
#   `fleet` runs benchmarks/fleet_gpus.py on every visible GPU (a machine with several:
#   nvidia-h200-x2 or larger; issue 36): a batch on N GPUs and on 1, a shared job, kill -9 and
#   planted faults, device binding; FLEET_ARGS: more options (--gpus 2, --db URL, budgets).
#   `compile` runs every tests/kernels/*_compile.py module over every distinct variant
#   (KATO_COMPILE_FULL=1, both archs, 4 modules at once x 4 nvcc; CI compiles only a covering sample of them),
#   cut after COMPILE_TIMEOUT s (default 560); COMPILE_TESTS: other test paths.
#   The whole GPU suite (about 1,500 tests) does not fit one device call (600 s): on 2026-12-06
#   its first 283 tests (add_layernorm .. batchnorm_train) took the whole call on an H100. Split
#   it: GPU_SHARD=i/n runs every n-th test file from the i-th (1-based) of tests/gpu; `winners`
#   runs the committed winners' check, each in a call of its own.
#   env: GPU_TESTS (pytest paths, default tests/gpu minus the winners), GPU_SHARD (i/n), TUNE_BUDGET, CASES ("relu layernorm:1048576x128 ..."),
#        TUNE_ONLY=1, MAX_MINUTES, AWKWARD=1 (operators.py's awkward case set), WHERE ("PARAM=V1,V2 ...":
#        operators.py sweeps the matching configs of each case instead of timing its winner), DB (SQLAlchemy URL of the results database; data/h200 is
#        imported into it first, and the operators step exports it to $OUT/h200),
#        THROUGHPUT_ARGS, SPACES ("op:shape:dtype ..." to brute-force, each cut after SPACE_TIMEOUT s),
#        KT_EXAMPLES, KT_SCRIPTS, KT_SCRIPT_BUDGET, KT_SCRIPT_TIMEOUT, KT_SCRIPT_RETIME=1 (both
#        tools' best of each call measured again on Kato's timer) (ktexamples),
#        BASELINE_DATA (folders of winners to import, default data/h100), BASELINE_TIMEOUT,
#        BASELINE_ARGS (more `kato baseline` options, e.g. "--operator layernorm_relu": the
#        105 H200 winners take longer than one call) (baselines)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 KATO_COMPILE_CACHE=/tmp/kato-cubin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
steps=${*:-occupancy gputests operators}
DB=${DB:-sqlite:///$OUT/kato.db}
kato() { python3 -c 'from kato.service.cli import main; main()' "$@"; }
# Every device call starts bare: load the committed tuning results (data/h200, kato export).
kato import data/h200 --db "$DB" | tail -1
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    occupancy) python3 benchmarks/occupancy_check.py --cache-dir /tmp/kato-cubin \
                 --out "$OUT/occupancy_h200.json" 2>&1 | tail -25 ;;
    gputests) tests=${GPU_TESTS:-tests/gpu --ignore=tests/gpu/test_committed_winners_gpu.py}
              if [ -n "${GPU_SHARD:-}" ]; then
                tests=$(ls tests/gpu/test_*_gpu.py | grep -v committed_winners \
                        | awk -v i="${GPU_SHARD%/*}" -v n="${GPU_SHARD#*/}" '(NR - i) % n == 0')
              fi
              python3 -m pytest -q -p no:cacheprovider --durations=15 $tests 2>&1 \
                 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    verify) mkdir -p "$OUT/verify"; i=0
            while IFS= read -r sel; do
              eval "set -- $sel"; [ $# -eq 0 ] && continue; i=$((i + 1))  # shell quoting kept
              ( timeout "${VERIFY_TIMEOUT:-150}" python3 -m pytest -q -x -p no:cacheprovider "$@" \
                  > "$OUT/verify/$i.log" 2>&1
                echo "rc=$? ${sel# }: $(tail -1 "$OUT/verify/$i.log")" >> "$OUT/verify/summary.txt" ) &
              while [ "$(jobs -rp | wc -l)" -ge "${VERIFY_JOBS:-4}" ]; do sleep 1; done
            done < <(echo "${VERIFY_TESTS:-}" | tr ';' '\n')
            wait; cat "$OUT/verify/summary.txt" 2>/dev/null ;;
    compile) KATO_COMPILE_FULL=1 KATO_COMPILE_WORKERS=4 timeout "${COMPILE_TIMEOUT:-560}" \
                 python3 -m pytest -q -p no:cacheprovider --durations=15 -n 4 \
                 ${COMPILE_TESTS:-tests/kernels/test_*_compile.py} 2>&1 \
                 | tee "$OUT/compile_full.log" | tail -30 ;;
    winners) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_committed_winners_gpu.py \
                 2>&1 | tee "$OUT/gpu_winners.log" | tail -20 ;;
    operators) ops=(); for o in ${CASES:-}; do ops+=(--case "$o"); done
               for w in ${WHERE:-}; do ops+=(--where "$w"); done
               python3 benchmarks/operators.py --db "$DB" \
                 --tune "${TUNE_BUDGET:-0}" ${TUNE_ONLY:+--tune-only} \
                 ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} ${AWKWARD:+--awkward} "${ops[@]}" \
                 --out "$OUT/operators.json" 2>&1 | tee "$OUT/operators.log" | tail -60
               # Whatever was tuned comes back as files to commit under data/h200.
               kato export "$OUT/h200" --db "$DB" | tail -2 ;;
    fleet) python3 benchmarks/fleet_gpus.py --out "$OUT/fleet_gpus.json" ${FLEET_ARGS:-} 2>&1 \
                 | tee "$OUT/fleet_gpus.log" | tail -60 ;;
    mlp) python3 benchmarks/torch_mlp.py --db "$DB" --out "$OUT/torch_mlp.json" 2>&1 \
                 | tee "$OUT/torch_mlp.log" | tail -10 ;;
    batch) python3 benchmarks/batch_tuning.py --compare-serial ${BATCH_ARGS:-} \
                 --out "$OUT/batch_tuning.json" 2>&1 | tee "$OUT/batch_tuning.log" | tail -30 ;;
    sweep) python3 benchmarks/matmul_sweep.py --out "$OUT/matmul_sweep.json" ${SWEEP_ARGS:-} \
                 2>&1 | tee "$OUT/matmul_sweep.log" | tail -12 ;;
    throughput) python3 benchmarks/tuning_throughput.py --out "$OUT/tuning_throughput.json" \
                 ${THROUGHPUT_ARGS:-} 2>&1 | tee "$OUT/throughput.log" | tail -30 ;;
    spaces) # Brute-force whole spaces (grid strategy, every valid config) and export them in
            # Kernel Tuner's cache format: recorded spaces for the replay backend's tests.
            for case in ${SPACES:-softmax:32768x4096:float16}; do
              IFS=: read -r op shape dt <<< "$case"
              timeout "${SPACE_TIMEOUT:-300}" python3 -c 'from kato.service.cli import main; main()' \
                tune "$op" --shape "$shape" --dtype "$dt" --budget 5000 --strategy grid \
                --db "sqlite:///$OUT/spaces.db" --json 2>&1 | tail -4
            done
            kato export "$OUT/spaces" --format kt --db "sqlite:///$OUT/spaces.db" | tail -4 ;;
    ktexamples) # Kernel Tuner's own examples/cuda scripts, unchanged, through Kernel Tuner and
            # through kato.tune_kernel (KT_EXAMPLES: a copy of that folder; kernel_tuner staged
            # as a wheel: ../shared/device/stage.sh kernel-tuner). One JSON per script, so a
            # cut-short call still returns what ran.
            for script in ${KT_SCRIPTS:-vector_add.py stencil.py matmul.py spmv.py}; do
              timeout $(( ${KT_SCRIPT_TIMEOUT:-240} * 2 + 30 )) python3 benchmarks/kt_examples.py --cases none \
                --kt-scripts "${KT_EXAMPLES:-.kt-examples}" --scripts "$script" \
                --script-budget "${KT_SCRIPT_BUDGET:-0}" --timeout "${KT_SCRIPT_TIMEOUT:-240}" \
                $([ "${KT_SCRIPT_RETIME:-0}" = 1 ] && echo --script-retime) \
                --out "$OUT/kt_${script%.py}.json" 2>&1 | tail -4
            done ;;
    baselines) # PyTorch's eager and compiled baselines (kato baseline) for the committed
            # winners of this GPU's model that lack them, exported back as files to commit.
            for d in ${BASELINE_DATA:-data/h100}; do kato import "$d" --db "$DB" | tail -1; done
            timeout "${BASELINE_TIMEOUT:-500}" python3 -c 'from kato.service.cli import main; main()' \
              baseline --db "$DB" ${BASELINE_ARGS:-} 2>&1 | tee "$OUT/baselines.log" | tail -60
            model=$(python3 -c 'import torch; from kato.shared.gpus import normalize_gpu_name as n; print(n(torch.cuda.get_device_name(0)))')
            kato export "$OUT/baselines" --db "$DB" --gpu "$model" | tail -2 ;;
    profile) mkdir -p "$OUT/profile"; i=0
            while IFS= read -r entry; do
              entry=$(echo "$entry" | sed 's/^ *//'); [ -z "$entry" ] && continue; i=$((i + 1))
              case_=${entry%% *}; config=""; [ "$case_" != "$entry" ] && config=${entry#* }
              sections=(); for s in ${PROFILE_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis}; do
                sections+=(--section "$s"); done
              timeout "${PROFILE_TIMEOUT:-120}" ncu --kernel-name "regex:${PROFILE_KERNEL:-${case_%%:*}}" \
                --launch-count 1 "${sections[@]}" python3 benchmarks/profile_case.py --db "$DB" \
                --case "$case_" ${config:+--config "$config"} > "$OUT/profile/$i.txt" 2>&1
              echo "rc=$? $entry"; grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Hit|dram__bytes|Mem Busy" "$OUT/profile/$i.txt" | head -8
            done < <(echo "${PROFILES:-}" | tr ';' '\n') ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== end $(date +%T)"
