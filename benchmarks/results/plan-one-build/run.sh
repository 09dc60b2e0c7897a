#!/bin/bash
# Two alternating runs of benchmarks/cpu_step.py for 15033e6 (/tmp/base) and HEAD (/work/main), same config.
set -u
CFG=/tmp/base/configs/smollm2-arith-grpo.yaml
PY=/work/main/.venv/bin/python
for i in 1 2; do
  (cd /tmp/base && $PY benchmarks/cpu_step.py --dtypes auto --steps 4 --warmup 1 --config $CFG --out /tmp/cs/base-$i.json) > /tmp/cs/base-$i.log 2>&1
  (cd /work/main && $PY benchmarks/cpu_step.py --dtypes auto --steps 4 --warmup 1 --config $CFG --override algorithm.truncation=keep --out /tmp/cs/head-$i.json) > /tmp/cs/head-$i.log 2>&1
done
echo finished
