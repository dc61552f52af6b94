#!/usr/bin/env bash
# The GPU check of the trial host (benchmarks/README.md, "GPU"), prepared to run as one command
# on a lent GPU machine: which imports start threads or the CUDA driver, then the GPT-2 medium
# search in each VARIANT on the same warm machine, each cut at its time limit (SIGINT, as a user's
# Ctrl-C), its per-trial times printed and its results directory tarred into $OUT (the device tool
# brings back only shallow files). Needs the wheels ../shared/GPU.md lists in .whl/.
# USER_MB=N sets the user's micro-batch (the baseline, the host's second trial: 40 runs out of
# memory on an H100 80GB, so its OOM is confirmed in a fresh process). IMPORTS=0 skips the imports'
# threads; REMEASURE_TOP=N re-measures the host search's handed-over configuration and its N-1
# leaders with a plain loop (measurement_fidelity_gpu.py), if it got there.
# The user's config in a host against fresh, several times in turn (it is the search's second trial):
#   VARIANTS="host no-host host no-host host no-host" HOST_S=45 NO_HOST_S=80 MAX_TRIALS=2 IMPORTS=0
#   VARIANTS="host no-host" HOST_S=240 NO_HOST_S=180 MAX_TRIALS=8 bash benchmarks/gpu/check_trial_host.sh
set -uo pipefail
source benchmarks/gpu/prepare_gpt2_medium.sh
repo=$PWD
if [ -n "${USER_MB:-}" ]; then  # the user's micro-batch: 40 runs out of memory on an H100 80GB
    sed -i "s/--per_device_train_batch_size 4 /--per_device_train_batch_size $USER_MB /" \
        "$work/deepspeed.yaml"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
[ "${IMPORTS:-1}" = 0 ] || (cd "$work" && timeout 120 python3 "$repo/benchmarks/gpu/import_threads.py" \
    determined torch model transformers deepspeed dsat 2>&1 | grep -v Warning) \
    | tee "$OUT/imports_threads.log"
n=0 seen=" "
for variant in ${VARIANTS:-host no-host}; do  # a variant that comes again: its files numbered
    n=$((n + 1))
    name=$variant
    case $seen in *" $variant "*) name=$n-$variant ;; esac
    seen="$seen$variant "
    case $variant in
        host) flags="--trial-host" limit=${HOST_S:-240} ;;
        no-host) flags="--no-trial-host" limit=${NO_HOST_S:-180} ;;  # fresh once the worker is cold
        *) echo "unknown variant $variant"; continue ;;
    esac
    results=/tmp/gpu_check/$name
    rm -rf "$results"
    start=$(date +%s)
    # shellcheck disable=SC2086  # flags: split on purpose
    (cd "$work" && timeout -k 20 -s INT "$limit" python3 -m dsat guided deepspeed.yaml . \
        --max-trials "${MAX_TRIALS:-8}" --results-dir "$results" $flags > "$OUT/$name.log" 2>&1)
    echo "== $name: exit $?, $(( $(date +%s) - start )) s"
    grep "^dsat: trial \|^dsat: slot\|handed over" "$OUT/$name.log" | cut -c1-200
    python3 "$repo/benchmarks/gpu/trial_times.py" "$results" | tee "$OUT/$name-times.txt"
    tar czf "$OUT/$name.tgz" -C "$results" .
done
if [ -n "${REMEASURE_TOP:-}" ] && [ -f /tmp/gpu_check/host/best_ds_config.json ]; then
    start=$(date +%s)
    python3 benchmarks/measurement_fidelity_gpu.py /tmp/gpu_check/host --top "$REMEASURE_TOP" \
        --repeats "${REPEATS:-1}" --output "$OUT/measurement_fidelity_gpu.json" 2>&1 \
        | grep -v Warning | tail -n 30 | tee "$OUT/remeasure.log"
    echo "== remeasure: $(( $(date +%s) - start )) s"
fi
