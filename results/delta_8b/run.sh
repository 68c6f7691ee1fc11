#!/bin/bash
# The 8B delta path on one H200: random Llama-3.1-8B in HF layout -> convert.py (identity check on the GPU, fp32)
# -> 20 training steps of the delta model (fused routing, activation checkpointing, bf16 weights and AdamW
# states: 8B x (2 + 2 + 4) bytes = 64 GB, where fp32 master weights would need 128 GB before activations).
# W (default scratch8b) is this script's folder: the random model it writes there ($W/hf) is removed once converted,
# and $W/conv is replaced on every call; give W=<a new folder> to keep an earlier one.
set -x
W=${W:-scratch8b}
mkdir -p $W
python results/delta_8b/random_hf.py $W/hf || exit 1
python convert.py --hf_dir=$W/hf --out_dir=$W/conv --tokenizer=gpt2 --device=cuda --block_size=4096 --force || exit 1
rm -rf $W/hf
python train.py config/midtrain_8b_delta.py --init_from=$W/conv --data_dir=data/books_wiki --out_dir=$W/run \
  --fsdp=False --param_dtype=bfloat16 --ema_decay=0 --max_steps=20 --warmup_steps=5 --lr_decay_steps=20 \
  --batch_tokens=16384 --micro_batch=2 --eval_interval=1000 --eval_tokens=16384 --save=False --log_interval=1 "$@"
