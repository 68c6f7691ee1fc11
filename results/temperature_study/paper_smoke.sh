#!/bin/bash
# BUDGET=paper's stop-and-resume path on one GPU, shortened to 60 steps on the offline text (no FineWeb-Edu needed):
# a run stopped by SIGTERM after its first checkpoint, the same command again (it resumes), once more (it skips),
# then the same run uninterrupted in a second log folder, and the two runs' losses side by side.
#   bash results/temperature_study/paper_smoke.sh [OUT_DIR]   (default /tmp/paper_smoke; ~2.5 minutes of one H200)
set -o pipefail
OUT=${1:-/tmp/paper_smoke}; TEXT=${TEXT:-../shared/data/text}
if [ -e "$OUT/resumed" ] || [ -e "$OUT/straight" ]; then
  echo "paper_smoke.sh: $OUT holds an earlier smoke run's logs: give a new OUT_DIR"; exit 2
fi
mkdir -p "$OUT"
T0=$(date +%s); say() { echo "+$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/progress.txt"; }
if [ ! -f data/books_wiki/meta.json ]; then
  python prepare_data.py --input=$TEXT/books_wiki_en_train.jsonl.xz --val_input=$TEXT/books_wiki_en_val.jsonl.xz \
    --out_dir=data/books_wiki --workers=16 > "$OUT/prepare.txt" 2>&1 || { say "prepare_data.py failed"; exit 1; }
fi
export BUDGET=paper DATA=data/books_wiki \
  EXTRA="--max_steps=60 --lr_decay_steps=60 --warmup_steps=10 --eval_interval=20 --eval_tokens=262144"
run=out/study_paper/100m_mhar_s0
if [ -e $run ]; then say "$run exists: move it away first (this script stops and resumes that run)"; exit 2; fi
LOGS=$OUT/resumed setsid bash results/temperature_study/run.sh 100m:mhar:0 > "$OUT/call1.txt" 2>&1 &
pid=$!
while [ ! -f $run/ckpt.pt ] && kill -0 $pid 2> /dev/null; do sleep 1; done
sleep 4; kill -- -$pid; wait $pid; say "call 1 stopped by SIGTERM: rc=$?"
LOGS=$OUT/resumed bash results/temperature_study/run.sh 100m:mhar:0 > "$OUT/call2.txt" 2>&1; say "call 2 rc=$?: $(tail -1 "$OUT/call2.txt")"
LOGS=$OUT/resumed bash results/temperature_study/run.sh 100m:mhar:0 > "$OUT/call3.txt" 2>&1; say "call 3 rc=$?: $(cat "$OUT/call3.txt")"
mv $run $run.resumed
LOGS=$OUT/straight bash results/temperature_study/run.sh 100m:mhar:0 > "$OUT/call4.txt" 2>&1; say "uninterrupted rc=$?"
rm -rf $run $run.resumed
python - "$OUT" <<'PY' | tee -a "$OUT/progress.txt"
import sys
sys.path.insert(0, "results/temperature_study")
from report import load   # the study's reader: a resumed step's last record wins
a, b = (load(f"{sys.argv[1]}/{folder}/100m_mhar_s0.log.jsonl")["evals"] for folder in ("resumed", "straight"))
for step in sorted(a):
    print(f"step {step}: val_loss resumed {a[step]:.4f}, uninterrupted {b[step]:.4f}, diff {a[step] - b[step]:+.4f}")
PY
