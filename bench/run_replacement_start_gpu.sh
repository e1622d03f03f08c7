#!/usr/bin/env bash
# On the GPU machine, one call (~6 min with the start): issue 21, item 2. A replacement shadow
# now starts its device after its promoted predecessor's first step; before, the first step
# after promotion of forward and backward kills took 1.23-1.28x the median step (BENCHMARKS.md,
# 2026-12-07, fourth call). The same commands as then, the GPT first, then the HF Llama.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -u bench/recovery_gpu.py --kills-per-phase 5 \
  --json "$OUT/recovery_gpu_gpt_gate.json" 2>&1 | tail -19 | cut -c1-200
timeout 120 python3 -u bench/recovery_gpu.py --kills-per-phase 2 --phase-times \
  --json "$OUT/recovery_gpu_gpt_gate_phases.json" 2>&1 | tail -10 | cut -c1-240
timeout 240 python3 -u bench/recovery_gpu.py --model hf-llama --kills-per-phase 5 \
  --json "$OUT/recovery_gpu_llama_gate.json" 2>&1 | tail -4 | cut -c1-200
