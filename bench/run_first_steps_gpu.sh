#!/usr/bin/env bash
# On the GPU machine, one call: the promoted trainers' first steps (issue 21, items 2 and 4).
# Each model in MODELS (default both) recovers from KILLS kills per phase (default 5; the GPT's
# run takes ~1.5 min, the Llama's ~2.5 min, ~5 min at KILLS=10), each first step's cost read
# over three steps against steady windows after the same recovery; then the run-ahead GPU test
# (kills while the host is far ahead of the device). With the machine's start, ~7 min.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
for model in ${MODELS:-gpt hf-llama}; do
  timeout 380 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase ${KILLS:-5} \
    --events-out "$OUT/events_${model}_first_steps.jsonl" \
    --json "$OUT/recovery_gpu_${model}_first_steps.json" \
    2>&1 | grep -v "^\s*$" | tail -4 | cut -c1-220
done
timeout 150 python3 -m pytest -q -x tests/gpu/test_run_ahead_gpu.py 2>&1 | tail -3
