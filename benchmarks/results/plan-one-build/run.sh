#!/bin/bash
# Two alternating runs of benchmarks/cpu_step.py, base then head then base then head, on one config (the base's).
#   bash run.sh BASE_TREE HEAD_TREE OUT_DIR [PYTHON]
# BASE_TREE: 15033e6 (`git archive 15033e6 | tar -x -C BASE_TREE`); HEAD_TREE: a clone of the commit measured.
set -u
BASE=${1:?base tree} HEAD=${2:?head tree} OUT=${3:?output folder} PY=${4:-$HEAD/.venv/bin/python}
CFG=$BASE/configs/smollm2-arith-grpo.yaml
mkdir -p "$OUT"
for i in 1 2; do
  (cd "$BASE" && $PY benchmarks/cpu_step.py --dtypes auto --steps 4 --warmup 1 --config "$CFG" --out "$OUT/base-$i.json") \
    >"$OUT/base-$i.log" 2>&1
  # 15033e6 had no truncation setting and kept cut completions: `keep` trains the same rows
  (cd "$HEAD" && $PY benchmarks/cpu_step.py --dtypes auto --steps 4 --warmup 1 --config "$CFG" \
    --override algorithm.truncation=keep --out "$OUT/head-$i.json") >"$OUT/head-$i.log" 2>&1
done
echo finished
