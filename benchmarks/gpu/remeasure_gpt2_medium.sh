#!/usr/bin/env bash
# The GPU check's second half (benchmarks/README.md, "GPU"): re-measures what the search in
# benchmarks/results/gpu_gpt2_medium_search tried with a plain loop; JSON to $OUT.
#   TOP=5 REPEATS=2 bash benchmarks/gpu/remeasure_gpt2_medium.sh
set -euo pipefail
source benchmarks/gpu/prepare_gpt2_medium.sh
python3 benchmarks/measurement_fidelity_gpu.py benchmarks/results/gpu_gpt2_medium_search \
    --experiment /tmp/gpt2_medium/deepspeed.yaml --top "${TOP:-5}" --repeats "${REPEATS:-2}" \
    --output "$OUT/measurement_fidelity_gpu.json" 2>&1 | tee "$OUT/remeasure.log"
