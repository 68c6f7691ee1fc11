#!/bin/bash
# Several GPUs of one host (N, default: all of them). NVLink multicast stays off (shared hosts).
#   bash results/multigpu/run.sh ddp           # 100M MHAR, 200 steps on 1 GPU and on N GPUs, same global batch (the
#                                              # default: CUDA-graph steps; under torchrun no DDP wrapper)
#   EAGER=1 bash results/multigpu/run.sh ddp   # the same with --cuda_graph=False (eager steps, DDP's wrapper)
#   bash results/multigpu/run.sh fsdp          # random Llama-3.1-8B -> delta form -> 20 FSDP2 steps, checkpoint
#   bash results/multigpu/run.sh fsdp_resume   # ... resume that checkpoint to step 30
# Logs go to $OUT (the device tool's output folder) or results/multigpu/logs/.
set -eo pipefail
N=${N:-$(nvidia-smi -L | wc -l)}
DEST=${OUT:-results/multigpu/logs}
W=${W:-scratch8b}
mkdir -p "$DEST"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast
if [ ! -f data/books_wiki/meta.json ]; then
  SRC=${TEXT:-../shared/data/text}
  python prepare_data.py --input=$SRC/books_wiki_en_train.jsonl.xz --val_input=$SRC/books_wiki_en_val.jsonl.xz \
    --out_dir=data/books_wiki --workers=16
fi
# the paper's 8B mid-training shape (seq 4096, per-layer activation checkpointing, bf16 compute / fp32 master
# weights under FSDP2), 2 microbatches of 1 x 4096 per GPU per step, a horizon of 30 steps, no EMA (disk)
FSDP_ARGS="config/midtrain_8b_delta.py --data_dir=data/books_wiki --out_dir=$W/run --ema_decay=0 --warmup_steps=5
  --lr_decay_steps=30 --batch_tokens=$((N * 2 * 4096)) --micro_batch=1 --eval_interval=20 --eval_tokens=$((N * 4096))
  --log_interval=1"
case "$1" in
ddp)   # graphed steps (under torchrun: no DDP wrapper, gradients averaged after the graphs); EAGER=1: DDP, eager
  S=${STEPS:-200}
  ARGS="config/train_100m.py --data_dir=data/books_wiki --residual=mhar --max_steps=$S
    --warmup_steps=50 --lr_decay_steps=$S --eval_interval=50 --eval_tokens=262144 --save=False --log_interval=1
    ${EAGER:+--cuda_graph=False}"
  sfx=_graph; [ -n "$EAGER" ] && sfx=
  one=ddp_1gpu$sfx; many=ddp_${N}gpu$sfx
  rm -rf out/$one out/$many
  python train.py $ARGS --out_dir=out/$one > "$DEST/$one.txt" 2>&1
  torchrun --standalone --nproc_per_node=$N train.py $ARGS --out_dir=out/$many > "$DEST/$many.txt" 2>&1
  cp out/$one/log.jsonl "$DEST/$one.log.jsonl"
  cp out/$many/log.jsonl "$DEST/$many.log.jsonl"
  python results/multigpu/compare.py out/$one/log.jsonl out/$many/log.jsonl $N | tee "$DEST/${many}_compare.txt"
  ;;
fsdp)
  mkdir -p $W
  rm -rf $W/run
  python results/delta_8b/random_hf.py $W/hf
  python convert.py --hf_dir=$W/hf --out_dir=$W/conv --tokenizer=gpt2 --device=cuda --block_size=4096 --force \
    > "$DEST/convert.txt" 2>&1
  rm -rf $W/hf
  torchrun --standalone --nproc_per_node=$N train.py $FSDP_ARGS --init_from=$W/conv --max_steps=20 \
    > "$DEST/fsdp_20.txt" 2>&1
  rm -rf $W/conv   # the checkpoint at step 20 (fp32 weights and AdamW states: ~96 GB) is all that resume needs
  ;;
fsdp_resume)
  # --save=False: a second ~96 GB checkpoint (written beside the first, then swapped in) would not fit a 128 GB disk
  torchrun --standalone --nproc_per_node=$N train.py $FSDP_ARGS --init_from=resume --max_steps=30 --save=False \
    > "$DEST/fsdp_resume_30.txt" 2>&1
  cp $W/run/log.jsonl "$DEST/fsdp.log.jsonl"
  ;;
*)
  echo "usage: bash results/multigpu/run.sh ddp | fsdp | fsdp_resume" >&2
  exit 2
  ;;
esac
