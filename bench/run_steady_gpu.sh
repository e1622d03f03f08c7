#!/usr/bin/env bash
# On the GPU machine, one call (~9 min with the start): issue 21 item 3. The side-stream
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
# The trainer with the side stream wired in (this copy of the tree only): kills in every
# phase, bit-identical to the fault-free run, and the lending pool's checks.
sed -i 's/^                self\._buckets,$/&\n                torch.cuda.Stream(self.device) if self.device.type == "cuda" and self._buckets is None else None,/' \
  leto/trainer/state.py
grep -c 'torch.cuda.Stream(self.device)' leto/trainer/state.py
timeout 80 python3 -m pytest -q tests/gpu/test_lend_gpu.py tests/gpu/test_unused_params_gpu.py 2>&1 | tail -4
timeout 150 python3 -m pytest -q -x tests/gpu/test_gpu_recovery_exact.py -k "every_phase and 1" 2>&1 | tail -6
