#!/bin/bash
# cpu-decode int4, the avx512 build with x86-64's generic tuning ("after": 0205f19) and with -mtune=native added
# to kernels/cpu_levels.py's flags ("tune": 0205f19 plus that one change, now on main), alternating, alone;
# pairs 1-2 after then tune, pair 3 tune then after. Each tree's kernels via a folder holding a
# `completer_kernels` link on PYTHONPATH (as ../refactor_ab_47/run.sh).
OUT=${OUT:-$(dirname "$0")}
run() {  # side round
  tree=/work/ab-$1; k=/work/ka; [ $1 = tune ] && k=/work/kt
  (cd $tree && PYTHONPATH=$tree:$k CI=true timeout 900 /work/main/.venv/bin/python -m latency_bench cpu-decode \
     --rows int4 --reps 3 --cases 3 --out $OUT/cpu_tune_r$2_$1.json)
}
run after 1; run tune 1; run after 2; run tune 2; run tune 3; run after 3
