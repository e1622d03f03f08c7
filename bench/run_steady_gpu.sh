#!/usr/bin/env bash
# On the GPU machine, one call (~5 min with the start): issue 21, items 3 and 6. The landing's
# GPU tests (the side stream's waits and peak, the trainer landing on it and training the same
# weights), the steady step against torch's fused-AdamW loop in one process
# (bench/steady_gpu.py) at one micro-batch with the compute-stream landing taking turns beside
# both (--other-landing), a recovery in every phase bit-identical to the fault-free run, and
# the syndrome kernel's launch shapes at the updater's 128-page chunk.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -q tests/gpu/test_grad_landing_stream_gpu.py tests/gpu/test_grad_buckets_gpu.py \
  2>&1 | tail -4
timeout 100 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 9 --block 10 --other-landing \
  --json "$OUT/steady_gpu_accum1.json" 2>&1 | tail -4
timeout 100 python3 -m pytest -q -x tests/gpu/test_gpu_recovery_exact.py -k "every_phase and 1" 2>&1 | tail -3
timeout 120 python3 -u bench/syndrome_gpu.py --sweep --sweep-ks 128,1024 \
  --json "$OUT/syndrome_sweep.json" 2>&1 | grep -i "sweep\|copy\|check\|syndrome kernel" | tail -16
