#!/bin/bash
# One device call: compile the syndrome kernel's launch shapes in parallel, then time them
# (bench/syndrome_gpu.py --sweep --diag) and profile two of them under ncu. Logs under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
variants=$(python3 -c "import bench.syndrome_gpu as s; print(' '.join(s.fmt(v) + (':d' if v in s.DIAG else '') for v in s.SWEEP))")
for v in $variants; do
  name=${v%:d}; diag=""; [ "$v" != "$name" ] && diag="--diag"
  python3 bench/syndrome_gpu.py --warm "$name" $diag > "$OUT/warm_$name.log" 2>&1 &
done
wait
echo "warm: $(( $(date +%s) - t0 )) s"; grep -l -i error "$OUT"/warm_*.log && tail -5 "$OUT"/warm_*.log
python3 bench/syndrome_gpu.py --sweep --diag --ks 8,32,128,1024 --json "$OUT/syndrome_sweep.json" 2>&1 | tee "$OUT/syndrome_sweep.log"
echo "sweep done: $(( $(date +%s) - t0 )) s"
for v in 32x1x8x1x0x0x1x2; do
  LETO_SYNDROME_TUNING=$v timeout 150 ncu --clock-control none -k regex:syndrome -c 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 bench/syndrome_gpu.py --ncu > "$OUT/ncu_$v.log" 2>&1
  echo "ncu $v rc=$? $(( $(date +%s) - t0 )) s"
done
