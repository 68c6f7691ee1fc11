#!/bin/bash
# before (carry/before: the tree at the parent commit) against after (this tree), one call, one H200
set -o pipefail
export PYTHONUNBUFFERED=1
B=carry/before
L=$OUT/gpu_ab.txt
{
echo "# import time of train.py (a train.py subprocess pays it at every launch)"
for t in $B .; do (cd $t && python -X importtime -c "import train" 2>&1 | sort -t'|' -k2 -n | tail -3 && TIMEFORMAT="wall %R s: import train in $t" && time python -c "import train"); done
echo "# one train.py launch as the tests make it (CPU, 1 step): where its time goes"
export TIKTOKEN_CACHE_DIR=$PWD/carry/shared_data/tiktoken_cache
python prepare_data.py --input=carry/shared_data/text/books_wiki_en_val.jsonl.xz --out_dir=/tmp/tdata --val_fraction=0.05 --workers=2 > /dev/null 2>&1
A="--data_dir=/tmp/tdata --n_layer=2 --n_head=2 --n_kv_head=1 --n_embd=64 --ffn_hidden=128 --block_size=64 --batch_tokens=512 --micro_batch=4 --lr=3e-3 --warmup_steps=5 --lr_decay_steps=60 --eval_tokens=2048 --device=cpu --compile=False --residual=mhar --max_steps=1 --eval_interval=20"
for t in $B .; do (cd $t && TIMEFORMAT="wall %R s: one train.py launch in $t" && time OMP_NUM_THREADS=2 python train.py $A --out_dir=/tmp/t1_$RANDOM > /dev/null 2>&1); done
TIMEFORMAT="wall %R s: python -c 'import torch'" && time python -c "import torch"
TIMEFORMAT="wall %R s: import torch, triton" && time python -c "import torch, triton"
OMP_NUM_THREADS=2 python -m cProfile -s cumtime train.py $A --out_dir=/tmp/t1_prof 2>&1 | grep -A45 "Ordered by"
echo "# the routing chain, before (old) against after (new), CUDA-graph GPU time, outputs and gradients compared"
python results/fast_default_h200/ab_chain.py $B/routing_kernel.py /tmp/ab_graph.json
for s in 100m 1b; do
  for t in $B .; do
    echo "# python bench.py --scales=$s --variants=baseline,mhar_fused   (in $t)"
    (cd $t && python bench.py --scales=$s --variants=baseline,mhar_fused --output=/tmp/bench_$(basename $t)_$s.json)
  done
done
} 2>&1 | tee $L
cp /tmp/ab_graph.json $OUT/
tar -czf $OUT/bench_json.tgz -C /tmp $(cd /tmp && ls bench_*.json)
