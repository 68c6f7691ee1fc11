#!/bin/bash
# Several GPUs of one host (N, default: all of them). NVLink multicast stays off (shared hosts).
#   bash results/multigpu/run.sh ddp           # 100M MHAR, 200 steps on 1 GPU and on N GPUs, same global batch (the
#                                              # default: CUDA-graph steps; under torchrun no DDP wrapper)
#   EAGER=1 bash results/multigpu/run.sh ddp   # the same with --cuda_graph=False (eager steps, DDP's wrapper)
#   bash results/multigpu/run.sh fsdp          # random Llama-3.1-8B -> delta form -> 20 FSDP2 steps, checkpoint
#   bash results/multigpu/run.sh fsdp_resume   # ... resume that checkpoint to step 30
#   bash results/multigpu/run.sh scaling       # the README's paper-scale commands (config/train_{100m,350m,1b}.py,
#                                              # baseline and mhar), 200 steps on 1 GPU and on N at the same global
#                                              # batch, then a repeat of each 1-GPU run (the noise floor): the table
#   GRAD_SYNC=overlap bash results/multigpu/run.sh scaling   # the N-GPU runs again with --grad_sync=overlap
#   bash results/multigpu/run.sh bench         # torchrun bench.py ddp: the all-reduce's share of the step, overlapped
# SCALES="100m 1b" MODES=mhar AGAIN= pick a subset (AGAIN= skips the repeats); runs with a log in
# results/multigpu/logs/scaling are skipped, so the work can be split over device calls (copy each call's logs back).
# Logs go to $OUT (when set) or results/multigpu/logs/. The ddp and scaling runs save no checkpoint: a run again
# into its out/ folder keeps the earlier log beside the new one (train.py). fsdp refuses a $W/run that exists unless
# FRESH=1 (which removes it); $W/hf and $W/conv are this script's own intermediates (a random model), removed by it.
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
  python train.py $ARGS --out_dir=out/$one > "$DEST/$one.txt" 2>&1
  torchrun --standalone --nproc_per_node=$N train.py $ARGS --out_dir=out/$many > "$DEST/$many.txt" 2>&1
  cp out/$one/log.jsonl "$DEST/$one.log.jsonl"
  cp out/$many/log.jsonl "$DEST/$many.log.jsonl"
  python results/multigpu/compare.py out/$one/log.jsonl out/$many/log.jsonl $N | tee "$DEST/${many}_compare.txt"
  ;;
scaling)   # each command on 1 GPU and on N, then the 1-GPU repeats; data: the offline books+Wikipedia text. The logs
  # go to results/multigpu/logs/scaling (copied to $OUT/scaling as they finish): a run whose log is there is skipped
  S=${STEPS:-200}
  LOGS=results/multigpu/logs/scaling
  mkdir -p $LOGS ${OUT:+$OUT/scaling}
  run_one() {   # scale mode processes name-suffix
    local name=$1_$2_$3gpu$4
    if [ -f "$LOGS/$name.log.jsonl" ]; then echo "done already: $name"; return; fi
    local args="config/train_$1.py --residual=$2 --data_dir=data/books_wiki --max_steps=$S --warmup_steps=50
      --lr_decay_steps=$S --eval_interval=100 --eval_tokens=262144 --save=False --log_interval=1 --out_dir=out/$name"
    echo "$(date +%T) $name"
    local launch="python"
    [ "$3" = 1 ] || launch="torchrun --standalone --nproc_per_node=$3"
    if ! $launch train.py $args ${GRAD_SYNC:+--grad_sync=$GRAD_SYNC} > "$LOGS/$name.txt" 2>&1; then
      [ -z "$OUT" ] || cp "$LOGS/$name.txt" "$OUT/scaling/"
      tail -20 "$LOGS/$name.txt"
      echo "run.sh: $name failed (its output: $LOGS/$name.txt)" >&2
      exit 1
    fi
    cp out/$name/log.jsonl "$LOGS/$name.log.jsonl"
    [ -z "$OUT" ] || cp "$LOGS/$name.txt" "$LOGS/$name.log.jsonl" "$OUT/scaling/"
  }
  for scale in ${SCALES:-100m 350m 1b}; do
    for mode in ${MODES:-baseline mhar}; do
      [ -z "$GRAD_SYNC" ] && run_one $scale $mode 1 ""   # GRAD_SYNC: the N-GPU runs only
      run_one $scale $mode $N "${GRAD_SYNC:+_$GRAD_SYNC}"
    done
  done
  if [ -z "$GRAD_SYNC" ] && [ -n "${AGAIN-1}" ]; then
    for scale in ${SCALES:-100m 350m 1b}; do
      for mode in ${MODES:-baseline mhar}; do
        run_one $scale $mode 1 _again
      done
    done
  fi
  python results/multigpu/compare.py --table $LOGS $N | tee "$LOGS/table_${N}gpu.md"
  [ -z "$OUT" ] || cp "$LOGS/table_${N}gpu.md" "$OUT/scaling/"
  ;;
bench)   # one process group: the step with no average, one all-reduce after the graphs, and overlapped
  torchrun --standalone --nproc_per_node=$N bench.py ddp --scales=${BENCH_SCALES:-100m,350m,1b} \
    --variants=baseline,mhar_fused --output="$DEST/bench_ddp_${N}gpu.json" 2>&1 | tee "$DEST/bench_ddp_${N}gpu.txt"
  ;;
fsdp)
  mkdir -p $W
  if [ -e $W/run ]; then
    [ "${FRESH:-0}" = 1 ] || { echo "run.sh: $W/run holds an earlier fsdp run: FRESH=1 replaces it, or give W=<a new folder>" >&2; exit 2; }
    rm -rf $W/run
  fi
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
  echo "usage: bash results/multigpu/run.sh ddp | scaling | bench | fsdp | fsdp_resume" >&2
  exit 2
  ;;
esac
