#!/bin/bash
# One-GPU A/B arms run at the same time on one host of several GPUs (issue 34): arm k on GPU k, its own
# SGLang port, the same shape, batch and steps, so every arm sees the same machine and the same minutes.
# After the GPU-scale staging calls of docs/SGLANG.md ("GPU host"). From the repo root:
#   bash benchmarks/gpu/side_by_side.sh SHAPE STEPS NAME="override ..." NAME="override ..." ...
# e.g. bash benchmarks/gpu/side_by_side.sh 1.5b 6 base="" liger="trainer.liger_kernels=true"
# An arm's words are `--override` values of gpu_scale.py, except: a word starting with `--` goes to gpu_scale.py
# as it is (e.g. `--profile-step=3`), and `src=DIR` runs the arm on the code in DIR (an unpacked `git archive`
# of another commit: the A/B of a code change). Each arm writes $OUT/SHAPE-1gpu-NAME.json and .log; afterwards
# an SGLang left on an arm's port is killed and what `nvidia-smi` shows goes to $OUT/nvidia-smi.txt. The arms
# share the host's CPUs and disk: compare them with each other, and a number against a run made alone only
# with that said.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
shape=$1 steps=$2; shift 2
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
export PYTHONPATH=/tmp/ours:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
# the model once, before the arms (each would otherwise race to write the same folder)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_scale as g; \
g.build_model('$shape', Path('/tmp/models/meta'), Path('/tmp/models/qwen2.5-$shape-random'))" 2>&1 | tail -2
gpu=${FIRST_GPU:-0}; pids=(); ports=()  # FIRST_GPU=k: arms on GPUs k, k+1, ... (another shape's arms below k)
for arm in "$@"; do
  name=${arm%%=*} overrides=${arm#*=} src=$PWD
  args=()
  for o in $overrides; do
    case $o in
      src=*) src=${o#src=} ;;
      --*) args+=("$o") ;;
      *) args+=(--override "$o") ;;
    esac
  done
  port=$((30000 + 100 * gpu)); ports+=("$port")
  (cd "$src" && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/ours:$src timeout -s TERM -k 60 "${SCALE_TIMEOUT_S:-540}" \
    python3 benchmarks/gpu_scale.py --sglang-pythonpath /tmp/sglsite --shape "$shape" --gpus 1 --steps "$steps" \
    --out "$OUT/$shape-1gpu-$name.json" --override "engine.launch.port=$port" "${args[@]}") \
    > "$OUT/$shape-1gpu-$name.log" 2>&1 &
  pids+=($!); gpu=$((gpu + 1))
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for arm in "$@"; do name=${arm%%=*}; echo "== $name"; grep -E "^step |^│" "$OUT/$shape-1gpu-$name.log" | tail -8; done
source "$(dirname "$0")/after_run.sh"; after_run side_by_side "${ports[@]}"
# at most 8 files come back from a call: the arms' logs travel as one archive beside their JSONs
# (with the arms' profile outlines; a timeline's trace, `*.trace.json.gz`, comes back on its own)
logs=(); for arm in "$@"; do logs+=("$shape-1gpu-${arm%%=*}.log"); done
for f in "$OUT/$shape"-1gpu-*.timeline.txt "$OUT/$shape"-1gpu-*.train-profile.txt; do
  [ -f "$f" ] && logs+=("$(basename "$f")")
done
tar -C "$OUT" -czf "$OUT/$shape-1gpu-logs-$$.tgz" "${logs[@]}" nvidia-smi.txt && (cd "$OUT" && rm -f "${logs[@]}" nvidia-smi.txt)
exit "$rc"
