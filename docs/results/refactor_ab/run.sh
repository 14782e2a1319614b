#!/bin/bash
# Before/after the #29 refactor, each benchmark twice in a row (before, then after), alone on the machine.
# usage: run.sh AFTER_TREE [bench ...]
AFTER=${1:-/work/main}; shift
BEFORE=/work/wt_before
PY=/work/main/.venv/bin/python
OUT=/work/logs/ab
declare -A OLD NEW ARGS
OLD[keystroke]=latency_bench/keystroke_bench.py;  NEW[keystroke]=keystroke;   ARGS[keystroke]="--rows all_on llama_q4_1 --editors 1 8 --seconds 30 --no-docs --out"
OLD[cpu]=latency_bench/cpu_decode_bench.py;       NEW[cpu]=cpu-decode;        ARGS[cpu]="--rows int4 llama_q4_1 --reps 3 --cases 3 --out"
OLD[engine]=latency_bench/engine_bench.py;        NEW[engine]=engine;         ARGS[engine]="--prompts 4 --repeats 2 --batches 1 4 --ttft-sizes 512 2048 --file-sizes 1024 4096 --out"
OLD[critical]=latency_bench/critical_path.py;     NEW[critical]=critical-path; ARGS[critical]="--seconds 20 --out"
OLD[compat]=latency_bench/compat_bench.py;        NEW[compat]=compat;         ARGS[compat]="--keystrokes 24 --json"
OLD[disagg]=latency_bench/disagg_bench.py;        NEW[disagg]=disagg;         ARGS[disagg]="--quick --out"
OLD[cluster]=latency_bench/cluster_replay.py;     NEW[cluster]=cluster-replay; ARGS[cluster]="--rows single affinity_2 --editors 2 --seconds 20 --out"
OLD[stats]=latency_bench/stats_bench.py;          NEW[stats]=stats;           ARGS[stats]="--out"
OLD[fairness]=latency_bench/soak.py;              NEW[fairness]=soak;         ARGS[fairness]="--fairness --requests 10 --rounds 1 --json"
BENCHES=${@:-keystroke cpu engine critical compat disagg cluster stats fairness}
for b in $BENCHES; do
  echo "$(date +%T) $b before" >> $OUT/progress
  (cd $BEFORE && PYTHONPATH=$BEFORE CI=true timeout 1200 $PY ${OLD[$b]} ${ARGS[$b]} $OUT/${b}_before.json > $OUT/${b}_before.log 2>&1; echo "rc $?" >> $OUT/${b}_before.log)
  echo "$(date +%T) $b after" >> $OUT/progress
  (cd $AFTER && PYTHONPATH=$AFTER CI=true timeout 1200 $PY -m latency_bench ${NEW[$b]} ${ARGS[$b]} $OUT/${b}_after.json > $OUT/${b}_after.log 2>&1; echo "rc $?" >> $OUT/${b}_after.log)
done
echo "$(date +%T) done" >> $OUT/progress
