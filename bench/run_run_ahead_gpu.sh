#!/usr/bin/env bash
# On the GPU machine, one call (~8 min with the start): the records' wait for the marker
# (Marker.wait_landed) and the warmed gradient landing, measured. The run-ahead GPU test
# (kills while the host is far ahead of the device), the GPT's first steps after promotion
# (issue 21, item 2: 5 kills per phase), and the steady step against torch's fused loop at
# the small-batch point (item 3). It measured the records' wait of two slots, which bounded the
# host's run-ahead to about one update; the ring of six (bench/run_record_ring_gpu.sh) replaced it.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -x tests/gpu/test_run_ahead_gpu.py 2>&1 | tail -3
timeout 150 python3 -u bench/recovery_gpu.py --kills-per-phase 5 \
  --events-out "$OUT/events_gpt.jsonl" --json "$OUT/recovery_gpu_gpt_run_ahead.json" \
  2>&1 | grep -v "^\s*$" | tail -4 | cut -c1-200
timeout 200 python3 -u bench/steady_gpu.py --grad-accum 1 --rounds 5 --block 10 2>&1 | tail -4
