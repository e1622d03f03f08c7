#!/usr/bin/env bash
# On the GPU machine, one call: issue 21, item 3. The fused update's kernel dropping a done
# block's undo words from the L2 (discard): it compiles and computes the kernel's bits, its
# device time against torch's fused AdamW (bench/adamw_kernel_gpu.py), the steady step at one
# micro-batch against torch's fused-AdamW loop, and the kernel SIGKILLed mid-launch
# (tests/gpu/test_fused_kill_gpu.py).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -u bench/adamw_kernel_gpu.py --reps 10 2>&1 | tail -9
timeout 120 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 5 --block 10 \
  --json "$OUT/steady_gpu_accum1.json" 2>&1 | tail -5
timeout 150 python3 -m pytest -q -x -s tests/gpu/test_fused_kill_gpu.py 2>&1 | tail -4
