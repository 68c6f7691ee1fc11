#!/bin/bash
# Paired multi-seed runs on one GPU, resumable: bash results/temperature_study/run.sh SPEC [SPEC ...]
#   SPEC = SHAPE:MODE:SEED[:SCALE]   SHAPE 100m | 124m | 350m: config/repro_100m.py's budget, at its own shape, at
#   config/repro_124m.py's, or at config/train_350m.py's; MODE baseline | attnres | mhar, SCALE the route_scale (default 1)
#   e.g. bash results/temperature_study/run.sh 100m:attnres:0:0.5 100m:mhar:0 124m:attnres:2:0.5
# A run whose log is already in the log folder is skipped (done); a run is written to out/study/NAME and its
# log.jsonl copied to $LOGS (default results/temperature_study/logs/) only when it finished, so a stopped call
# leaves no half log behind and the next call redoes that run. NAME = SHAPE_MODE_sSEED[_xSCALE].
# Long lists can run in the background of a warm machine: nohup bash results/temperature_study/run.sh ... &
# SAVE=True keeps each run's checkpoint in out/study/NAME (for eval.py); the default keeps only the logs.
set -eo pipefail
LOGS=${LOGS:-results/temperature_study/logs}
SAVE=${SAVE:-False}
mkdir -p "$LOGS"
if [ ! -f data/books_wiki/meta.json ]; then   # tokenize once (~10 s on 16 cores)
  SRC=${TEXT:-../shared/data/text}
  python prepare_data.py --input=$SRC/books_wiki_en_train.jsonl.xz --val_input=$SRC/books_wiki_en_val.jsonl.xz \
    --out_dir=data/books_wiki --workers=16
fi
for spec in "$@"; do
  IFS=: read -r shape mode seed scale <<< "$spec"
  scale=${scale:-1}
  case $shape in
    100m) cfg=config/repro_100m.py; shape_args= ;;
    124m) cfg="config/repro_100m.py config/repro_124m.py"; shape_args= ;;   # repro_124m.py: the shape alone
    350m) cfg=config/repro_100m.py; shape_args="--n_layer=24 --n_head=16 --n_kv_head=8 --n_embd=1024 --ffn_hidden=4096" ;;
    *) echo "run.sh: unknown shape '$shape' in '$spec' (100m | 124m | 350m)"; exit 2 ;;
  esac
  name=${shape}_${mode}_s${seed}
  if [ "$scale" != 1 ]; then name=${name}_x$scale; fi
  if [ -f "$LOGS/$name.log.jsonl" ]; then echo "$name: done, skipped"; continue; fi
  rm -rf out/study/$name
  python train.py $cfg --residual=$mode --seed=$seed --route_scale=$scale $shape_args --save=$SAVE \
    --out_dir=out/study/$name --log_interval=10 > "$LOGS/$name.txt" 2>&1 || { echo "$name: failed (see $LOGS/$name.txt)"; continue; }
  cp out/study/$name/log.jsonl "$LOGS/$name.log.jsonl"
  grep -E "^done" "$LOGS/$name.txt" | sed "s/^/$name: /"
done
