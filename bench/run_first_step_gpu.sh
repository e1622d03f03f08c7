#!/usr/bin/env bash
# On the GPU machine, one call (~6 min with the start): issue 21, item 2, with the gradient
# landing's multi-tensor copy warmed in the shadow. The first step after promotion of both
# models (5 kills per phase), then one kill per phase of the GPT profiled (tables in
# $OUT/prof_gpt.tgz: the first step's host time by op against a steady step's).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
for model in gpt hf-llama; do
  timeout 200 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase 5 \
    --events-out "$OUT/events_$model.jsonl" --json "$OUT/recovery_gpu_${model}_landing_warmed.json" \
    2>&1 | grep -v "^\s*$" | tail -19 | cut -c1-200
done
LETO_PROFILE_DIR=/tmp/prof_gpt timeout 100 python3 -u bench/recovery_gpu.py --kills-per-phase 1 \
  --json "$OUT/gpt_prof.json" 2>&1 | tail -3 | cut -c1-200
tar czf "$OUT/prof_gpt.tgz" -C /tmp prof_gpt
