#!/usr/bin/env bash
# On the GPU machine: where the first step after promotion's excess goes (issue 21, item 2).
# The SM clock every 10 ms beside each job (is the GPU slower right after the recovery's idle
# gap?), the job's event log (what else started then), and each process's first and steady
# step profiled (device time or host gaps?).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.applications.graphics,power.limit --format=csv
nvidia-smi -q -d PERFORMANCE | sed -n 1,30p
fields=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$fields --format=csv,noheader -c 1 >/dev/null 2>&1 ||
  fields=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_throttle_reasons.active
clocked() {  # clocked NAME CMD...: CMD with the GPU's clock logged to $OUT/clocks_NAME.csv
  local name=$1; shift
  nvidia-smi --query-gpu=$fields --format=csv,noheader -lms 10 >"$OUT/clocks_$name.csv" 2>&1 &
  local smi=$!
  "$@"
  kill $smi
}
clocked gpt timeout 150 python3 -u bench/recovery_gpu.py --kills-per-phase 2 \
  --events-out "$OUT/events_gpt.jsonl" --json "$OUT/gpt.json" 2>&1 | tail -9 | cut -c1-200
clocked llama timeout 150 python3 -u bench/recovery_gpu.py --model hf-llama --kills-per-phase 2 \
  --events-out "$OUT/events_llama.jsonl" --json "$OUT/llama.json" 2>&1 | tail -9 | cut -c1-200
LETO_PROFILE_DIR="$OUT/prof_gpt" timeout 120 python3 -u bench/recovery_gpu.py --kills-per-phase 1 \
  --json "$OUT/gpt_prof.json" 2>&1 | tail -4 | cut -c1-200
ls "$OUT/prof_gpt" | head -20
