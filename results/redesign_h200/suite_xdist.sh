#!/bin/bash
# after suite_serial_bg.sh, on the same machine: wait for the serial suite to end, then the same suite under pytest-xdist
# (its wheels in .whl/, installed to /tmp/site); NS = worker counts to try (default auto); both results to $OUT
while ! grep -q "suite rc" /tmp/suite_out/env.txt 2>/dev/null; do sleep 2; done
cp /tmp/suite_out/* $OUT/; mv $OUT/env.txt $OUT/env_serial.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
for n in ${NS:-auto}; do
  ARGS="-n $n --dist worksteal" NAME=suite_xdist_$n T=${T:-200} bash results/redesign_h200/gpu_suite_timed.sh
  mv $OUT/env.txt $OUT/env_xdist_$n.txt
done
