#!/usr/bin/env bash
# On the GPU machine: promotion -> replacement-shadow readiness for the 1.1B GPT (deterministic
# kernels, as examples/train_gpt.py forces on a GPU), this tree vs the older checkout in
# .baseline/ (bench/shadow_ready.py --baseline-dir), then the GPU tests this tree touches.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
MODEL="--vocab 32000 --dim 2048 --layers 20 --heads 16 --seq 512 --batch 4 --bf16"
timeout 360 python3 bench/shadow_ready.py --kills 3 --gap 20 --nproc 1 --baseline-dir .baseline \
  --json "$OUT/shadow_ready_gpu.json" -- $MODEL 2>&1 | tee "$OUT/shadow_ready_gpu.log"
timeout 150 python3 -m pytest -q -x tests/gpu/test_vmm_pool.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
