#!/usr/bin/env bash
# verl 0.9.1 and lora-rl in one call on one GPU, the same shape, batch and lengths (issue 46, item 5).
# After the carry calls of docs/SGLANG.md ("GPU host": the site, `.gpu-data` with the site's second part, Ray),
# carry `.gpu-ours` and `.gpu-verl`:  SHAPE=1.5b STEPS=8 bash benchmarks/peers/verl/side_by_side.sh
# Ours: benchmarks/gpu_scale.py (16 prompts x 8 samples x 256 new tokens; random weights almost never end a
# completion). verl: run_verl_grpo_lora.sh with prompts of our prompts' mean length (48 tokens, SmolLM2's
# tokenizer on the default task) and ignore_eos. Leaves in $OUT: ours.json, verl-metrics.jsonl,
# verl-config.yaml (verl's whole resolved config) and the logs packed in logs.tgz.
# SIDES=verl or SIDES=ours runs one side (a 7B pair does not fit one 10-minute call); GRAD_CKPT and VERL_ARGS
# reach run_verl_grpo_lora.sh (its trainer tuned: benchmarks/peers/README.md).
set -uo pipefail
R=$PWD; OUT=${OUT:?}; SHAPE=${SHAPE:-1.5b}; STEPS=${STEPS:-8}; PROMPT_LEN=${PROMPT_LEN:-48}
VERL_TIMEOUT_S=${VERL_TIMEOUT_S:-330}; OURS_TIMEOUT_S=${OURS_TIMEOUT_S:-240}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
  touch /tmp/ours/.complete
fi
if [ -d .gpu-verl ] && [ ! -f /tmp/verlsite/.complete ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/verlsite .gpu-verl/*.whl
  touch /tmp/verlsite/.complete
fi
# verl killed by its time limit left a process holding 4.6 GiB after `ray stop --force` (2026-11-29): whatever still
# holds the GPU after the polite stop is killed, so that the next side starts on an empty GPU
clean() {
  python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1; pkill -f "[s]glang"; sleep 3
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null; sleep 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
rm -rf /tmp/side/logs && mkdir -p /tmp/side/logs  # this call's logs only (SIDES may run one side)
V=/tmp/side/verl-$SHAPE
if [ ! -f "$V/model/config.json" ] || ! ls "$V"/model/*.safetensors >/dev/null 2>&1; then
  PYTHONPATH=/tmp/ours python3 benchmarks/peers/verl/prep_verl_bench.py --config "benchmarks/model_configs/qwen2.5-$SHAPE.json" \
    --out "$V" --prompts $((16 * (STEPS + 1))) --prompt-len "$PROMPT_LEN" --weights
fi
for side in ${SIDES:-ours verl}; do  # SIDES=verl (or ours) runs one side, where one call cannot hold both
  echo "[side] $side $(date +%T)"
  if [ "$side" = ours ]; then
    PYTHONPATH=/tmp/ours:$R timeout -s TERM "$OURS_TIMEOUT_S" python3 benchmarks/gpu_scale.py --shape "$SHAPE" \
      --steps "$STEPS" --sglang-pythonpath /tmp/sglsite --out "$OUT/ours.json" "${@}" > /tmp/side/logs/ours.log 2>&1
  else
    mkdir -p /tmp/side/verlrun && cd /tmp/side/verlrun && rm -f "$V/metrics.jsonl"
    PYTHONPATH=/tmp/verlsite:/tmp/raysite:/tmp/ours:/tmp/sglsite OUT="$V" STEPS="$STEPS" PROMPT_LEN="$PROMPT_LEN" \
      timeout -s TERM "$VERL_TIMEOUT_S" bash "$R/benchmarks/peers/verl/run_verl_grpo_lora.sh" ${VERL_ARGS:-} \
      > /tmp/side/logs/verl.log 2>&1
  fi
  echo "[side] $side rc=$? $(date +%T)"; clean; cd "$R"
done
# what comes back names no machine's folders (ours.json is scrubbed by gpu_scale.py's writer)
VENV=$(python3 -c "import sys; print(sys.prefix)")
scrub() { sed -i -e "s#$R#<repo>#g" -e "s#$VENV#<venv>#g" -e "s#$HOME/#<home>/#g" -e "s#/tmp/#<tmp>/#g" "$@"; }
if [ -f /tmp/side/logs/verl.log ]; then  # verl ran in this call: its metrics and config, not an earlier call's
  cp "$V/metrics.jsonl" "$OUT/verl-metrics.jsonl" 2>/dev/null
  cp "$(ls -t /tmp/side/verlrun/outputs/*/*/.hydra/config.yaml 2>/dev/null | head -1)" "$OUT/verl-config.yaml" 2>/dev/null
  scrub "$OUT"/verl-*
fi
scrub /tmp/side/logs/*.log
tar -C /tmp/side -czf "$OUT/logs.tgz" logs
tail -5 /tmp/side/logs/ours.log 2>/dev/null; grep -E "Error|error:|Traceback|step:" /tmp/side/logs/verl.log 2>/dev/null | tail -25
