#!/usr/bin/env bash
# The GPU check (benchmarks/README.md, "GPU"): on an offline GPU machine, the HF Trainer example
# sized as GPT-2 medium (random-initialised, bf16, sequence 1024) searched by dsat as a user runs
# it; the results directory goes to $OUT/search. Needs the wheels ../shared/GPU.md lists in .whl/.
#   METHOD=guided MAX_TRIALS=12 [EXTRA="--trial-host"] bash benchmarks/gpu/search_gpt2_medium.sh
set -euo pipefail
source benchmarks/gpu/prepare_gpt2_medium.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cd "$work"
start=$(date +%s)
# shellcheck disable=SC2086  # EXTRA: flags, split on purpose
python3 -m dsat "${METHOD:-guided}" deepspeed.yaml . --max-trials "${MAX_TRIALS:-12}" \
    --results-dir "$OUT/search" ${EXTRA:-} 2>&1 | tee "$OUT/search.log"
echo "search wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/search.log"
