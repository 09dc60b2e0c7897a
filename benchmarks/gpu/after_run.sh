#!/bin/bash
# Sourced by the GPU-host scripts once their runs are over: `after_run TAG [PORT...]` kills any SGLang server
# still running (a run stops its own; this catches one a crash or a timeout left), only those on the given ports
# when some are given (another script's runs may share the host), and appends what `nvidia-smi` shows on the
# GPUs afterwards to $OUT/nvidia-smi.txt (the check that nothing outlived its run).
after_run() {
  local tag=$1; shift
  if [ $# -eq 0 ]; then
    pkill -f sglang.launch_server && echo "[$tag] an SGLang server was left running: killed" || true
  fi
  for port in "$@"; do
    pkill -f "sglang.launch_server.* --port $port( |\$)" && echo "[$tag] the SGLang server on port $port was left running: killed" || true
  done
  sleep 2
  echo "[$tag] GPU processes afterwards:" | tee -a "$OUT/nvidia-smi.txt"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv | tee -a "$OUT/nvidia-smi.txt"
  nvidia-smi --query-gpu=index,memory.used --format=csv | tee -a "$OUT/nvidia-smi.txt"
}
