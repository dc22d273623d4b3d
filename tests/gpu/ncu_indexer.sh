#!/usr/bin/env bash
# Nsight Compute on single launches of the lightning indexer's kernels (one device call, from session.sh's
# part ncu). $NCU_CASES: "shape:seq_len:kernel:launch ...", launch = the call's query block (0-based); or
# "sparse:call:seq_len" for one launch of a Gluon sparse MLA kernel at the full shape (call: fwd, fwd-ring,
# fwd-lazy, fwd-pair, dq, dkv of sparse_mla_tilings.py --call, profiled between its cudaProfilerStart and
# Stop). The clocks are left as the GPU sets them (--clock-control none), so durations compare with the
# benchmarks'. For each indexer
# case: a warm run (compile + autotuning caches), then ncu on one launch; ncu_<i>.txt gets the details
# page (speed of light, occupancy, warp stall reasons, instruction mix) and ncu_<i>.sass.csv the SASS
# with its per-instruction stall samples (source counters); both leave as one $OUT/ncu.tgz (the device tool
# returns few files). Read the SASS table with `tests/benchmarks/dsa_bench.py sass`.
set -u
OUT=${OUT:-/tmp/out}
DIR=$(mktemp -d)
NCU=${NCU:-/usr/local/cuda/bin/ncu}
"$NCU" --version | tail -1
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters"
i=0
for case in ${NCU_CASES:-small:262144:select_kernel:3}; do
  if [[ $case == sparse:* ]]; then
    IFS=: read -r _ call seq <<< "$case"
    echo "--- ncu case $i: sparse MLA $call, full shape, $seq tokens"
    "$NCU" --clock-control none --profile-from-start off --launch-count 1 $SECTIONS --import-source yes \
      -f -o "$DIR/ncu_$i" python3 tests/benchmarks/sparse_mla_tilings.py --shape full --seq-len "$seq" \
      --call "$call" 2>&1 | tail -3
  else
    IFS=: read -r shape seq kernel launch <<< "$case"
    echo "--- ncu case $i: $shape $seq $kernel launch $launch"
    python3 tests/benchmarks/dsa_bench.py call --shape "$shape" --seq-len "$seq" --warm-only
    "$NCU" --clock-control none --kernel-name "$kernel" --launch-skip "$launch" --launch-count 1 $SECTIONS \
      --import-source yes -f -o "$DIR/ncu_$i" python3 tests/benchmarks/dsa_bench.py call --shape "$shape" \
      --seq-len "$seq" 2>&1 | tail -3
  fi
  "$NCU" --import "$DIR/ncu_$i.ncu-rep" --page details --print-details all > "$DIR/ncu_$i.txt" 2>&1
  "$NCU" --import "$DIR/ncu_$i.ncu-rep" --page source --print-source sass --csv > "$DIR/ncu_$i.sass.csv" 2>&1
  rm -f "$DIR/ncu_$i.ncu-rep"
  grep -E "Duration|Block Size|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|No Eligible" \
    "$DIR/ncu_$i.txt" | head -12
  i=$((i + 1))
done
tar -czf "$OUT/ncu.tgz" -C "$DIR" .
