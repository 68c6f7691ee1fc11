#!/bin/bash
# The paper's evaluation protocol on the reduced-budget seed-0 checkpoints: bash results/harness_100m/run.sh EVAL_ROOT
#   EVAL_ROOT: local eval sets laid out like ../shared/data/eval (wikitext-2-raw/, lambada/, hellaswag/)
# Trains baseline and MHAR seed 0 (config/repro_100m.py, checkpoints kept in out/study/100m_MODE_s0; a run whose log
# is already in $LOGS is skipped), then scores each final checkpoint with lm-evaluation-harness and with our protocols.
set -eo pipefail
ROOT=${1:?usage: bash results/harness_100m/run.sh EVAL_ROOT}
HERE=results/harness_100m
SAVE=True bash results/temperature_study/run.sh 100m:baseline:0 100m:mhar:0
for mode in baseline mhar; do
  dir=out/study/100m_${mode}_s0
  python eval.py --harness --out_dir=$dir --data_root=$ROOT --batch_size=32 --output=$HERE/harness_${mode}_s0.json
  python eval.py --out_dir=$dir --data_root=$ROOT --batch_size=32 --output=$HERE/ours_${mode}_s0.json
done
