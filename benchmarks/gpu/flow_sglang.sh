#!/bin/bash
# The main job on the GPU host with a real SGLang serving the rollouts (issue: GPU + SGLang).
# Usage, from the repo root on the GPU host, after the carry calls of docs/SGLANG.md ("GPU host") have staged
# /tmp/sglsite (SGLang) and /tmp/models/smollm2-gguf (real SmolLM2-135M-Instruct weights from the GGUF):
#   bash benchmarks/gpu/flow_sglang.sh CONFIG [overrides...]
# FLOW_TIMEOUT_S=N ends the flow with SIGTERM after N seconds (an orderly stop: SGLang and the trainer are stopped,
# every finished step is in the store); the same command with the same run.id=... then resumes the run from its
# last checkpoint. A run longer than one 10-minute call of the GPU host is trained so, in several calls.
# Our own dependencies (Prefect and friends, cp312 wheels in .gpu-ours/) go to /tmp/ours; SGLang runs from
# /tmp/sglsite in its own process (its transformers and fastapi differ from ours). Results go to $OUT.
# ENGINE=embedded runs the rollouts on our transformers + PEFT engine on the GPU instead (no SGLang carry needed).
# SGLANG_PORT=N (default 30000) puts the launched SGLang on port N, and only a server left on that port is killed
# afterwards (another script's runs may share the host). RUNS=DIR and STORE=DIR (defaults /tmp/runs, /tmp/store) keep
# runs that share the host apart (`recipe_arms.sh`).
set -euo pipefail
CONFIG=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
export PYTHONPATH=/tmp/ours:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_HOME=/tmp/prefect-home PREFECT_SERVER_ANALYTICS_ENABLED=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc=0
PORT=${SGLANG_PORT:-30000}
RUNS=${RUNS:-/tmp/runs}; STORE=${STORE:-/tmp/store}
ENGINE_ARGS=(engine.type=sglang engine.launch.enabled=true "engine.launch.env={PYTHONPATH: /tmp/sglsite}" engine.launch.port=$PORT)
if [ "${ENGINE:-sglang}" = embedded ]; then ENGINE_ARGS=(engine.type=embedded); fi
timeout -s TERM -k 60 "${FLOW_TIMEOUT_S:-100000}" python3 -m cli.main train -c "$CONFIG" \
  model.name_or_path=/tmp/models/smollm2-gguf "${ENGINE_ARGS[@]}" \
  run.output_dir=$RUNS store.uri=file://$STORE "$@" 2>&1 | tee -a "$OUT/train.log" || rc=$?
echo "[flow_sglang] lora-rl train ended with exit code $rc"
if [ "${ENGINE:-sglang}" != embedded ]; then  # an embedded run launched none: never touch another run's server
  pkill -f "sglang.launch_server.* --port $PORT( |\$)" && echo "[flow_sglang] an SGLang server was left running: killed" || true
fi
RUN_DIR=$(ls -td "$RUNS"/*/ | head -1)
RUN_ID=$(basename "$RUN_DIR")
python3 -m cli.main adapters pull "$RUN_ID@latest" --store "file://$STORE" --out "$OUT/adapter" || true
cp "$RUN_DIR/report.md" "$RUN_DIR/reward_curve.png" "$OUT/" 2>/dev/null || true
tail -c 200000 "$RUN_DIR/sglang.log" > "$OUT/sglang.log" 2>/dev/null || true
cp "$RUN_DIR/history.json" "$OUT/" 2>/dev/null || true
exit "$rc"
