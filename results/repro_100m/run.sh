#!/bin/bash
# The reduced-budget runs on one GPU: bash results/repro_100m/run.sh baseline:0 mhar:0 mhar:0:8 ...   (mode:seed[:route_heads])
# Each run: python train.py config/repro_100m.py --residual=MODE --seed=SEED [--route_heads=H]
#           --out_dir=out/repro/NAME --log_interval=10
# Its log.jsonl is copied to $OUT (when set) or results/repro_100m/logs/. A stopped run resumes from its checkpoint
# (out/repro/NAME/ckpt.pt), a finished one says so; each attempt's output is appended to NAME.txt. Nothing is deleted.
set -eo pipefail
DEST=${OUT:-results/repro_100m/logs}
mkdir -p "$DEST"
if [ ! -f data/books_wiki/meta.json ]; then   # tokenize once (~10 s on 16 cores)
  SRC=${TEXT:-../shared/data/text}
  python prepare_data.py --input=$SRC/books_wiki_en_train.jsonl.xz --val_input=$SRC/books_wiki_en_val.jsonl.xz \
    --out_dir=data/books_wiki --workers=16
fi
for spec in "$@"; do
  IFS=: read -r mode seed heads <<< "$spec"
  name=${mode}_s${seed}${heads:+_h$heads}
  start=--init_from=scratch
  [ -f out/repro/$name/ckpt.pt ] && start=--init_from=resume
  python train.py config/repro_100m.py --residual=$mode --seed=$seed ${heads:+--route_heads=$heads} \
    --out_dir=out/repro/$name --log_interval=10 $start | tee -a "$DEST/$name.txt" | grep -E "^(eval|done)"
  cp out/repro/$name/log.jsonl "$DEST/$name.log.jsonl"
done
