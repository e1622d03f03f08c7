#!/usr/bin/env bash
# On the GPU machine, one call (~7 min with the start; the Llama run alone takes ~2.5 min): the promoted trainers' first steps
# (issue 21, items 2 and 4): both models' recoveries (MODELS, default both), 5 kills per
# phase, each first step's cost read over three steps; and the run-ahead GPU test (kills
# while the host is far ahead of the device).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
for model in ${MODELS:-gpt hf-llama}; do
  timeout 280 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase 5 \
    --events-out "$OUT/events_${model}_first_steps.jsonl" \
    --json "$OUT/recovery_gpu_${model}_first_steps.json" \
    2>&1 | grep -v "^\s*$" | tail -4 | cut -c1-220
done
timeout 150 python3 -m pytest -q -x tests/gpu/test_run_ahead_gpu.py 2>&1 | tail -3
