#!/bin/bash
# One device call for issue 3's numbers: the syndrome kernel's launch shapes (compiled in
# parallel first), bench/syndrome_gpu.py, bench/erasure_gpu.py (gf16_mac's tuning as it is),
# and the RMU's update overhead at 16 micro-batches (256 MiB chunks). Logs under $OUT.
#   ./bench/run_erasure_gpu.sh            # on the device machine, from the repository root
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
echo "warm: $(( $(date +%s) - t0 )) s"
python3 bench/syndrome_gpu.py --sweep --diag --ks 8,32,128,1024 --json "$OUT/syndrome_gpu.json" 2>&1 | tee "$OUT/syndrome_gpu.log"
echo "syndrome_gpu: $(( $(date +%s) - t0 )) s"
timeout 240 python3 bench/erasure_gpu.py --no-sweep --json "$OUT/erasure_gpu.json" 2>&1 | tee "$OUT/erasure_gpu.log"
echo "erasure_gpu: $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/update_overhead.py --device cuda --preset h200 --iters 3 --modes rmu-fused \
  --chunk-bytes 268435456 --micro-batches 16 --json "$OUT/update_overhead_mb16.json" 2>&1 | tee "$OUT/update_overhead_mb16.log"
echo "update_overhead: $(( $(date +%s) - t0 )) s"
