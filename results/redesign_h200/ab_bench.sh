#!/bin/bash
# bench.py end to end at 100M and 1B (baseline, MHAR fused): the tree of efaeb30 (the last commit before the redesign)
# and this one alternately, one process per tree and scale. Output files go to $OUT (default: the current folder).
#   bash results/redesign_h200/ab_bench.sh
set -e
OUT=${OUT:-$PWD}
git worktree add -f /tmp/mhar_old efaeb30 >/dev/null 2>&1 || true
for scale in 100m 1b; do
  (cd /tmp/mhar_old && python bench.py --scales=$scale --variants=baseline,mhar_fused --output=$OUT/old_$scale.json > $OUT/bench_old_$scale.txt)
  python bench.py --scales=$scale --variants=baseline,mhar_fused --output=$OUT/new_$scale.json > $OUT/bench_new_$scale.txt
done
