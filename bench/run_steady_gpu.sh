#!/usr/bin/env bash
# On the GPU machine, one call (~6 min with the start): issue 21 item 3. The side-stream
# landing's tests (its waits, its peak), then the steady step against torch's fused-AdamW
# loop in one process (bench/steady_gpu.py): at one micro-batch with the side-stream
# landing taking turns beside both (--other-landing), and at the paper's compute : update
# ~ 250 (100 micro-batches on an H100).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q tests/gpu/test_grad_landing_stream_gpu.py 2>&1 | tail -4
timeout 90 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 9 --block 10 --other-landing \
  --json "$OUT/steady_gpu_accum1.json"
timeout 200 python3 -u bench/steady_gpu.py --grad-accum 100 --rounds 7 --block 1 \
  --json "$OUT/steady_gpu_accum100.json"
