#!/bin/bash
# The engine benchmark at batch 1 only, twice more per tree, after first then before, alone (trees and kernels as
# ../refactor_ab_47/run.sh: /work/ab-before = 68b2851, /work/ab-after = 0205f19).
OUT=${OUT:-$(dirname "$0")}
for round in 2 3; do
for side in after before; do
  tree=/work/ab-$side; k=/work/ka; [ $side = before ] && k=/work/kb
  (cd $tree && PYTHONPATH=$tree:$k CI=true timeout 900 /work/main/.venv/bin/python -m latency_bench engine --prompts 4 \
     --repeats 2 --batches 1 --ttft-sizes 512 --file-sizes 1024 --out $OUT/engine_b1_r${round}_$side.json)
done; done
