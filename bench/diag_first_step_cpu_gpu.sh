#!/usr/bin/env bash
# On the GPU machine: does CPU contention slow the steps right after a recovery (issue 21,
# item 2)? The host's CPU and cgroup, then each model's job with every python process's CPU
# sampled (bench/cpu_sampler.py) beside its event log; and the same jobs with
# OMP_NUM_THREADS=2 in every process.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
nproc; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|Model name"
cat /sys/fs/cgroup/cpu.max 2>/dev/null; grep throttled /sys/fs/cgroup/cpu.stat 2>/dev/null
cat /proc/sys/kernel/sched_autogroup_enabled; ulimit -e
python3 -c "import torch, os; print('torch threads', torch.get_num_threads(), 'affinity', len(os.sched_getaffinity(0)))"
sampled() {  # sampled NAME CMD...: CMD with CPU sampled to $OUT/cpu_NAME.csv
  local name=$1; shift
  python3 bench/cpu_sampler.py "$OUT/cpu_$name.csv" --period 0.05 &
  local s=$!
  "$@"
  kill $s
}
for model in hf-llama gpt; do
  sampled "$model" timeout 150 python3 -u bench/recovery_gpu.py --model $model --kills-per-phase 2 \
    --events-out "$OUT/events_$model.jsonl" --json "$OUT/$model.json" 2>&1 | tail -3 | cut -c1-200
  OMP_NUM_THREADS=2 sampled "${model}_omp2" timeout 150 python3 -u bench/recovery_gpu.py \
    --model $model --kills-per-phase 2 --events-out "$OUT/events_${model}_omp2.jsonl" \
    --json "$OUT/${model}_omp2.json" 2>&1 | tail -3 | cut -c1-200
done
grep throttled /sys/fs/cgroup/cpu.stat 2>/dev/null
