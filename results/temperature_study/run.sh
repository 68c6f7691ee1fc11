#!/bin/bash
# Paired multi-seed runs, resumable: bash results/temperature_study/run.sh SPEC [SPEC ...]
#   SPEC = SHAPE:MODE:SEED[:SCALE[:H[:INIT]]]   SHAPE 100m | 124m | 350m (d512 / L12, d768 / L12 as
#   config/repro_124m.py, d1024 / L24), MODE baseline | attnres | mhar, SCALE the route_scale (default 1), H mhar's
#   route_heads (default: the KV heads), INIT the route_init_std (default 0: zero queries; 0.02: random, the paper's
#   FineWeb runs). NAME = SHAPE_MODE_sSEED[_xSCALE][_hH][_qINIT]: a suffix only where the spec gives a value other than
#   the default, so 100m:mhar:0 and 100m:mhar:0:1::0 are one run (H, if given, always names it: 100m:mhar:0:1:4 is a
#   run of its own). e.g. bash results/temperature_study/run.sh 100m:attnres:0:0.5 100m:mhar:0:1:16 124m:attnres:2:1::0.02
# BUDGET=reduced (default): config/repro_100m.py's 2,000 steps of 32 x 1024 tokens on the offline books+Wikipedia
#   text (tokenized into data/books_wiki on first use, from $TEXT, default ../shared/data/text); logs in logs/.
# BUDGET=paper: the paper's 20k steps (config/train_100m.py at 100M and 124M, config/train_350m.py at 350M, Table 1's
#   recipe) on FineWeb-Edu in data/fineweb_edu (python prepare_data.py --max_tokens=2.7e9 --out_dir=data/fineweb_edu);
#   logs in logs_paper/. Each run keeps its checkpoint and a stopped run resumes from it.
# GPUS=8 runs 8 runs at once, one per GPU (CUDA_VISIBLE_DEVICES), each GPU taking the next spec not yet taken.
# A run whose log is in the log folder ($LOGS) is skipped (done); its log.jsonl is copied there only when it finished.
# EXTRA="--lr=5e-4" appends train.py arguments to every run (give such runs their own LOGS: the names do not show it).
# SAVE=True keeps a reduced run's checkpoint in $RUNS/NAME (for eval.py); by default only the logs are kept. It is
#   written at every eval (5 GB at 350M); EXTRA="--save_every=500" writes it less often (a cut run redoes at most 500).
# A stopped run that has a checkpoint ($RUNS/NAME/ckpt.pt: SAVE=True or BUDGET=paper) resumes from it; one without
#   starts again (train.py keeps its old log beside the new). Nothing is deleted: FRESH=1 removes a run's folder
#   ($RUNS/NAME) and empties its .txt before it starts from scratch; otherwise each attempt's output is appended.
# RUNS= the folder of the runs' folders (default out/study, BUDGET=paper out/study_paper). A run folder belongs to the
#   LOGS its run started with ($RUNS/.NAME.logs): a run of the same name logged elsewhere (a rerun on another tree,
#   other data) is refused rather than resumed from it; give such runs a RUNS of their own.
# Long lists can run in the background: nohup bash results/temperature_study/run.sh ... &
# A copy without its own .git names its tree in each run's header by MHAR_REVISION (which wins over git when set):
#   MHAR_REVISION=$(git rev-parse --short HEAD) where the checkout is, then MHAR_REVISION=<that> bash run.sh ... there.
set -eo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)   # the repository (common.py: the lock a FRESH removal checks)
BUDGET=${BUDGET:-reduced}
GPUS=${GPUS:-1}
case $BUDGET in
  reduced) DATA=${DATA:-data/books_wiki}; LOGS=${LOGS:-results/temperature_study/logs}; RUNS=${RUNS:-out/study}
           SAVE=${SAVE:-False} ;;
  paper)   DATA=${DATA:-data/fineweb_edu}; LOGS=${LOGS:-results/temperature_study/logs_paper}
           RUNS=${RUNS:-out/study_paper}; SAVE=True ;;
  *) echo "run.sh: BUDGET=$BUDGET is not reduced or paper"; exit 2 ;;
esac
case $GPUS in ''|*[!0-9]*|0) echo "run.sh: GPUS=$GPUS is not a positive number of GPUs"; exit 2 ;; esac
if [ "$GPUS" != 1 ] && command -v nvidia-smi > /dev/null; then
  have=$(nvidia-smi -L | wc -l)
  if [ "$GPUS" -gt "$have" ]; then echo "run.sh: GPUS=$GPUS but nvidia-smi lists $have GPUs: give GPUS=$have or fewer"; exit 2; fi
fi
if [ $# = 0 ]; then echo "usage: bash results/temperature_study/run.sh SHAPE:MODE:SEED[:SCALE[:H[:INIT]]] ... (see its head)"; exit 2; fi
for spec in "$@"; do   # every spec is checked before the first run starts
  IFS=: read -r shape mode seed scale heads init rest <<< "$spec"
  case $shape in 100m|124m|350m) ;; *) echo "run.sh: unknown shape '$shape' in '$spec' (100m | 124m | 350m)"; exit 2 ;; esac
  case $mode in baseline|attnres|mhar) ;; *) echo "run.sh: unknown mode '$mode' in '$spec' (baseline | attnres | mhar)"; exit 2 ;; esac
  case $seed in ''|*[!0-9]*) echo "run.sh: seed '$seed' in '$spec' is not a non-negative integer"; exit 2 ;; esac
  if [ -n "$rest" ] || ! [[ ${scale:-1} =~ ^[0-9]*\.?[0-9]+$ && ${scale:-1} =~ [1-9] ]]; then
    echo "run.sh: '$spec' is not SHAPE:MODE:SEED[:SCALE[:H[:INIT]]] with a positive number as SCALE"; exit 2
  fi
  if [ -n "$heads" ] && { ! [[ $heads =~ ^[1-9][0-9]*$ ]] || { [ "$mode" != mhar ] && [ "$heads" != 1 ]; }; }; then
    echo "run.sh: H '$heads' in '$spec' is not a positive integer (and a single head's H is 1)"; exit 2
  fi
  if [ -n "$init" ] && { ! [[ $init =~ ^[0-9]*\.?[0-9]+$ ]] || { [ "$mode" = baseline ] && [[ $init =~ [1-9] ]]; }; }; then
    echo "run.sh: INIT '$init' in '$spec' is not a number >= 0 (and the baseline has no queries)"; exit 2
  fi
done
if [ ! -f "$DATA/meta.json" ]; then
  if [ "$BUDGET" = paper ]; then
    echo "run.sh: BUDGET=paper trains on FineWeb-Edu in $DATA, which is not prepared. Prepare it once (~2.7B tokens," \
         "enough for 20k steps at 100M and 124M): python prepare_data.py --max_tokens=2.7e9 --out_dir=$DATA"; exit 2
  fi
  SRC=${TEXT:-../shared/data/text}   # tokenize once (~10 s on 16 cores)
  python prepare_data.py --input=$SRC/books_wiki_en_train.jsonl.xz --val_input=$SRC/books_wiki_en_val.jsonl.xz \
    --out_dir=$DATA --workers=16
fi
mkdir -p "$LOGS" "$RUNS"
LOGS_AT=$(cd "$LOGS" && pwd)   # what a run folder's owner file ($RUNS/.NAME.logs) holds

run_one() {   # SPEC: train it unless its log is in $LOGS
  local shape mode seed scale heads init cfg shape_args name start route_args=""
  IFS=: read -r shape mode seed scale heads init <<< "$1"
  scale=${scale:-1}
  case $BUDGET:$shape in
    reduced:100m) cfg=config/repro_100m.py ;;
    reduced:124m) cfg="config/repro_100m.py config/repro_124m.py" ;;   # repro_124m.py: the shape alone
    reduced:350m) cfg=config/repro_100m.py
                  shape_args="--n_layer=24 --n_head=16 --n_kv_head=8 --n_embd=1024 --ffn_hidden=4096" ;;
    paper:100m)   cfg=config/train_100m.py ;;
    paper:124m)   cfg="config/train_100m.py config/repro_124m.py" ;;
    paper:350m)   cfg=config/train_350m.py ;;
  esac
  name=${shape}_${mode}_s${seed}
  if [ "$scale" != 1 ]; then name=${name}_x$scale; fi
  if [ -n "$heads" ] && [ "$mode" = mhar ]; then name=${name}_h$heads; route_args="--route_heads=$heads"; fi
  if [[ ${init:-0} =~ [1-9] ]]; then name=${name}_q$init; route_args="$route_args --route_init_std=$init"; fi
  if [ -f "$LOGS/$name.log.jsonl" ]; then echo "$name: done, skipped"; return; fi
  start=--init_from=scratch
  if [ "${FRESH:-0}" = 1 ]; then   # a run still training holds its folder (train.lock, common.lock_holder): kept
    held=0; python -c 'import sys; sys.path.insert(0, sys.argv[1]); import common
sys.exit(0 if common.lock_holder(sys.argv[2]) else 3)' "$ROOT" "$RUNS/$name/train.lock" || held=$?
    if [ $held != 3 ]; then
      echo "$name: FRESH=1 but $RUNS/$name is $([ $held = 0 ] && echo "in use by a running train.py (its train.lock" \
           "is held)" || echo "not checked (its lock could not be read)"): not removed; stop that run first"
      echo "$name" >> "$failed"; return
    fi
  fi
  local owner="$RUNS/.$name.logs"   # the LOGS this run folder's run was started with
  if [ "${FRESH:-0}" = 1 ]; then
    rm -rf "${RUNS:?}/$name" "$owner"; : > "$LOGS/$name.txt"; echo "$name: FRESH=1, starting from scratch"
  elif [ -f "$RUNS/$name/ckpt.pt" ] && [ -f "$owner" ] && [ "$(cat "$owner")" != "$LOGS_AT" ]; then
    echo "$name: $RUNS/$name holds the run logged in $(cat "$owner"), not in LOGS=$LOGS: not resumed; give these runs" \
         "a folder of their own (RUNS=out/$(basename "$LOGS"))"
    echo "$name" >> "$failed"; return
  elif [ -f "$RUNS/$name/ckpt.pt" ]; then
    start=--init_from=resume; echo "$name: resuming $RUNS/$name"
  fi
  echo "$LOGS_AT" > "$owner"
  local cmd="python train.py $cfg --residual=$mode --seed=$seed --route_scale=$scale $route_args $shape_args --data_dir=$DATA
    --save=$SAVE --out_dir=$RUNS/$name --log_interval=10 $start $EXTRA"
  echo "run.sh: "$cmd >> "$LOGS/$name.txt"   # the command, on one line, above its output
  $cmd >> "$LOGS/$name.txt" 2>&1 || { echo "$name: failed (see $LOGS/$name.txt)"; echo "$name" >> "$failed"; return; }
  cp "$RUNS/$name/log.jsonl" "$LOGS/$name.log.jsonl"
  grep -E "^done" "$LOGS/$name.txt" | tail -1 | sed "s/^/$name: /" || true
}

failed=$(mktemp "$RUNS/.failed.XXXXXX")   # the names of the runs that failed, from every worker
if [ "$GPUS" = 1 ]; then
  for spec in "$@"; do run_one "$spec"; done
else   # one worker per GPU; a spec is taken by the first worker to make its claim folder (mkdir is atomic)
  claims=$(mktemp -d "$RUNS/.claims.XXXXXX")
  for gpu in $(seq 0 $((GPUS - 1))); do
    (export CUDA_VISIBLE_DEVICES=$gpu
     for spec in "$@"; do
       mkdir "$claims/${spec//[:.]/_}" 2> /dev/null || continue
       run_one "$spec"
     done) 2>&1 | sed -u "s/^/gpu $gpu: /" &
  done
  wait
  rm -rf "$claims"
fi
if [ -s "$failed" ]; then
  echo "run.sh: $(wc -l < "$failed") run(s) failed: $(tr '\n' ' ' < "$failed")(each one's .txt in $LOGS says why; the same" \
       "command retries them and skips the finished)"
  rm -f "$failed"; exit 1
fi
rm -f "$failed"
