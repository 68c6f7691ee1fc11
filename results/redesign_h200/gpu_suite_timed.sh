#!/bin/bash
# the README's test command on the GPU host, one line per test with its end time; T = the limit in seconds,
# ARGS = more pytest options (e.g. ARGS="-n auto --dist worksteal" for pytest-xdist), NAME = the output's name
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p ../shared && ln -sfn "$PWD/carry/shared_data" ../shared/data
export TIKTOKEN_CACHE_DIR=$PWD/carry/shared_data/tiktoken_cache
nvidia-smi -L > $OUT/env.txt; nproc >> $OUT/env.txt
S=$(date +%s.%N)
timeout ${T:-530} python -m pytest -v -rs --durations=50 $ARGS test_mhar.py 2>&1 | python -u -c "
import sys, time
t0 = float(sys.argv[1])
for l in sys.stdin: print(f'{time.time() - t0:7.1f} {l}', end='', flush=True)" $S > $OUT/${NAME:-suite_gpu}.txt
echo "suite rc ${PIPESTATUS[0]} wall $(python -c "import time; print(round(time.time() - $S, 1))") s" | tee -a $OUT/env.txt
tail -3 $OUT/${NAME:-suite_gpu}.txt
