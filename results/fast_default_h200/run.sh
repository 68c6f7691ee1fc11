#!/bin/bash
# The fast-default record on one GPU: bash results/fast_default_h200/run.sh AUTHORS_MHAR_TRITON.py OLD_ROUTING_KERNEL.py
#   AUTHORS_MHAR_TRITON.py: your copy of the authors' Attention-Residuals/mhar_triton.py (not shipped here)
#   OLD_ROUTING_KERNEL.py:  the routing_kernel.py to compare against (git show db8590c:routing_kernel.py > old.py)
# Output goes to $OUT or results/fast_default_h200/out/.
set -eo pipefail
DEST=${OUT:-results/fast_default_h200/out}
mkdir -p "$DEST"
python -m pytest -x -q test_mhar.py -k "fused or graph or cuda or route_stack or routing or bench or auto" > "$DEST/test_gpu.txt"
python results/fast_default_h200/ab_chain.py "$2" "$DEST/ab_graph.json" > "$DEST/ab_graph.txt"
python results/fast_default_h200/ab_chain.py "$2" "$DEST/ab_eager.json" --eager > "$DEST/ab_eager.txt"
python bench.py routing --cpu-profile --output="$DEST/host.json" > "$DEST/host_profile.txt"
python bench.py routing --authors="$1" --output="$DEST/side_by_side.json" > "$DEST/side_by_side.txt"
for s in 100m 1b; do python bench.py --scales=$s --variants=baseline,mhar_fused --output="$DEST/bench_$s.json" > "$DEST/bench_$s.txt"; done
python bench.py --scales=1b --variants=baseline,mhar_fused --cuda_graph=False --output="$DEST/bench_eager_1b.json" > "$DEST/bench_eager_1b.txt"
# the README's commands (one GPU, 100 steps, the offline corpus) against bench.py at their vocabulary
if [ ! -f data/books_wiki/meta.json ]; then
  SRC=${TEXT:-../shared/data/text}
  python prepare_data.py --input=$SRC/books_wiki_en_train.jsonl.xz --val_input=$SRC/books_wiki_en_val.jsonl.xz \
    --out_dir=data/books_wiki --workers=16
fi
A="--data_dir=data/books_wiki --max_steps=100 --eval_interval=1000 --save=False --log_interval=10"
for s in 100m 1b; do
  python bench.py --scales=$s --variants=baseline,mhar_fused --vocab=50304 --output="$DEST/bench_gpt2_$s.json" > "$DEST/bench_gpt2_$s.txt"
  python train.py config/train_$s.py --residual=mhar --out_dir=out/readme_$s $A > "$DEST/train_${s}_mhar.txt"
done
