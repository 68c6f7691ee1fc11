#!/bin/bash
# the README's test command on the GPU host, with the slowest tests listed; then the chain A/B again
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p ../shared && ln -sfn "$PWD/carry/shared_data" ../shared/data
export TIKTOKEN_CACHE_DIR=$PWD/carry/shared_data/tiktoken_cache
python -c "import sys, os, torch; d = os.path.dirname(torch.__file__); print('dont_write_bytecode', sys.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE', os.environ.get('PYTHONDONTWRITEBYTECODE'), 'PYTHONPYCACHEPREFIX', os.environ.get('PYTHONPYCACHEPREFIX'), 'torch dir writable', os.access(d, os.W_OK), 'pycache', os.path.isdir(d + '/__pycache__'))" 2>&1 | tee $OUT/env.txt
TIMEFORMAT="suite wall %R s"
{ time (timeout ${T:-470} python -m pytest -q -rs --durations=40 test_mhar.py 2>&1 | tee $OUT/gpu_suite.txt) ; } 2>&1 | tail -1 | tee -a $OUT/env.txt
python results/fast_default_h200/ab_chain.py carry/before/routing_kernel.py $OUT/ab_graph_again.json 2>&1 | grep -v "launch config" | tee $OUT/ab_again.txt
