#!/bin/bash
# Training runs side by side on a host of several GPUs, one arm per GPU (issue 43: the truncation modes of the
# word-problems recipe, same seed and steps). After the carry calls of docs/SGLANG.md ("GPU host": site, GGUF,
# data; .gpu-ours carried in this call or staged in /tmp/ours):
#   FLOW_TIMEOUT_S=540 bash benchmarks/gpu/train_arms.sh CONFIG keep="algorithm.truncation=keep" mask="..." ...
# Arm k runs `flow_sglang.sh CONFIG run.id=<arm> OVERRIDES` on GPU FIRST_GPU + k (default 0) with its own SGLang
# port, run folder and store (under /tmp/arms/<arm>/), so the same command in the next call resumes every arm from
# its last checkpoint. Overrides are split at spaces: write YAML values without spaces (JSON: `[{"name":"math"}]`).
# ENGINE=embedded (flow_sglang.sh) runs the arms' rollouts on our engine instead of SGLang.
# The arms' logs, reports, histories and adapter manifests come back packed in one $OUT/arms-<first arm>.tgz.
set -uo pipefail
CONFIG=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
k=0; pids=(); FIRST=${FIRST_GPU:-0}
for arm in "$@"; do
  name=${arm%%=*}; overrides=${arm#*=}
  dir=/tmp/arms/$name; mkdir -p "$dir/out"
  # shellcheck disable=SC2086 # the overrides are words
  CUDA_VISIBLE_DEVICES=$((FIRST + k)) SGLANG_PORT=$((30000 + 10 * (FIRST + k))) RUNS=$dir/runs STORE=$dir/store OUT=$dir/out \
    bash benchmarks/gpu/flow_sglang.sh "$CONFIG" run.id="$name" $overrides > "$dir/out/arm.log" 2>&1 &
  pids+=($!); k=$((k + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
names=()
for arm in "$@"; do
  name=${arm%%=*}; dir=/tmp/arms/$name; names+=("$name")
  cp "$dir"/runs/*/report.md "$dir"/runs/*/history.json "$dir/out/" 2>/dev/null
  (cd "$dir/out" && sha256sum adapter/*.safetensors > adapter.sha256 2>/dev/null)
  rm -f "$dir/out/sglang.log" "$dir"/out/adapter/*.safetensors  # too big to bring back; adapter.sha256 names them
  echo "[$name] $(grep -E '^(step|done)' "$dir/out/train.log" | tail -2 | tr '\n' ' ')"
done
tar -C /tmp/arms -czf "$OUT/arms-${names[0]}.tgz" "${names[@]/%//out}"  # one file for all arms (8 files a call)
source benchmarks/gpu/after_run.sh
if [ "${ENGINE:-sglang}" = embedded ]; then after_run train_arms 0; else  # port 0: no SGLang to kill (another
  after_run train_arms $(seq $((30000 + 10 * FIRST)) 10 $((30000 + 10 * (FIRST + k - 1))))  # script's may run)
fi
