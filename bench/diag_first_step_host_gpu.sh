#!/usr/bin/env bash
# On the GPU machine: what the first step after promotion does on the host that a steady
# step does not (issue 21, item 2). Each process's first and steady step profiled (tables
# in $OUT/prof_*.tgz), and the host's time to queue each phase (LETO_PHASE_TIMES=host).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
for model in gpt hf-llama; do
  LETO_PROFILE_DIR=/tmp/prof_$model timeout 120 python3 -u bench/recovery_gpu.py --model $model \
    --kills-per-phase 1 --json "$OUT/${model}_prof.json" 2>&1 | grep -v "^\s*$" | tail -8 | cut -c1-300
  tar czf "$OUT/prof_$model.tgz" -C /tmp "prof_$model"
done
LETO_PHASE_TIMES=host timeout 150 python3 -u bench/recovery_gpu.py --model hf-llama \
  --kills-per-phase 2 --events-out "$OUT/events_llama_host.jsonl" --json "$OUT/llama_host.json" \
  2>&1 | tail -3 | cut -c1-200
