#!/bin/bash
# Before/after issue #47's architecture round, each benchmark twice in a row (before, then after), alone on the machine.
# usage: run.sh BEFORE_TREE AFTER_TREE OUT_DIR [bench ...]   (the trees: checkouts of the two commits)
# Each tree's own kernels: `completer_kernels` is mapped by the editable install to the install's checkout, so a
# folder holding a `completer_kernels` link to the tree's kernels/ goes on PYTHONPATH (KERNELS_BEFORE, KERNELS_AFTER).
BEFORE=$1; AFTER=$2; OUT=$3; shift 3
PY=/work/main/.venv/bin/python
mkdir -p $OUT
declare -A NAME ARGS
NAME[keystroke]=keystroke;     ARGS[keystroke]="--rows all_on llama_q4_1 --editors 1 8 --seconds 30 --no-docs --no-screenshot --out"
NAME[cpu]=cpu-decode;          ARGS[cpu]="--rows int4 llama_q4_1 --reps 3 --cases 3 --out"
NAME[engine]=engine;           ARGS[engine]="--prompts 4 --repeats 2 --batches 1 4 --ttft-sizes 512 2048 --file-sizes 1024 4096 --out"
NAME[critical]=critical-path;  ARGS[critical]="--seconds 20 --out"
NAME[compat]=compat;           ARGS[compat]="--keystrokes 24 --json"
NAME[disagg]=disagg;           ARGS[disagg]="--quick --out"
NAME[cluster]=cluster-replay;  ARGS[cluster]="--rows single affinity_2 --editors 2 --seconds 20 --out"
NAME[stats]=stats;             ARGS[stats]="--out"
NAME[fairness]=soak;           ARGS[fairness]="--fairness --requests 10 --rounds 1 --json"
NAME[bulk]=bulk;               ARGS[bulk]="--rows fifo interactive --seconds 30 --out"
NAME[jump]=neovim-jump;        ARGS[jump]="--rows warming --jumps 24 --out"
BENCHES=${@:-keystroke cpu engine critical compat disagg cluster stats fairness bulk jump}
for b in $BENCHES; do
  for side in before after; do
    tree=$BEFORE; kernels=$KERNELS_BEFORE; [ $side = after ] && tree=$AFTER && kernels=$KERNELS_AFTER
    echo "$(date +%T) $b $side" >> $OUT/progress
    (cd $tree && PYTHONPATH=$tree${kernels:+:$kernels} CI=true timeout 1200 $PY -m latency_bench ${NAME[$b]} ${ARGS[$b]} $OUT/${b}_$side.json \
       > $OUT/${b}_$side.log 2>&1; echo "rc $?" >> $OUT/${b}_$side.log)
  done
done
echo "$(date +%T) done" >> $OUT/progress
