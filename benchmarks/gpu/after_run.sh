#!/bin/bash
# Sourced by the GPU-host scripts once their runs are over: `after_run TAG` kills any SGLang server still running
# (a run stops its own; this catches one a crash or a timeout left) and appends what `nvidia-smi` shows on the
# GPUs afterwards to $OUT/nvidia-smi.txt (the check that nothing outlived its run).
after_run() {
  pkill -f sglang.launch_server && echo "[$1] an SGLang server was left running: killed" || true
  sleep 2
  echo "[$1] GPU processes afterwards:" | tee -a "$OUT/nvidia-smi.txt"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv | tee -a "$OUT/nvidia-smi.txt"
  nvidia-smi --query-gpu=index,memory.used --format=csv | tee -a "$OUT/nvidia-smi.txt"
}
