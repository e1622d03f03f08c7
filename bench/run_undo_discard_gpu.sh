#!/usr/bin/env bash
# On the GPU machine, one call (~6 min with the start): issue 21, items 3 and 6. The fused
# update's kernel dropping a done block's undo words from the L2 (discard): its device time
# against torch's fused AdamW (bench/adamw_kernel_gpu.py); the updater's fused tests on the
# GPU (kills in every phase, the roll-forward), the kernel's process SIGKILLed around a launch
# (tests/gpu/test_fused_kill_gpu.py), the trainer's side-stream landing; the steady step at
# one micro-batch against torch's fused-AdamW loop (rounds must agree to about 1 % for the
# median to mean anything: print them all); a recovery in every phase bit-identical to the
# fault-free run; the syndrome kernel's launch shapes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 9 --block 10 \
  --json "$OUT/steady_gpu_accum1.json" 2>&1 | grep -E "^round|median|spread|operating" | cut -c1-140
timeout 150 python3 -m pytest -q -x tests/updater/test_fused.py tests/gpu/test_fused_kill_gpu.py \
  tests/gpu/test_grad_landing_stream_gpu.py 2>&1 | tail -3
timeout 80 python3 -m pytest -q -x tests/gpu/test_gpu_recovery_exact.py -k "every_phase and 1" 2>&1 | tail -3
timeout 60 python3 -u bench/copy_overlap_gpu.py 2>&1 | tail -8
timeout 100 python3 -u bench/syndrome_gpu.py --sweep --sweep-ks 128,1024 \
  --json "$OUT/syndrome_sweep.json" 2>&1 | grep -i "sweep\|copy\|check\|syndrome kernel" | tail -16
timeout 100 python3 -u bench/adamw_kernel_gpu.py --reps 10 2>&1 | tail -7
