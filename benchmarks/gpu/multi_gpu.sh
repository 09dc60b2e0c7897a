#!/bin/bash
# Issue 33 on a host of several GPUs, after the staging calls of docs/SGLANG.md ("GPU host": the GPU-scale
# calls 1 and 2, which stage /tmp/sglsite, the memory saver, the math reward's packages and /tmp/models/meta).
# Carry `.gpu-ours` (our dependencies, installed into /tmp/ours once). From the repo root:
#   bash benchmarks/gpu/multi_gpu.sh tests                  # tests/gpu: sharded step, 2-rank checkpoint, colocated run
#                                                          # (TESTS="tests/gpu/FILE ..." runs only those)
#   bash benchmarks/gpu/multi_gpu.sh scale --shape 7b --gpus 2 --placement colocated [gpu_scale.py args]
# Results go to $OUT (the JSON, the tests' log), with what `nvidia-smi` shows on the GPUs afterwards.
# Two runs side by side on one host (CUDA_VISIBLE_DEVICES apart, another engine.launch.port): SCALE_NAME names
# each one's files, NO_CLEANUP=1 leaves the SGLang kill and the nvidia-smi check to the caller, after both.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
export PYTHONPATH=/tmp/ours:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
rc=0
case "$1" in
  tests)
    if [ ! -f /tmp/models/smollm2-random/model.safetensors ]; then
      PYTHONPATH=/tmp/sglsite python3 "${SCRIPTS:-/tmp/gpuscripts}/make_model.py" random /tmp/models/smollm2-random
    fi
    LORA_RL_SGLANG_MODEL=/tmp/models/smollm2-random LORA_RL_SGLANG_PYTHONPATH=/tmp/sglsite \
      timeout -s TERM -k 30 540 python3 -m pytest -m gpu -x -q -p no:cacheprovider -o addopts="" \
      ${TESTS:-tests/gpu/test_sharded.py tests/gpu/test_colocated_run.py} 2>&1 | tail -80 | tee "$OUT/tests.log" || rc=$?
    ;;
  scale)
    shift
    timeout -s TERM -k 60 "${SCALE_TIMEOUT_S:-560}" python3 benchmarks/gpu_scale.py --sglang-pythonpath /tmp/sglsite \
      --out "$OUT/${SCALE_NAME:-scale}.json" "$@" 2>&1 | tail -60 | tee "$OUT/${SCALE_NAME:-scale}.log" || rc=$?
    ;;
esac
[ -n "${NO_CLEANUP:-}" ] && exit "$rc"  # another run shares the host: the caller cleans up after both
source "$(dirname "$0")/after_run.sh"; after_run multi_gpu
exit "$rc"
