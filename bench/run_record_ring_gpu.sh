#!/usr/bin/env bash
# On the GPU machine, one call (~8 min with the start): the stateful objects' records in a
# ring of six, each overwrite waiting for the marker to pass what its record serves
# (leto.trainer.extras). The run-ahead GPU test (kills while the host is far ahead of the
# device); both models' recoveries, 5 kills per phase, with the first steps' cost read over
# three steps (issue 21, items 2 and 4); the steady step against torch's fused loop at the
# small-batch point, with and without the records' waits in the same rounds (item 3).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 9 --block 10 --unbounded \
  --json "$OUT/steady_gpu_accum1_ring.json" 2>&1 | tail -5
timeout 150 python3 -m pytest -q -x tests/gpu/test_run_ahead_gpu.py 2>&1 | tail -3
for model in gpt hf-llama; do
  timeout 160 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase 5 \
    --events-out "$OUT/events_${model}_ring.jsonl" --json "$OUT/recovery_gpu_${model}_ring.json" \
    2>&1 | grep -v "^\s*$" | tail -4 | cut -c1-220
done
