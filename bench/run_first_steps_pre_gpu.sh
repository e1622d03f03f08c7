#!/usr/bin/env bash
# On the GPU machine (~5 min with the start): both models' recoveries again, 5 kills per
# phase, with a promoted trainer's heap frozen until both loader scans ran (issue 21, item 2:
# the update kills' second steps).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
for model in ${MODELS:-hf-llama gpt}; do
  timeout 150 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase 5 \
    --events-out "$OUT/events_${model}_unfreeze.jsonl" \
    --json "$OUT/recovery_gpu_${model}_unfreeze.json" \
    2>&1 | grep -v "^\s*$" | tail -3 | cut -c1-220
done
