#!/bin/bash
# Learning parity of async rollouts over many seeds on one GPU host (issue: async rollouts): several
# `benchmarks/async_rollouts.py` processes side by side, each with its own SGLang server (own port, a small
# memory fraction) and its own seeds, all with the same variants. The model is small (135M), so one H100
# serves four such processes; their step times are not a speed measurement (the GPU is shared), their
# accuracies are. Runs outlast one 10-minute call of the GPU host: `start` leaves them running in their own
# process sessions, `wait` polls, `collect` copies the JSON and log tails to $OUT.
# After the carry calls of docs/SGLANG.md ("GPU host"), from the repo root there:
#   SEEDS="0,1 2,3 4,5 6,7" STEPS=30 bash benchmarks/gpu/async_parity.sh start
#   WAIT_S=540 bash benchmarks/gpu/async_parity.sh wait      # returns when all ended or after WAIT_S
#   bash benchmarks/gpu/async_parity.sh collect         # PACK=NAME: one NAME.tgz (a call returns <= 8 files)
# VARIANTS (space-separated, `--variants` syntax of async_rollouts.py) default to sync, async (auto correction),
# async with no correction, and async with TRL's sequence mask. Two sets side by side on a host of two GPUs:
# `CUDA_VISIBLE_DEVICES=k PARITY_DIR=/tmp/park PORT_BASE=3k000 ... start` once per GPU (then wait and collect
# each DIR); EVAL_SIZE=null keeps a dataset's own test split (data.eval_size).
set -uo pipefail
DIR=${PARITY_DIR:-/tmp/parity}
OUT=${OUT:-/tmp/out}
CONFIG=${CONFIG:-configs/smollm2-arith-grpo.yaml}
VARIANTS=${VARIANTS:-"sync async async-none:rollout.mode=async;algorithm.off_policy_correction=none async-seqmask:rollout.mode=async;algorithm.off_policy_correction=sequence-mask"}
export PYTHONPATH=/tmp/ours:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# four ephemeral Prefect servers start beside four SGLang servers: more than the default 20 s on a fresh host
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120

case ${1:-} in
start)
  if [ -d .gpu-ours ] && [ ! -f /tmp/ours/.complete ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ours .gpu-ours/*.whl
    touch /tmp/ours/.complete
  fi
  mkdir -p "$DIR"
  i=0
  # shellcheck disable=SC2086  # VARIANTS splits on spaces on purpose
  for seeds in ${SEEDS:?SEEDS=\"0,1 2,3\": one process per group}; do
    PREFECT_HOME=$DIR/prefect-home-$i setsid python3 benchmarks/async_rollouts.py --config "$CONFIG" \
      --seeds "$seeds" --steps "${STEPS:-30}" --launch-sglang --device cuda --check-versions "${CHECK:-3}" \
      --out "$DIR/parity_p$i.json" --variants $VARIANTS \
      --set model.name_or_path=/tmp/models/smollm2-gguf engine.type=sglang "engine.launch.env={PYTHONPATH: /tmp/sglsite}" \
      engine.sglang_retire=keep engine.launch.cuda_graph_max_bs=null "data.eval_size=${EVAL_SIZE:-512}" \
      engine.launch.port=$((${PORT_BASE:-30000} + 100 * i)) engine.launch.mem_fraction_static="${MEM:-0.12}" ${EXTRA:-} \
      >"$DIR/p$i.log" 2>&1 </dev/null &
    echo $! >"$DIR/p$i.pid"
    echo "[async_parity] process $i: seeds $seeds, pid $!"
    i=$((i + 1))
    sleep "${STAGGER_S:-20}"  # SGLang servers measure free GPU memory at start: one at a time
  done
  ;;
wait)
  end=$((SECONDS + ${WAIT_S:-540}))
  while [ $SECONDS -lt $end ]; do
    alive=0
    for f in "$DIR"/p*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && alive=$((alive + 1)); done
    [ $alive -eq 0 ] && break
    sleep 15
  done
  for f in "$DIR"/p*.log; do
    echo "== $f: $(grep -c 'greedy accuracy after' "$f") runs done; last step: $(grep -o 'step [0-9]*/[0-9]*' "$f" | tail -1)"
  done
  echo "[async_parity] $alive process(es) still running"
  ;;
collect)
  # PACK=NAME: one NAME.tgz in $OUT instead of a file per process (a call brings back at most 8 files)
  dest=$OUT
  [ -n "${PACK:-}" ] && dest=$(mktemp -d)
  mkdir -p "$dest"
  cp "$DIR"/parity_p*.json "$dest/" 2>/dev/null
  for f in "$DIR"/p*.log; do tail -c 20000 "$f" >"$dest/$(basename "$f")"; done
  if [ -n "${PACK:-}" ]; then
    mkdir -p "$OUT" && tar czf "$OUT/$PACK.tgz" -C "$dest" . && rm -rf "$dest"
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  ;;
*)
  echo "usage: SEEDS=\"0,1 2,3\" bash $0 start | WAIT_S=540 bash $0 wait | bash $0 collect" >&2
  exit 2
  ;;
esac
