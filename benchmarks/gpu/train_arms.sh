#!/bin/bash
# Training runs side by side on a host of several GPUs, one arm per GPU (issue 43: the truncation modes of the
# word-problems recipe, same seed and steps). After the carry calls of docs/SGLANG.md ("GPU host": site, GGUF,
# data; .gpu-ours carried in this call or staged in /tmp/ours):
#   FLOW_TIMEOUT_S=540 bash benchmarks/gpu/train_arms.sh CONFIG keep="algorithm.truncation=keep" mask="..." ...
# Arm k runs `flow_sglang.sh CONFIG run.id=<arm> OVERRIDES` on GPU FIRST_GPU + k (default 0), or on the k-th of
# GPUS (a list that wraps around: GPUS="2 3" puts arms 0 and 2 on GPU 2; embedded arms of a small model share a
# GPU well), with its own SGLang port, run folder and store (under /tmp/arms/<arm>/), so the same command in the next call resumes every arm from
# its last checkpoint. Overrides are split at spaces: write YAML values without spaces (JSON: `[{"name":"math"}]`).
# ENGINE=embedded (flow_sglang.sh) runs the arms' rollouts on our engine instead of SGLang.
# The arms' logs, reports, histories and adapter manifests come back packed in one $OUT/arms-<first arm>.tgz
# (with KEEP_ADAPTERS=1 the adapters' weights too). HELDOUT=1 then grades each arm's last adapter against the base
# model under the config's wording and a reworded one (benchmarks/heldout_wording.py, on the arm's GPU).
set -uo pipefail
CONFIG=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
k=0; pids=(); FIRST=${FIRST_GPU:-0}
read -r -a gpus <<< "${GPUS:-}"
gpu_of() { if [ ${#gpus[@]} -gt 0 ]; then echo "${gpus[$(($1 % ${#gpus[@]}))]}"; else echo $((FIRST + $1)); fi; }
for arm in "$@"; do
  name=${arm%%=*}; overrides=${arm#*=}
  dir=/tmp/arms/$name; mkdir -p "$dir/out"
  # shellcheck disable=SC2086 # the overrides are words
  CUDA_VISIBLE_DEVICES=$(gpu_of $k) SGLANG_PORT=$((30000 + 10 * (FIRST + k))) RUNS=$dir/runs STORE=$dir/store OUT=$dir/out \
    bash benchmarks/gpu/flow_sglang.sh "$CONFIG" run.id="$name" $overrides > "$dir/out/arm.log" 2>&1 &
  pids+=($!); k=$((k + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
names=()
for arm in "$@"; do
  name=${arm%%=*}; dir=/tmp/arms/$name; names+=("$name")
  cp "$dir"/runs/*/report.md "$dir"/runs/*/history.json "$dir/out/" 2>/dev/null
  (cd "$dir/out" && sha256sum adapter/*.safetensors > adapter.sha256 2>/dev/null)
  rm -f "$dir/out/sglang.log"
  # too big to bring back for many arms; adapter.sha256 names them. KEEP_ADAPTERS=1 keeps them (a few small ones)
  if [ "${KEEP_ADAPTERS:-0}" != 1 ]; then rm -f "$dir"/out/adapter/*.safetensors; fi
  echo "[$name] $(grep -E '^(step|done)' "$dir/out/train.log" | tail -2 | tr '\n' ' ')"
done
if [ "${HELDOUT:-0}" = 1 ]; then
  k=0; pids=()
  for name in "${names[@]}"; do
    CUDA_VISIBLE_DEVICES=$(gpu_of $k) PYTHONPATH=/tmp/ours:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python3 \
      benchmarks/heldout_wording.py -c "$CONFIG" --adapter "$name@latest" --out "/tmp/arms/$name/out/heldout_wording.json" \
      --set model.name_or_path=/tmp/models/smollm2-gguf "store.uri=file:///tmp/arms/$name/store" \
      > "/tmp/arms/$name/out/heldout_wording.txt" 2>&1 &
    pids+=($!); k=$((k + 1))
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for name in "${names[@]}"; do echo "[$name] heldout:"; grep -E "^\|? *(trained|reworded)" "/tmp/arms/$name/out/heldout_wording.txt"; done
fi
tar -C /tmp/arms -czf "$OUT/arms-${names[0]}.tgz" "${names[@]/%//out}"  # one file for all arms (8 files a call)
source benchmarks/gpu/after_run.sh
if [ "${ENGINE:-sglang}" = embedded ]; then after_run train_arms 0; else  # port 0: no SGLang to kill (another
  after_run train_arms $(seq $((30000 + 10 * FIRST)) 10 $((30000 + 10 * (FIRST + k - 1))))  # script's may run)
fi
